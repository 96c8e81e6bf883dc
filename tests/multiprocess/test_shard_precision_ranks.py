"""LayeredMixedPrecision inside FSDP2 on real ranks (gloo, CPU): each unit is gathered in the dtype
it computes in, norms that stay float32 inside a half block are units of their own, gradients are
reduced in float32, and FSDP2's traffic is counted under its own tags.

The model (``empty_init_worker.py``): an embedding tied to the output layer (float32, the root) and
blocks of ``LayerNorm`` (float32) + ``Linear`` (an FFN: bf16 under ``layered``), in one group of 2.
"""

from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "empty_init_worker.py"
VOCAB, DIM, BLOCKS, STEPS = 64, 32, 2, 4
DIMS = {"vocab": VOCAB, "dim": DIM, "blocks": BLOCKS}
LAYERED = {"preset": "layered", "dtype": "bf16", "device": "cpu"}
SHARD = {"shard": "fsdp", "group_size": 2, "shard_policy": {"min_unit_numel": 1}}


def _gather_bytes_per_step(linear_itemsize: int) -> int:
    """What one rank sends in FSDP2's all-gathers per step, from the model's sizes (g = 2: a rank
    sends its half once). The root (embedding/output, float32) is gathered once a step (kept from
    forward to backward); every block's norm and Linear twice (freed after forward)."""
    half = 2
    root = VOCAB * DIM // half * 4
    norm = 2 * DIM // half * 4
    linear = (DIM * DIM + DIM) // half * linear_itemsize
    return root + BLOCKS * 2 * (norm + linear)


BASE = {"build": "whole", "dims": DIMS, "max_steps": STEPS, "devices": 2}
PERIOD = {"sync_period": 2, "sync_period_unit": "steps"}
AC = {**SHARD, "shard_policy": {"min_unit_numel": 1, "activation_checkpointing": True}}
SCALED = {**LAYERED, "loss_scaling": True, "init_scale": 1024.0}
SCENARIOS = {  # one launch of 2 ranks for the tests below
    "fp32": {**BASE, "strategy": "allreduce", "kwargs": SHARD},
    "layered": {**BASE, "strategy": "allreduce", "kwargs": SHARD, "precision": LAYERED},
    # the recomputation in backward runs on the parameters FSDP2 gathered again, in the unit's dtype
    "diloco": {**BASE, "strategy": "diloco", "build": "empty", "kwargs": {**PERIOD, **SHARD}, "precision": LAYERED},
    "diloco_ac": {**BASE, "strategy": "diloco", "build": "empty", "kwargs": {**PERIOD, **AC}, "precision": LAYERED},
    # rank 1's shard of a bf16 unit's gradient holds an inf at step 2
    "skip": {**BASE, "strategy": "allreduce", "build": "empty", "kwargs": SHARD, "precision": SCALED, "inf_at": [2, 1]},
}


@pytest.fixture(scope="module")
def runs():
    return run_ranks({"scenarios": SCENARIOS}, 2, script=WORKER)


def test_layered_bf16_under_fsdp2_gathers_half_units_in_half_and_trains_as_unsharded(runs):
    unsharded = {"layered": {**SCENARIOS["layered"], "kwargs": {}}}
    reference = run_ranks({"scenarios": unsharded}, 2, script=WORKER)
    for r in runs:
        fp32, layered = r["fp32"]["stats"], r["layered"]["stats"]
        assert fp32["fsdp_gather/bytes_sent"] == STEPS * _gather_bytes_per_step(4)
        assert layered["fsdp_gather/bytes_sent"] == STEPS * _gather_bytes_per_step(2)
        # gradients are reduced in float32 either way: one reduce-scatter of every unit a step
        assert layered["fsdp_reduce/bytes_sent"] == fp32["fsdp_reduce/bytes_sent"] > 0
        assert r["layered"]["sharded"]
    # the same half computations on the same values (a shard cast to bf16 and gathered, or gathered
    # and cast, is the same tensor) and float32 sums of the same two gradients: measured equal here;
    # 1e-6 leaves room for a backend that sums in another order
    for name, whole in reference[0]["layered"]["whole"].items():
        for r in runs:
            torch.testing.assert_close(r["layered"]["whole"][name], whole, atol=1e-6, rtol=0, msg=name)


def test_activation_checkpointing_under_layered_fsdp2_trains_bit_for_bit_as_without(runs):
    for r in runs:
        assert r["diloco_ac"]["losses"] == r["diloco"]["losses"]
        for name, t in r["diloco"]["whole"].items():
            assert torch.equal(r["diloco_ac"]["whole"][name], t), name


def test_an_overflow_in_one_ranks_half_unit_shard_skips_the_step_on_every_rank(runs):
    # loss scaling under FSDP2's precision policy: both ranks skip the step together, halve the
    # scale, and stay equal
    assert [r["skip"]["optimizer_steps"] for r in runs] == [STEPS - 1] * 2
    assert [r["skip"]["scale"] for r in runs] == [512.0] * 2
    for name, t in runs[0]["skip"]["whole"].items():
        assert torch.isfinite(t).all() and torch.equal(t, runs[1]["skip"]["whole"][name]), name
