"""The bytes one rank holds between optimizer steps, scheme by scheme: :func:`memory_per_rank`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_commstrats.advisor.inputs import (
    PERIODIC,
    SHARDABLE,
    check_shard,
    checked_settings,
    int_setting,
    model_shape,
)
from lightning_commstrats.advisor.names import ACCELERATORS, INNER_OPTIMIZERS, PARAM_DTYPES
from lightning_commstrats.advisor.schedule import schedule_of
from lightning_commstrats.compression.aggregation import MatrixLayout
from lightning_commstrats.compression.exchange import EXCHANGE_BITS
from lightning_commstrats.compression.rows import resolve_count
from lightning_commstrats.cost_model import ModelShape
from lightning_commstrats.outer import OUTER_STATES
from lightning_commstrats.strategies.fragments import fragment_bounds
from lightning_commstrats.strategies.periodic_settings import DILOCO_OUTER_MOMENTUM


@dataclass(frozen=True)
class Memory:
    """The bytes one rank holds between optimizer steps (see :func:`memory_per_rank`).

    Attributes:
        parameters: this rank's parameters (its shards with ``shard > 1``).
        gradients: their gradients (``onebit_adam`` drops them after its own step; every backward
            makes them again).
        optimizer: the inner optimizer's state.
        scheme: the scheme's own state, as ``(what, bytes, where)``, ``where`` ``"device"`` or ``"host"``.
        on_device: where ``parameters``, ``gradients`` and ``optimizer`` live: ``"device"`` (a GPU
            run) or ``"host"`` (a CPU run, where everything is host memory).
        shard: the ranks a replica is sharded over (1: every rank holds the whole model).
        step_counts: the part of ``optimizer`` that is Adam's step count per tensor (4 bytes each):
            torch keeps them in host memory unless the optimizer is ``capturable`` or ``fused``.
    """

    parameters: int
    gradients: int
    optimizer: int
    scheme: tuple[tuple[str, int, str], ...]
    on_device: str = "device"
    shard: int = 1
    step_counts: int = 0

    def scheme_bytes(self, where: str | None = None) -> int:
        """The scheme's state in bytes: all of it, or what lives at ``where`` (``"device"``, ``"host"``)."""
        return sum(b for _, b, w in self.scheme if where is None or w == where)

    def _at(self, where: str) -> int:
        own = self.parameters + self.gradients + self.optimizer - self.step_counts if self.on_device == where else 0
        return own + (self.step_counts if where == "host" else 0) + self.scheme_bytes(where)

    @property
    def device(self) -> int:
        """Bytes of device (accelerator) memory."""
        return self._at("device")

    @property
    def host(self) -> int:
        """Bytes of host memory."""
        return self._at("host")

    @property
    def total(self) -> int:
        return self.device + self.host


def memory_per_rank(
    scheme: str,
    settings: Mapping[str, Any] | None,
    model: ModelShape | Any,
    *,
    ranks: int,
    shard: int = 1,
    optimizer: str = "adamw",
    param_dtype: str = "float32",
    outer_state: str = "host",
    accelerator: str = "gpu",
) -> Memory:
    """The bytes one rank holds between optimizer steps under ``scheme`` at ``settings``, as the
    strategies and ``torch.optim`` allocate them (read from their code; ``tests/test_advisor.py``
    checks it against the tensors real strategies hold on two ranks).

    Every rank holds its parameters, their gradients and the inner optimizer's state (``optimizer``:
    ``"adamw"`` and ``"adam"`` two buffers of the parameters' size and a 4-byte step count per tensor,
    ``"sgd_momentum"`` one buffer, ``"sgd"`` none). The scheme's own state (with ``ranks > 1``):

    - ``allreduce``: its fused gradient buckets, kept from step to step (one copy of the gradients;
      none sharded in a single group, where nothing crosses groups);
    - ``onebit_sgd`` (and ``sampled_vocab`` for the tensors outside the vocabulary): below 32 bits, the
      error-feedback residuals in float32, stage 1 the size of every quantized matrix, stage 2 the
      rank's stripe of it (a ``1/ranks`` share; rank 0's, the largest, is counted), plus the buckets
      of the tensors sent in full precision; at 32 bits the buckets of every gradient;
    - ``onebit_adam``: as ``onebit_sgd`` past the freeze (its momentum travels as ``onebit_sgd``'s
      gradients do; the fp32 warm-up's gradient buckets are released at the freeze), or, when larger,
      over the last ``settling_window`` steps before the freeze: those buckets and the settling
      check's copy of each tensor's sum of ``sqrt(v)`` (none with ``settling_warning=None``);
    - ``zero_one_adam``: as ``onebit_adam``, with its cached preconditioner (one copy of the
      parameters) and, with local steps (``local_step_clipper`` > 1), the weights at the last
      synchronisation and the accumulated momentum (two more); without them, the fp32 rounds'
      gradient buckets (until ``var_freeze_step``);
    - ``sampled_vocab``: also a flag per word, the frequent words' ids, the last step's row ids (at
      most 8 bytes a word) and,
      with ``error_feedback``, the unsent rows (the vocabulary matrices' size);
    - the periodic schemes: the global model in float32 and the outer optimizer's state (``bmuf``'s
      block momentum, ``diloco`` and ``streaming_diloco``'s Nesterov momentum, none for
      ``model_averaging``, ``local_sgd`` and ``sparseloco``), at ``outer_state`` (``"host"``: pinned
      host memory on a GPU run; ``"device"``); below 32 bits the quantization residuals as above
      (stripes of the pseudo-gradient's rows), or ``sparseloco``'s error-feedback buffer (the synced
      tensors in float32, each padded to whole chunks where it is made, on the device); with a
      ``fragment_sync_delay``, the exchange in flight on the device for that many steps of every
      period: the largest fragment's pseudo-gradient, and its local weights at the launch with
      ``keep_local_progress``. The in-flight bytes are held only between an exchange's launch and
      its landing; they are counted here because that is the peak between steps.

    ``shard`` > 1 (``shard="fsdp"`` with ``group_size=shard``): every tensor is cut along its first
    dimension over the ``shard`` ranks of a group (rank 0's shard, the largest, counted); the scheme
    state is per local shard, and the quantization residuals' stripes are cut over the
    ``ranks / shard`` groups that exchange (none with a single group: nothing is exchanged).

    Not counted: module buffers, activations, FSDP2's gathered units and unsharded gradients during
    forward and backward, the transient buffers of a sync (flat copies of a fragment, the pseudo-gradient
    being made, the codec's scratch), the local weights set aside while validating a periodic scheme on
    the global model, and the allocator's slack.

    Args:
        scheme, settings, model: as :func:`predict`.
        ranks: the number of ranks.
        shard: the ranks a replica is sharded over (1: every rank holds the whole model).
        optimizer: the inner optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd_momentum"``, ``"sgd"``.
        param_dtype: the parameters' dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); gradients and
            the inner optimizer's state take it; the scheme state the strategies keep in float32 stays so.
        outer_state: where the periodic schemes keep their global copy, outer state and residuals
            (the strategies' ``outer_state``): ``"host"`` (default) or ``"device"``.
        accelerator: ``"gpu"`` (default: the training device is a GPU) or ``"cpu"`` (everything is
            host memory).

    Raises:
        ValueError: naming the argument: an unknown scheme or setting, ``shard`` that does not divide
            ``ranks``, ``shard > 1`` for a scheme that does not run sharded, an unknown optimizer,
            dtype, ``outer_state`` or accelerator.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    check_shard(shard, ranks)
    if optimizer not in INNER_OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not supported; choose one of {tuple(INNER_OPTIMIZERS)}")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r} is not supported; choose one of {tuple(PARAM_DTYPES)}")
    if outer_state not in OUTER_STATES:
        raise ValueError(f"outer_state={outer_state!r} is not supported; choose one of {OUTER_STATES}")
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not supported; choose one of {ACCELERATORS}")
    if not isinstance(model, ModelShape):
        model = model_shape(model)
    settings = checked_settings(scheme, settings)
    if shard > 1 and scheme not in SHARDABLE:
        raise ValueError(f"shard={shard}: {scheme} does not run sharded; the schemes that do: {SHARDABLE}")
    if scheme in ("onebit_adam", "zero_one_adam") and optimizer not in ("adam", "adamw"):
        raise ValueError(f"optimizer={optimizer!r}: {scheme} continues the user's Adam or AdamW")
    width = PARAM_DTYPES[param_dtype]
    local = [_local_shape(s, shard) for s in model.shapes]
    numel = sum(math.prod(s) for s in local)
    buffers, counts_steps = INNER_OPTIMIZERS[optimizer]
    params = numel * width
    counts = 4 * len(local) if counts_steps else 0
    inner = buffers * params + counts
    replicas = ranks // shard
    if scheme in PERIODIC:
        parts = _periodic_state(scheme, settings, local, replicas, outer_state, accelerator)
    elif ranks == 1:  # a one-rank run exchanges nothing and keeps nothing for it
        parts = []
    else:
        parts = _gradient_state(scheme, settings, model, local, replicas, width)
    if scheme == "zero_one_adam":
        parts = _zero_one_adam_state(settings, parts, numel * width, ranks)
    if scheme == "onebit_adam":
        parts = _onebit_adam_state(settings, parts, numel, width, ranks, len(local))
    if accelerator == "cpu":
        parts = [(what, nbytes, "host") for what, nbytes, _ in parts]
    where = "host" if accelerator == "cpu" else "device"
    return Memory(params, params, inner, tuple(p for p in parts if p[1]), where, shard, counts)


def _local_shape(shape: tuple[int, ...], shard: int) -> tuple[int, ...]:
    """Rank 0's FSDP2 shard of a tensor of ``shape``: its first dimension cut in ``shard`` chunks."""
    if shard == 1 or not shape:
        return tuple(shape)
    return (-(-shape[0] // shard), *shape[1:])


def _stripe_numel(shape: tuple[int, ...], ranks: int, by_rows: bool) -> int:
    """Values of rank 0's stripe of a matrix in the two-stage quantized exchange over ``ranks``."""
    lay = MatrixLayout.of(torch.Size(shape), ranks, by_rows)
    c0, c1 = lay.stripes[0]
    return (c1 - c0) * lay.rows


def _residuals(shapes: Sequence[tuple[int, ...]], ranks: int, small: int, by_rows: bool) -> list[tuple[str, int]]:
    """The two stages' error-feedback residuals (float32) of the matrices a quantized exchange sends."""
    quantized = [s for s in shapes if len(s) >= 2 and math.prod(s) > small]
    return [
        ("error-feedback residuals, stage 1", 4 * sum(math.prod(s) for s in quantized)),
        (
            "error-feedback residuals, stage 2 (this rank's stripe)",
            4 * sum(_stripe_numel(s, ranks, by_rows) for s in quantized),
        ),
    ]


def _onebit_adam_state(
    settings: Mapping[str, Any], parts: list[tuple[str, int, str]], numel: int, width: int, ranks: int, tensors: int
) -> list[tuple[str, int, str]]:
    """``onebit_adam``'s state at its largest: after the freeze (``parts``), or over the settling
    check's window before it, the fp32 warm-up's gradient buckets and the check's copy of each tensor's
    sum of ``sqrt(v)`` (4 bytes a tensor)."""
    if settings.get("settling_warning", 0.03) is None:
        return parts
    window = [("the settling check's per-tensor sums of sqrt(v) (before the freeze)", 4 * tensors, "device")]
    if ranks > 1:
        window.insert(0, ("gradient buckets of the fp32 warm-up", width * numel, "device"))
    return window if sum(n for _, n, _ in window) > sum(n for _, n, _ in parts) else parts


def _zero_one_adam_state(
    settings: Mapping[str, Any], parts: list[tuple[str, int, str]], params: int, ranks: int
) -> list[tuple[str, int, str]]:
    """``zero_one_adam``'s state at its largest: the quantized exchange's (as ``onebit_adam``'s), its
    cached preconditioner, and either the weights at the last synchronisation and ``u_i`` (with local
    steps; kept once made) or the fp32 rounds' gradient buckets (without: they are the larger then)."""
    parts = [*parts, ("the preconditioner sqrt(v) + eps, cached", params, "device")]
    if int_setting(settings, "local_step_clipper", 16) > 1:
        return [
            *parts,
            ("the weights at the last synchronisation", params, "device"),
            ("the accumulated momentum u", params, "device"),
        ]
    if ranks > 1:
        parts.append(("gradient buckets of the fp32 rounds (until var_freeze_step)", params, "device"))
    return parts


def _gradient_state(
    scheme: str, settings: Mapping[str, Any], model: ModelShape, local: list[tuple[int, ...]], replicas: int, width: int
) -> list[tuple[str, int, str]]:
    numel = sum(math.prod(s) for s in local)
    if scheme == "allreduce":  # sharded in one group, FSDP2 reduced the gradients: nothing crosses, no bucket
        return [("gradient buckets kept between steps", width * numel, "device")] if replicas > 1 else []
    if scheme == "sampled_vocab":
        v, vw = model.vocab_size, model.vocab_width
        if not v or not vw:
            raise ValueError("sampled_vocab needs the model's vocab_size and vocab_width (no vocabulary is known)")
        if int_setting(settings, "num_quantization_bits", 32) != 32:
            raise ValueError("settings: the advisor predicts sampled_vocab with num_quantization_bits=32 only")
        parts = [
            ("buckets of the tensors outside the vocabulary", width * (numel - v * vw), "device"),
            ("a flag per word of the vocabulary", v + 1, "device"),
            ("the frequent words' ids", 8 * resolve_count(settings.get("alpha", 2000), v, "alpha"), "device"),
            ("the last step's row ids (at most)", 8 * v, "device"),
        ]
        if settings.get("error_feedback", False):
            parts.append(("unsent vocabulary rows (error feedback)", width * v * vw, "device"))
        return parts
    parts = []  # (onebit_adam releases its fp32 warm-up's gradient buckets at the freeze)
    if replicas == 1:  # one group: the exchange across groups has no one to exchange with
        return parts
    bits = int_setting(settings, "num_quantization_bits", 1, EXCHANGE_BITS)
    small = int_setting(settings, "small_tensor_numel", 1024)
    full = [s for s in local if bits == 32 or not (len(s) >= 2 and math.prod(s) > small)]
    parts.append(("buckets of the tensors sent in full precision", width * sum(math.prod(s) for s in full), "device"))
    if bits < 32:
        parts += [(what, nbytes, "device") for what, nbytes in _residuals(local, replicas, small, by_rows=False)]
    return parts


def _periodic_state(
    scheme: str,
    settings: Mapping[str, Any],
    local: list[tuple[int, ...]],
    replicas: int,
    outer_state: str,
    accelerator: str,
) -> list[tuple[str, int, str]]:
    sched = schedule_of(scheme, settings, len(local))
    home = "device" if outer_state == "device" else "host"
    sizes = [math.prod(s) for s in local]
    numel = sum(sizes)
    parts = [("global model (float32)", 4 * numel, home)]
    if scheme == "bmuf":
        parts.append(("block momentum", 4 * numel, home))
    elif scheme in ("diloco", "streaming_diloco"):
        momentum = settings.get("outer_momentum", DILOCO_OUTER_MOMENTUM)
        if not isinstance(momentum, (int, float)) or isinstance(momentum, bool) or not 0 <= momentum < 1:
            raise ValueError(f"settings: outer_momentum must be a number in [0, 1), got {momentum!r}")
        if momentum > 0:
            parts.append(("outer Nesterov momentum", 4 * numel, home))
    bounds = fragment_bounds(sizes, sched.fragments)
    if replicas > 1 and sched.gather is not None:  # made and kept unpadded, tensor by tensor
        parts.append(("error-feedback buffer (gathered exchange)", 4 * sum(k for k in sizes if k > sched.small), home))
    elif replicas > 1 and sched.sparse is not None:
        chunk, small = sched.sparse.chunk, sched.small
        # made on the device as one block per fragment, each tensor padded to whole chunks; kept there,
        # or copied unpadded to pinned host memory on a GPU run with outer_state="host"
        if home == "host" and accelerator == "gpu":
            nbytes = 4 * sum(k for k in sizes if k > small)
        else:
            nbytes = 4 * sum(-(-k // chunk) * chunk for k in sizes if k > small)
        parts.append(("error-feedback buffer (sparse exchange)", nbytes, home))
    elif replicas > 1 and sched.bits < 32:
        parts += [(what, nbytes, home) for what, nbytes in _residuals(local, replicas, sched.small, sched.by_rows)]
    if sched.delay:
        largest = 4 * max(sum(sizes[i0:i1]) for i0, i1 in bounds)
        parts.append(("exchange in flight: the largest fragment's pseudo-gradient", largest, "device"))
        if sched.keep_local_progress:
            parts.append(("exchange in flight: its local weights at the launch", largest, "device"))
    return parts
