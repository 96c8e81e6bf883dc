"""Real-rank runs replayed through the plain-torch reference (``tests/reference.py``).

Ranks agreeing with each other is not enough: an exchange that sums instead of averaging, or an outer
step that drops its momentum, keeps every rank identical. Here each scheme runs on real ranks
(``reference_worker.py``: a small fp32 MLP, gloo on CPU), which record the weights training started
from and every batch they trained on; the reference, which shares no code with the package, replays
those batches with one model replica per worker in this process, and the weights must agree: after
every step (each rank against its worker) and at the end of fit.

Schemes and settings: ``allreduce``, ``model_averaging``, ``bmuf`` and 32-bit ``diloco`` on 2 and 4
ranks (4 also sharded: ``shard="fsdp"``, 2 groups of 2); on 2 ranks also ``streaming_diloco`` (2 fragments,
delay 0 and 1, mixing ``alpha = 0.25``, 4-bit pseudo-gradients), ``onebit_sgd`` at 32 and 1 bit,
``diloco`` with 8-bit pseudo-gradients, ``nonfinite="skip"`` with an inf injected into one rank's
gradient at one step (``allreduce``: the step is skipped; ``diloco`` at 32 and 8 bits: the block is
discarded), and runs resumed from a checkpoint mid-block (:data:`RESUME`: DiLoCo at 8 bits; Streaming
DiLoCo with an exchange in flight) against the reference of the uninterrupted run.

Tolerance. Where the arithmetic is the same in the same order the weights are compared bit for bit
(:data:`EXACT`): ``allreduce`` on 2 ranks (a sum of two gradients does not depend on its order, and
the division by 2 is exact), also with a skipped step, ``onebit_sgd`` at 32 bits (which is
``allreduce``: it also equals the real ``allreduce`` run bit for bit), and ``allreduce`` with
``shard="fsdp"`` on 2 groups of 2 (FSDP2's reduce-scatter inside a group and the all-reduce across the
two groups are each a sum of two, halved, as the reference's mean of the group's two gradients, then of
the two groups'). Elsewhere the order of float32 operations differs, and the weights (at most 0.5 in
magnitude) are compared within ``ATOL`` absolute (``RTOL`` 0; an inf or a NaN, in a rank that trained on
an inf gradient, must be one in both at the same place):

- the periodic schemes average the ranks' pseudo-gradients ``mean_r(w_start - w_r)`` and step the
  global model with ``torch.optim``'s ``add(..., alpha=-lr)``; the reference takes
  ``w_start - mean_r w_r`` (32-bit DiLoCo) and writes the outer step (and Streaming DiLoCo's mixing
  ``alpha w_local + (1 - alpha) w_global``, the package's ``lerp``) out. Each sync differs by about one
  float32 rounding (3e-8 on weights below 0.5), and a few steps of lr 0.1 SGD or lr 0.01 AdamW carry it
  without amplifying it much;
- on 4 unsharded ranks gloo sums the ranks' gradients in its ring's order, the reference in rank
  order (measured: 3e-8);
- the codecs. 1 bit: the reference's two means per column (``onebit_reference.compress``) are summed
  in float64 and rounded, the package's in float32: a mean differs by about one rounding, and no sign
  (the only discontinuity) is near enough to 0 to flip; measured 4.5e-8. A flipped sign would move a
  gradient value by the gap between its column's two means (about 1e-2) and lie far outside
  ``ATOL``. The uniform 8- and 4-bit grids: the reference performs the float32 operations that the
  codec's docstring states, in its order, so every value lands in the same bin; measured 3e-8 to
  6e-8. The codec itself moves a value by up to half a level step of its row: measured, 6.3e-5 to
  2.3e-4 at 8 bits, 1.1e-4 to 4.5e-3 at 4 bits (per pseudo-gradient value), so one value in another
  bin would differ by a whole step, at least 60 times ``ATOL``; each test asserts ``10 ATOL`` is
  below the smallest half step seen.

Measured (2 and 4 ranks, 6 to 10 steps, every scenario below, twice): the largest difference over every step,
rank and weight is 1.2e-7 (``bmuf_classic_samples``; :data:`MEASURED`). ``ATOL = 1e-6`` is 8 times that.
The effect of a wrong average is far larger: each test replays the reference with the workers'
contributions summed instead of averaged (``reduce="sum"``), and the real run must lie more than
``FAR = 1e-3`` (1000 times ``ATOL``) from it; measured, it lies 0.06 to 0.48 from it (new scenarios:
0.07 to 0.25). DiLoCo and Streaming DiLoCo without their outer momentum lie 0.025 to 0.08 away; BMUF on
4 ranks with its default block momentum miscounted (``1 - 1/2`` for 4 workers, ``1 - 1/4`` for 2 sharded
groups) 0.011 to 0.014. :data:`CONTROLS` adds, per scenario: Streaming DiLoCo with another delay or
mixing, 2.7e-3 to 5.6e-2 away; 1-bit SGD without error feedback 0.12, at 32 bits 0.10; a skipped step
(block) taken as if there had been no inf, 0.06 to 0.10. At the codecs' own scale (``CODEC_FAR`` =
1e-4, 100 times ``ATOL``): 8-bit DiLoCo with its residuals dropped lies 4.2e-4 (5.2e-4 with the skip)
away, unquantized 1.8e-4 (3.7e-4); 4-bit Streaming DiLoCo 7.5e-3 and 2.6e-3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import reference
import torch
from harness import run_ranks
from torch import nn

pytestmark = [pytest.mark.reference, pytest.mark.multiprocess]

WORKER = Path(__file__).parent / "reference_worker.py"
IN, HIDDEN, OUT = 8, 16, 4  # the worker's MLP

ATOL = 1e-6
RTOL = 0.0
FAR = 1e-3
CODEC_FAR = 1e-4  # 100 x ATOL: the controls at the scale of the 8- and 4-bit codecs' error (module docstring)
MEASURED = 1.2e-7  # the largest real-vs-reference difference seen (see the module docstring)
EXACT = {  # compared bit for bit
    ("pair", "allreduce"),
    ("pair", "onebit_sgd_32"),
    ("pair", "allreduce_skip"),
    ("quad", "allreduce_fsdp"),
}

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
PLAIN_SGD = {"name": "sgd", "lr": 0.1}
ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01}
STEPS = {"sync_period_unit": "steps"}
FSDP = {"shard": "fsdp", "group_size": 2, "shard_policy": {"min_unit_numel": 1}}
# the MLP's matrices hold 128 and 64 values: quantized only below the default small_tensor_numel (1024)
QUANTIZE_MATRICES = {"small_tensor_numel": 16}
STREAM = {"sync_period": 4, "num_fragments": 2, "pseudo_grad_bits": 32}

# name: the scheme (a registry name, and the reference function of that name), its strategy
# arguments and the worker's settings
PAIR: dict[str, dict[str, Any]] = {
    "allreduce": {"scheme": "allreduce", "kwargs": {}, "max_steps": 8, "optimizer": SGD},
    "model_averaging": {
        "scheme": "model_averaging",
        "kwargs": {"sync_period": 3, **STEPS},
        "max_steps": 8,  # blocks end after steps 3 and 6; fit ends inside the third: merged
        "optimizer": SGD,
    },
    "bmuf": {  # the defaults: block momentum 1 - 1/N, block lr 1, Nesterov, momentum reset
        "scheme": "bmuf",
        "kwargs": {"sync_period": 3, **STEPS},
        "max_steps": 10,
        "optimizer": SGD,
    },
    "bmuf_classic_samples": {  # CNTK's unit: 8 samples per worker = 2 batches of 4
        "scheme": "bmuf",
        "kwargs": {
            "sync_period": 8,
            "block_momentum": 0.6,
            "block_learning_rate": 0.9,
            "use_nesterov_momentum": False,
            "reset_sgd_momentum": False,
        },
        "max_steps": 8,  # blocks end after steps 2, 4, 6, 8: nothing to merge
        "optimizer": SGD,
    },
    "diloco": {"scheme": "diloco", "kwargs": {"sync_period": 3}, "max_steps": 8, "optimizer": ADAMW},
    "diloco_reset": {
        "scheme": "diloco",
        "kwargs": {"sync_period": 4, "outer_lr": 0.5, "outer_momentum": 0.8, "reset_sgd_momentum": True},
        "max_steps": 8,
        "optimizer": ADAMW,
    },
    # Streaming DiLoCo, 2 fragments (net.0.weight; the rest), H = 4: fragment 0's turns after steps 2, 6,
    # fragment 1's after 4, 8. Fit ends after step 9, where fragment 1's exchange of step 8 lands (delay 1)
    "streaming_delay0": {
        "scheme": "streaming_diloco",
        "kwargs": {**STREAM, "fragment_sync_delay": 0},
        "max_steps": 9,
        "optimizer": ADAMW,
    },
    "streaming_delay1": {
        "scheme": "streaming_diloco",
        "kwargs": {**STREAM, "fragment_sync_delay": 1},
        "max_steps": 9,
        "optimizer": ADAMW,
        "ckpt_every": 3,  # resumed from step 6 below, fragment 0's exchange in flight
        "epoch_steps": 3,
    },
    "streaming_delay1_mixed": {  # fit ends after step 8 with fragment 1's exchange in flight: it lands then
        "scheme": "streaming_diloco",
        "kwargs": {**STREAM, "fragment_sync_delay": 1, "fragment_update_alpha": 0.25, "reset_sgd_momentum": True},
        "max_steps": 8,
        "optimizer": SGD,
    },
    "streaming_delay1_4bit": {
        "scheme": "streaming_diloco",
        "kwargs": {**STREAM, "fragment_sync_delay": 1, "pseudo_grad_bits": 4, **QUANTIZE_MATRICES},
        "max_steps": 9,
        "optimizer": ADAMW,
    },
    # 1-bit SGD: 32 bits is allreduce; 1 bit per value and two means per column of both matrices
    "onebit_sgd_32": {
        "scheme": "onebit_sgd",
        "kwargs": {"num_quantization_bits": 32, **QUANTIZE_MATRICES},
        "max_steps": 8,
        "optimizer": SGD,
    },
    "onebit_sgd": {
        "scheme": "onebit_sgd",
        "kwargs": {"num_quantization_bits": 1, **QUANTIZE_MATRICES},
        "max_steps": 8,
        "optimizer": SGD,
    },
    # DiLoCo with 8-bit pseudo-gradients (uniform grid, a scale pair per row, error feedback)
    "diloco_8bit": {
        "scheme": "diloco",
        "kwargs": {"sync_period": 3, "pseudo_grad_bits": 8, **QUANTIZE_MATRICES},
        "max_steps": 8,
        "optimizer": ADAMW,
        "ckpt_every": 4,  # resumed from step 4 below, mid-block
        "epoch_steps": 4,
    },
    # nonfinite="skip": an inf in rank 1's gradient of net.2.weight at step 3 (0-based; 4 for DiLoCo)
    "allreduce_skip": {
        "scheme": "allreduce",
        "kwargs": {"nonfinite": "skip"},
        "max_steps": 8,
        "optimizer": SGD,
        "inject_inf": [3, 1, "net.2.weight"],
    },
    "diloco_skip": {  # the block of steps 4-6 is discarded; inner SGD without momentum (no state to poison)
        "scheme": "diloco",
        "kwargs": {"sync_period": 3, "nonfinite": "skip"},
        "max_steps": 9,
        "optimizer": PLAIN_SGD,
        "inject_inf": [4, 1, "net.2.weight"],
    },
    "diloco_8bit_skip": {  # the same, 8 bits: the discarded block moves no residual
        "scheme": "diloco",
        "kwargs": {"sync_period": 3, "nonfinite": "skip", "pseudo_grad_bits": 8, **QUANTIZE_MATRICES},
        "max_steps": 9,
        "optimizer": PLAIN_SGD,
        "inject_inf": [4, 1, "net.2.weight"],
    },
}
# runs resumed from a checkpoint of a PAIR scenario (same spec, same ranks), replayed as that uninterrupted run
RESUME: dict[str, dict[str, Any]] = {
    "diloco_8bit_resumed": {**PAIR["diloco_8bit"], "ckpt_every": None, "resume": ["diloco_8bit", 4]},
    "streaming_delay1_resumed": {**PAIR["streaming_delay1"], "ckpt_every": None, "resume": ["streaming_delay1", 6]},
}
QUAD: dict[str, dict[str, Any]] = {
    "allreduce": {"scheme": "allreduce", "kwargs": {}, "max_steps": 6, "optimizer": SGD},
    "model_averaging": {  # 8 samples per worker = 2 batches of 4; blocks end after steps 2, 4, 6, merged at 7
        "scheme": "model_averaging",
        "kwargs": {"sync_period": 8, "reset_sgd_momentum": True},
        "max_steps": 7,
        "optimizer": SGD,
    },
    "bmuf": {"scheme": "bmuf", "kwargs": {"sync_period": 3, **STEPS}, "max_steps": 8, "optimizer": SGD},
    "diloco": {"scheme": "diloco", "kwargs": {"sync_period": 3}, "max_steps": 8, "optimizer": ADAMW},
    # 2 groups of 2 ranks, each group one FSDP2-sharded worker
    "allreduce_fsdp": {
        "scheme": "allreduce",
        "kwargs": FSDP,
        "max_steps": 6,
        "optimizer": SGD,
        "same_seed": True,
    },
    "bmuf_fsdp": {
        "scheme": "bmuf",
        "kwargs": {"sync_period": 3, **STEPS, **FSDP},
        "max_steps": 8,
        "optimizer": SGD,
        "same_seed": True,
    },
    "diloco_fsdp": {
        "scheme": "diloco",
        "kwargs": {"sync_period": 3, **FSDP},
        "max_steps": 8,
        "optimizer": ADAMW,
        "same_seed": True,
    },
}
# the reference's arguments that are not strategy arguments of the same name
NOT_REFERENCE = ("shard", "group_size", "shard_policy")
GRADIENT_SCHEMES = ("allreduce", "onebit_sgd")
# per scenario, further references with a mistake the real run must lie far from, and how far
CONTROLS: dict[str, list[tuple[dict[str, Any], float]]] = {
    "streaming_delay0": [({"fragment_update_alpha": 0.25}, FAR)],
    "streaming_delay1": [({"fragment_sync_delay": 0}, FAR)],
    "streaming_delay1_mixed": [
        ({"fragment_update_alpha": 0.0}, FAR),
        ({"fragment_sync_delay": 0}, FAR),
        ({"reset_sgd_momentum": False}, FAR),
    ],
    "streaming_delay1_4bit": [({"error_feedback": False}, CODEC_FAR), ({"pseudo_grad_bits": 32}, CODEC_FAR)],
    "onebit_sgd": [({"error_feedback": False}, FAR), ({"num_quantization_bits": 32}, FAR)],
    "diloco_8bit": [({"error_feedback": False}, CODEC_FAR), ({"pseudo_grad_bits": 32}, CODEC_FAR)],
    "allreduce_skip": [({"inject": {}}, FAR)],  # the step was skipped: taking it lies far
    "diloco_skip": [({"inject": {}}, FAR)],  # the block was discarded: keeping it (no inf) lies far
    "diloco_8bit_skip": [({"error_feedback": False}, CODEC_FAR)],
}


class Net(nn.Module):
    """The worker's MLP, in plain torch (the same parameter names)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _optimizer(settings: dict[str, Any]) -> reference.OptimizerFactory:
    settings = dict(settings)
    kind = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[settings.pop("name")]
    return lambda params: kind(params, **settings)


def _spec(scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "scenarios": {
            name: {"strategy": sc["scheme"], **{k: v for k, v in sc.items() if k != "scheme"}}
            for name, sc in scenarios.items()
        }
    }


@pytest.fixture(scope="module")
def pair() -> list[dict[str, Any]]:
    return run_ranks(_spec({**PAIR, **RESUME}), 2, script=WORKER)


@pytest.fixture(scope="module")
def quad() -> list[dict[str, Any]]:
    return run_ranks(_spec(QUAD), 4, script=WORKER)


def replay(sc: dict[str, Any], ranks: list[dict[str, Any]], **override: Any) -> reference.Run:
    """The reference run of scenario ``sc`` on the batches the real ranks trained on."""
    scheme = getattr(reference, sc["scheme"])
    settings = {k: v for k, v in sc["kwargs"].items() if k not in NOT_REFERENCE}
    group_size = sc["kwargs"].get("group_size", 1) if sc["kwargs"].get("shard") else 1
    if sc.get("inject_inf"):
        step, rank, name = sc["inject_inf"]
        settings["inject"] = {(rank, step): name}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): the same kernels
    try:
        return scheme(
            ranks[0]["start"],
            Net,
            [r["batches"] for r in ranks],
            _optimizer(sc["optimizer"]),
            group_size=group_size,
            **{**settings, **override},
        )
    finally:
        torch.set_num_threads(threads)


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in state.values()])


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return (_flat(a) - _flat(b)).abs().max().item()


def same(real: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str, exact: bool = False) -> None:
    """Bit for bit, or within ``ATOL``; an inf or a NaN (a rank that trained on an inf gradient) must be
    one in both, in the same place."""
    assert list(real) == list(ref), what
    for name in ref:
        if exact:
            assert torch.equal(real[name], ref[name]), f"{what}: {name} differs bit-wise"
        else:
            torch.testing.assert_close(
                real[name], ref[name], rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m: f"{what}: {m}"
            )


def check_run(sc: dict[str, Any], ranks: list[dict[str, Any]], exact: bool) -> reference.Run:
    """The real ranks against the reference replay: the start, the schedule, every step, the end."""
    world = len(ranks)
    group_size = sc["kwargs"].get("group_size", 1) if sc["kwargs"].get("shard") else 1
    start = ranks[0]["start"]
    # every rank starts from the same weights; unsharded, rank 0's (the others built their own)
    for r in ranks:
        assert distance(r["start"], start) == 0.0
    if not sc.get("same_seed"):
        assert distance(ranks[0]["built"], start) == 0.0
        assert distance(ranks[1]["built"], start) > 0.01  # so the broadcast mattered
    # every rank trained on its own batches
    assert all(len(r["batches"]) == sc["max_steps"] for r in ranks)
    assert not torch.equal(ranks[0]["batches"][0][0], ranks[1]["batches"][0][0])

    run = replay(sc, ranks)
    for t in range(sc["max_steps"]):
        for r in range(world):
            same(ranks[r]["steps"][t], run.steps[t][r // group_size], f"rank {r} after step {t + 1}", exact)
    for r in range(world):
        same(ranks[r]["final"], run.final, f"rank {r} at the end of fit", exact)

    if sc["scheme"] not in GRADIENT_SCHEMES:  # the same schedule: the syncs, then the end-of-fit merge
        applied = [step for _, _, step in ranks[0]["sync_history"]]
        if run.history:  # (fragment, launched after, applied after) of every sync and merge
            assert [tuple(h) for h in ranks[0]["sync_history"]] == run.history
        else:
            assert applied == run.syncs + ([sc["max_steps"]] if run.merged else [])
        assert len(run.syncs) >= 2
    return run


def check_far_from_wrong(sc: dict[str, Any], ranks: list[dict[str, Any]], far: float = FAR, **wrong: Any) -> float:
    """The real run lies far (more than ``far``: ``FAR``, 1000 x ``ATOL``, unless told) from a reference
    with a mistake."""
    off = distance(ranks[0]["final"], replay(sc, ranks, **wrong).final)
    assert off > far, f"{wrong}: the real run is only {off:.2e} from it"
    return off


@pytest.mark.parametrize("name", list(PAIR))
def test_two_ranks_replay_through_the_reference(pair, name):
    sc = PAIR[name]
    ranks = [r[name] for r in pair]
    run = check_run(sc, ranks, exact=("pair", name) in EXACT)
    check_far_from_wrong(sc, ranks, reduce="sum")
    if sc["scheme"] in ("diloco", "streaming_diloco"):  # an outer step that ignores its momentum
        check_far_from_wrong(sc, ranks, outer_momentum=0.0)
    for wrong, far in CONTROLS.get(name, []):
        check_far_from_wrong(sc, ranks, far, **wrong)
    if run.exchange is not None and run.exchange.half_steps:
        # a single value one level off (two half steps of its line) would move the trajectory by far more
        # than ATOL: the tolerance does not hide a misplaced bin
        assert 10 * ATOL < min(run.exchange.half_steps)
    if sc.get("inject_inf"):  # the inf reached the package, and the step (block) was skipped on every rank
        step, rank, _ = sc["inject_inf"]
        if sc["scheme"] in GRADIENT_SCHEMES:  # that step (0-based)
            assert run.discarded == [step]
        else:  # the block holding it (blocks end after steps H, 2H, ...)
            assert run.discarded == [-(-(step + 1) // sc["kwargs"]["sync_period"]) * sc["kwargs"]["sync_period"]]
        if sc["scheme"] not in GRADIENT_SCHEMES:  # the rank's local weights took the inf; the others did not
            assert not torch.isfinite(_flat(ranks[rank]["steps"][step])).all()
            assert torch.isfinite(_flat(ranks[1 - rank]["steps"][step])).all()
            for t in range(run.discarded[0] - 1, sc["max_steps"]):  # every rank restarted from the global model
                assert all(torch.isfinite(_flat(r["steps"][t])).all() for r in ranks)


def test_onebit_sgd_at_32_bits_is_allreduce(pair):
    """``num_quantization_bits=32``: the real run equals the real ``allreduce`` run (same seed, batches and
    optimizer) bit for bit, and the reference ``allreduce`` too."""
    sc = PAIR["onebit_sgd_32"]
    ranks = [r["onebit_sgd_32"] for r in pair]
    plain = [r["allreduce"] for r in pair]
    assert PAIR["allreduce"]["optimizer"] == sc["optimizer"] and PAIR["allreduce"]["max_steps"] == sc["max_steps"]
    ref = replay({**sc, "scheme": "allreduce", "kwargs": {}}, ranks)
    for r in range(2):
        for t in range(sc["max_steps"]):
            same(ranks[r]["steps"][t], plain[r]["steps"][t], f"rank {r} after step {t + 1}", exact=True)
            same(ranks[r]["steps"][t], ref.steps[t][r], f"rank {r} after step {t + 1}", exact=True)


def test_streaming_diloco_ends_without_the_last_landing_steps(pair):
    """Not a check of correctness but of what the package does (the reference models it, see
    :func:`reference.streaming_diloco`): at delay 1, fragment 1's exchange of step 8 lands after step 9, the
    last; its mixing at ``alpha = 0`` discards that step's progress on fragment 1, and the end-of-fit merge
    (``G = w_global - w_local`` = 0) does not bring it back. Measured: 9.2e-3 at most on one weight."""
    for name in ("streaming_delay1", "streaming_delay1_4bit"):
        run = replay(PAIR[name], [r[name] for r in pair])
        assert list(run.dropped) == [1] and run.dropped[1] > FAR
        assert (1, 9, 9) in run.history  # the merge of fragment 1 ran, with nothing to merge


@pytest.mark.parametrize("name", list(RESUME))
def test_a_run_resumed_mid_block_replays_as_the_uninterrupted_one(pair, name):
    """A run checkpointed mid-block (DiLoCo 8 bits: residuals, outer momentum, inner AdamW state, local
    weights; Streaming DiLoCo: an exchange in flight) and resumed equals the reference of the
    uninterrupted run, step by step: the same batches (a checkpoint at an epoch's end), the same weights,
    the same syncs after the resume."""
    sc = RESUME[name]
    source, k = sc["resume"]
    straight = [r[source] for r in pair]
    resumed = [r[name] for r in pair]
    run = replay(PAIR[source], straight)
    # mid-block: no DiLoCo sync at step k; for Streaming DiLoCo an exchange launched by k lands after it
    if PAIR[source]["scheme"] == "diloco":
        assert k not in run.syncs and any(s > k for s in run.syncs)
    else:
        assert any(launched <= k < applied for _, launched, applied in run.history)
    for r in range(2):
        assert len(resumed[r]["batches"]) == sc["max_steps"] - k
        for a, b in zip(resumed[r]["batches"], straight[r]["batches"][k:], strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        same(resumed[r]["start"], run.global_steps[k - 1], f"rank {r}: the checkpoint's model")
        for j, weights in enumerate(resumed[r]["steps"]):
            same(weights, run.steps[k + j][r], f"rank {r} after step {k + j + 1} (resumed)")
            same(weights, straight[r]["steps"][k + j], f"rank {r} after step {k + j + 1}, straight", exact=True)
        same(resumed[r]["final"], run.final, f"rank {r} at the end of the resumed fit")
    assert [tuple(h) for h in resumed[0]["sync_history"]] == [h for h in run.history if h[2] > k]


@pytest.mark.parametrize("name", list(QUAD))
def test_four_ranks_replay_through_the_reference(quad, name):
    sc = QUAD[name]
    ranks = [r[name] for r in quad]
    check_run(sc, ranks, exact=("quad", name) in EXACT)
    check_far_from_wrong(sc, ranks, reduce="sum")
    if sc["scheme"] == "diloco":
        check_far_from_wrong(sc, ranks, outer_momentum=0.0)
    if sc["scheme"] == "bmuf":  # the default block momentum counts workers (groups when sharded)
        # 4 workers, or 2 groups when sharded; the mistake: 1 - 1/2 for the first, 1 - 1/4 for the second
        miscounted = len(ranks) if sc["kwargs"].get("shard") else len(ranks) // 2
        check_far_from_wrong(sc, ranks, block_momentum=1 - 1 / miscounted)
