"""The periodic schemes' settings, checked when a strategy is built: each bad value raises
``ValueError`` naming the argument and what it takes, before anything is connected."""

from __future__ import annotations

from typing import Any

from lightning_commstrats.compression.exchange import SCALES, check_codec_settings, check_exchange_args
from lightning_commstrats.fault_tolerance import FaultTolerance, import_torchft
from lightning_commstrats.outer import check_outer_state

UNITS = ("samples", "steps")
PSEUDO_GRAD_BITS = (2, 4, 8, 16, 32)
OUTER_ARGUMENTS = ("outer_optimizer", "outer_lr", "outer_momentum", "outer_optimizer_kwargs")
# DiLoCo's outer Nesterov SGD by default (diloco, streaming_diloco, the advisor). In steady state, on
# pseudo-gradients that keep their direction from one sync to the next, it moves the global model by
# outer_lr / (1 - outer_momentum) times their average: 1.4x here. The paper's 0.7 and 0.9 make it 7x,
# which a short run trained from scratch does not survive (benchmarks/results/diloco_defaults/).
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.5


def check_period(sync_period: Any, sync_period_unit: Any) -> None:
    """Raise ``ValueError`` unless ``sync_period`` is a positive int and ``sync_period_unit`` one of :data:`UNITS`."""
    if isinstance(sync_period, bool) or not isinstance(sync_period, int) or sync_period <= 0:
        raise ValueError(f"sync_period must be a positive int, got {sync_period!r}")
    if sync_period_unit not in UNITS:
        raise ValueError(f"sync_period_unit={sync_period_unit!r} is not supported; choose one of {UNITS}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_periodic_settings(
    *,
    sync_period: Any,
    sync_period_unit: Any,
    parallelization_start: Any,
    pseudo_grad_bits: Any,
    pseudo_grad_scales: Any,
    pseudo_grad_codec: Any,
    topk_chunk: Any,
    topk_per_chunk: Any,
    error_feedback_decay: Any,
    topk_form: Any,
    topk_tile: Any,
    topk_sigmas: Any,
    small_tensor_numel: Any,
    half_dtype: Any,
    num_fragments: Any,
    fragment_sync_delay: Any,
    fragment_update_alpha: Any,
    keep_local_progress: Any,
    fault_tolerance: Any,
    outer_state: Any,
    outer_lr: Any,
    outer_momentum: Any,
    expert_parallel: Any,
    shard: Any,
    residuals: Any = None,
) -> FaultTolerance | None:
    """Raise ``ValueError`` for the first setting of a periodic strategy that cannot work, naming it
    (and the other setting it conflicts with); returns the fault-tolerance settings, resolved."""
    check_period(sync_period, sync_period_unit)
    if not isinstance(expert_parallel, bool):
        raise ValueError(f"expert_parallel must be True or False, got {expert_parallel!r}")
    if expert_parallel and shard != "fsdp":
        raise ValueError(
            "expert_parallel=True needs shard='fsdp': the ranks of a group share their experts and FSDP2"
            " reduces the dense part's gradients inside the group; pass shard='fsdp' and group_size"
        )
    check_outer_state(outer_state)
    # residuals="device" is the base's default (what the CLI passes when it is not given): it follows
    # outer_state; "host" asked of a scheme whose outer state stays on the device is refused
    if residuals == "host" and outer_state != "host":
        raise ValueError(
            f"residuals={residuals!r} with outer_state={outer_state!r}: a periodic scheme keeps its"
            " slow hop's residuals with its outer state; set outer_state (leave residuals out)"
        )
    ft = FaultTolerance.of(fault_tolerance)
    if ft is not None:
        import_torchft()  # without the [ft] extra: the install hint now
        if sync_period_unit != "steps":
            raise ValueError(
                f"fault_tolerance needs sync_period_unit='steps', got {sync_period_unit!r}: replicas agree on"
                " when to sync by counting optimizer steps (a replica that heals takes over the step count)"
            )
        if parallelization_start:
            raise ValueError(
                f"fault_tolerance does not take a warm start (parallelization_start={parallelization_start}):"
                " across replicas only the periodic exchange is fault tolerant"
            )
    if not isinstance(parallelization_start, int) or parallelization_start < 0:
        raise ValueError(f"parallelization_start must be an int >= 0, got {parallelization_start!r}")
    if isinstance(pseudo_grad_bits, bool) or pseudo_grad_bits not in PSEUDO_GRAD_BITS:
        raise ValueError(f"pseudo_grad_bits={pseudo_grad_bits!r} is not supported; choose one of {PSEUDO_GRAD_BITS}")
    check_exchange_args(pseudo_grad_bits, half_dtype, small_tensor_numel, name="pseudo_grad_bits")
    if pseudo_grad_scales not in SCALES:
        raise ValueError(f"pseudo_grad_scales={pseudo_grad_scales!r} is not supported; choose one of {SCALES}")
    check_codec_settings(
        pseudo_grad_codec,
        pseudo_grad_bits,
        topk_chunk,
        topk_per_chunk,
        error_feedback_decay,
        topk_form,
        topk_tile,
        topk_sigmas,
        codec_name="pseudo_grad_codec",
        bits_name="pseudo_grad_bits",
    )
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"num_fragments must be an int >= 1, got {num_fragments!r}")
    if num_fragments > 1 and sync_period_unit != "steps":
        raise ValueError(f"num_fragments={num_fragments} needs sync_period_unit='steps', got {sync_period_unit!r}")
    if num_fragments > sync_period:
        raise ValueError(f"num_fragments={num_fragments} must be <= sync_period={sync_period}")
    if isinstance(fragment_sync_delay, bool) or not isinstance(fragment_sync_delay, int) or fragment_sync_delay < 0:
        raise ValueError(f"fragment_sync_delay must be an int >= 0, got {fragment_sync_delay!r}")
    if fragment_sync_delay and sync_period_unit != "steps":
        raise ValueError(
            f"fragment_sync_delay={fragment_sync_delay} counts optimizer steps: it needs"
            f" sync_period_unit='steps', got {sync_period_unit!r}"
        )
    if fragment_sync_delay and fragment_sync_delay * num_fragments >= sync_period:
        raise ValueError(
            f"fragment_sync_delay={fragment_sync_delay} must be < sync_period / num_fragments ="
            f" {sync_period}/{num_fragments}: a fragment's exchange must land before the next one starts"
        )
    if not is_number(fragment_update_alpha) or not 0.0 <= fragment_update_alpha <= 1.0:
        raise ValueError(f"fragment_update_alpha must be a number in [0, 1], got {fragment_update_alpha!r}")
    if not isinstance(keep_local_progress, bool):
        raise ValueError(f"keep_local_progress must be True or False, got {keep_local_progress!r}")
    if keep_local_progress and fragment_update_alpha != 0.0:
        raise ValueError(
            f"keep_local_progress=True keeps every local step, fragment_update_alpha={fragment_update_alpha!r}"
            " would mix them again: pass fragment_update_alpha=0"
        )
    if not is_number(outer_lr) or outer_lr <= 0:
        raise ValueError(f"outer_lr must be a number > 0, got {outer_lr!r}")
    if not is_number(outer_momentum) or not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
    return ft
