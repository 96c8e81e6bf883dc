"""The layered mixed precision on mixture-of-experts layouts on real ranks (gloo, CPU): experts in
bf16 with float32 masters, the router, norms and the tied embedding in float32, through FSDP2's
per-unit policy where the dense part is sharded. 4 ranks: ``expert_parallel`` dp 2 x ep 2 unsharded,
the same with the dense part sharded inside each ep group, and MoE across sites (diloco with
``expert_parallel=True``, groups of 2) averaging every step, which equals the other two.

The model (``empty_init_worker.py``, ``moe``): a tied embedding, blocks of ``LayerNorm`` + an MoE layer
of 4 experts (top-1, dropless, router float32 under ``layered``)."""

from pathlib import Path

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "empty_init_worker.py"
DIMS = {"vocab": 64, "dim": 16, "blocks": 2, "moe": True}
LAYERED = {"preset": "layered", "dtype": "bf16", "device": "cpu"}
SHARD = {"shard": "fsdp", "shard_policy": {"min_unit_numel": 1}}
EP = {"ep_size": 2, "inner": "ep"}
BASE = {"build": "whole", "dims": DIMS, "max_steps": 4, "optimizer": "sgd_plain", "precision": LAYERED}
EVERY_STEP = {"sync_period": 1, "sync_period_unit": "steps", "outer_lr": 1.0, "outer_momentum": 0.0}


def test_layered_bf16_on_expert_layouts_sharded_or_not_trains_alike():
    scenarios = {
        "ep": {**BASE, "strategy": "expert_parallel", "kwargs": EP},
        "ep_shard": {**BASE, "strategy": "expert_parallel", "kwargs": {**EP, **SHARD}},
        "sites": {
            **BASE,
            "strategy": "diloco",
            "kwargs": {**EVERY_STEP, **SHARD, "group_size": 2, "expert_parallel": True},
        },
        "ep_fp32": {**BASE, "strategy": "expert_parallel", "kwargs": EP, "precision": None},
    }
    runs = run_ranks({"scenarios": scenarios}, 4, script=WORKER)
    worst = {"ep_shard": 0.0, "sites": 0.0, "ep_fp32": 0.0}
    for r in runs:
        reference = r["ep"]["whole"]
        for other in worst:
            for name, t in reference.items():
                worst[other] = max(worst[other], float((r[other]["whole"][name] - t).abs().max()))
    print({k: f"{v:.2e}" for k, v in worst.items()})
    # the same bf16 expert computations on the same tokens; float32 sums of the dense gradients in
    # another order (reduce-scatter inside the group, then across) can move a bf16 rounding
    assert worst["ep_shard"] < 1e-4 and worst["sites"] < 1e-4, worst
    # and the precision took effect: float32 experts train measurably otherwise
    assert worst["ep_fp32"] > 10 * max(worst["ep_shard"], worst["sites"], 1e-6), worst
