"""Real-rank runs replayed through the plain-torch reference (``tests/reference.py``).

Ranks agreeing with each other is not enough: an exchange that sums instead of averaging, or an outer
step that drops its momentum, keeps every rank identical. Here each scheme runs on real ranks
(``reference_worker.py``: a small fp32 MLP, gloo on CPU), which record the weights training started
from and every batch they trained on; the reference, which shares no code with the package, replays
those batches with one model replica per worker in this process, and the weights must agree: after
every step (each rank against its worker) and at the end of fit.

Tolerance. Where the arithmetic is the same in the same order the weights are compared bit for bit
(:data:`EXACT`): ``allreduce`` on 2 ranks (a sum of two gradients does not depend on its order, and
the division by 2 is exact), and ``allreduce`` with ``shard="fsdp"`` on 2 groups of 2 (FSDP2's
reduce-scatter inside a group and the all-reduce across the two groups are each a sum of two, halved,
as the reference's mean of the group's two gradients, then of the two groups'). Elsewhere the order
of float32 operations differs, and the weights (at most 0.5 in magnitude) are compared within
``ATOL`` absolute (``RTOL`` 0):

- the periodic schemes average the ranks' pseudo-gradients ``mean_r(w_start - w_r)`` and step the
  global model with ``torch.optim``'s ``add(..., alpha=-lr)``; the reference takes
  ``w_start - mean_r w_r`` and writes the outer step out. Each sync differs by about one float32
  rounding (3e-8 on weights below 0.5), and a few steps of lr 0.1 SGD or lr 0.01 AdamW carry it
  without amplifying it much;
- on 4 unsharded ranks gloo sums the ranks' gradients in its ring's order, the reference in rank
  order (measured: 3e-8).

Measured (2 and 4 ranks, 6 to 10 steps, every scenario below, twice): the largest difference over every step,
rank and weight is 1.2e-7 (``bmuf_classic_samples``; :data:`MEASURED`). ``ATOL = 1e-6`` is 8 times that.
The effect of a wrong average is far larger: each test replays the reference with the workers'
contributions summed instead of averaged (``reduce="sum"``), and the real run must lie more than
``FAR = 1e-3`` (1000 times ``ATOL``) from it; measured, it lies 0.06 to 0.48 from it. DiLoCo without
its outer momentum lies 0.03 to 0.05 away; BMUF on 4 ranks with its default block momentum miscounted
(``1 - 1/2`` for 4 workers, ``1 - 1/4`` for 2 sharded groups) 0.011 to 0.014.
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
MEASURED = 1.2e-7  # the largest real-vs-reference difference seen (see the module docstring)
EXACT = {("pair", "allreduce"), ("quad", "allreduce_fsdp")}  # compared bit for bit

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01}
STEPS = {"sync_period_unit": "steps"}
FSDP = {"shard": "fsdp", "group_size": 2, "shard_policy": {"min_unit_numel": 1}}

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
    return run_ranks(_spec(PAIR), 2, script=WORKER)


@pytest.fixture(scope="module")
def quad() -> list[dict[str, Any]]:
    return run_ranks(_spec(QUAD), 4, script=WORKER)


def replay(sc: dict[str, Any], ranks: list[dict[str, Any]], **override: Any) -> reference.Run:
    """The reference run of scenario ``sc`` on the batches the real ranks trained on."""
    scheme = getattr(reference, sc["scheme"])
    settings = {k: v for k, v in sc["kwargs"].items() if k not in NOT_REFERENCE}
    group_size = sc["kwargs"].get("group_size", 1) if sc["kwargs"].get("shard") else 1
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

    def same(real: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
        if exact:
            for name in ref:
                assert torch.equal(real[name], ref[name]), f"{what}: {name} differs bit-wise"
        else:
            for name in ref:
                torch.testing.assert_close(real[name], ref[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")

    for t in range(sc["max_steps"]):
        for r in range(world):
            same(ranks[r]["steps"][t], run.steps[t][r // group_size], f"rank {r} after step {t + 1}")
    for r in range(world):
        same(ranks[r]["final"], run.final, f"rank {r} at the end of fit")

    if sc["scheme"] != "allreduce":  # the same schedule: the syncs, then the end-of-fit merge
        applied = [step for _, _, step in ranks[0]["sync_history"]]
        assert applied == run.syncs + ([sc["max_steps"]] if run.merged else [])
        assert len(run.syncs) >= 2
    return run


def check_far_from_wrong(sc: dict[str, Any], ranks: list[dict[str, Any]], **wrong: Any) -> float:
    """The real run lies far (more than ``FAR``, 1000 x ``ATOL``) from a reference with a mistake."""
    off = distance(ranks[0]["final"], replay(sc, ranks, **wrong).final)
    assert off > FAR, f"{wrong}: the real run is only {off:.2e} from it"
    return off


@pytest.mark.parametrize("name", list(PAIR))
def test_two_ranks_replay_through_the_reference(pair, name):
    sc = PAIR[name]
    ranks = [r[name] for r in pair]
    check_run(sc, ranks, exact=("pair", name) in EXACT)
    check_far_from_wrong(sc, ranks, reduce="sum")
    if sc["scheme"] == "diloco":  # an outer step that ignores its momentum
        check_far_from_wrong(sc, ranks, outer_momentum=0.0)


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
