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


def test_layered_bf16_under_fsdp2_gathers_half_units_in_half_and_trains_as_unsharded():
    base = {"strategy": "allreduce", "build": "whole", "dims": DIMS, "max_steps": STEPS, "devices": 2}
    sharded = {
        "fp32": {**base, "kwargs": SHARD},
        "layered": {**base, "kwargs": SHARD, "precision": LAYERED},
    }
    runs = run_ranks({"scenarios": sharded}, 2, script=WORKER)
    reference = run_ranks({"scenarios": {"layered": {**base, "kwargs": {}, "precision": LAYERED}}}, 2, script=WORKER)
    for r in runs:
        fp32, layered = r["fp32"]["stats"], r["layered"]["stats"]
        assert fp32["fsdp_gather/bytes_sent"] == STEPS * _gather_bytes_per_step(4)
        assert layered["fsdp_gather/bytes_sent"] == STEPS * _gather_bytes_per_step(2)
        # gradients are reduced in float32 either way: one reduce-scatter of every unit a step
        assert layered["fsdp_reduce/bytes_sent"] == fp32["fsdp_reduce/bytes_sent"] > 0
        assert r["layered"]["sharded"]
    for name, whole in reference[0]["layered"]["whole"].items():
        for r in runs:
            torch.testing.assert_close(r["layered"]["whole"][name], whole, atol=1e-6, rtol=0, msg=name)


def test_activation_checkpointing_under_layered_fsdp2_trains_bit_for_bit_as_without():
    # the recomputation in backward runs on the parameters FSDP2 gathered again, in the unit's dtype
    base = {"strategy": "diloco", "build": "empty", "dims": DIMS, "max_steps": STEPS, "devices": 2}
    period = {"sync_period": 2, "sync_period_unit": "steps"}
    ac = {**SHARD, "shard_policy": {"min_unit_numel": 1, "activation_checkpointing": True}}
    scenarios = {
        "plain": {**base, "kwargs": {**period, **SHARD}, "precision": LAYERED},
        "ac": {**base, "kwargs": {**period, **ac}, "precision": LAYERED},
    }
    for r in run_ranks({"scenarios": scenarios}, 2, script=WORKER):
        assert r["ac"]["losses"] == r["plain"]["losses"]
        for name, t in r["plain"]["whole"].items():
            assert torch.equal(r["ac"]["whole"][name], t), name
