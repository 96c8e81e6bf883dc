"""Validation during a sharded fit never changes training, whatever the shard policy: 2 ranks, gloo.

With ``reshard_after_forward=False`` (or FSDP2's default for the root), a forward without backward
leaves FSDP2's parameters gathered; a periodic scheme swaps the global model in for validation and
its local weights back after it. Each run here is compared with the same run without validation,
step by step, bit for bit: shards of 2 (one group) and of 1 (two groups, the scheme across them).
"""

from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "shard_worker.py"
STEPS = 8
GATHERED = {"min_unit_numel": 1, "reshard_after_forward": False}
DILOCO = {"sync_period": 4, "sync_period_unit": "steps"}


def _scenarios(group_size: int) -> dict:
    shard = {"shard": "fsdp", "group_size": group_size, "shard_policy": GATHERED}
    runs = {"diloco": ("diloco", DILOCO), "allreduce": ("allreduce", {})}
    out = {}
    for name, (strategy, kw) in runs.items():
        common = {"strategy": strategy, "kwargs": {**kw, **shard}, "max_steps": STEPS, "devices": 2, "trace": True}
        out[name] = common
        out[f"{name}_validated"] = {**common, "val_every": 3}  # after steps 3 and 6: mid-block
    return out


@pytest.mark.parametrize("group_size", [1, 2])
def test_validation_during_a_sharded_fit_leaves_training_bit_identical(group_size):
    results = run_ranks({"scenarios": _scenarios(group_size)}, 2, script=WORKER)
    for rank, res in enumerate(results):
        for name in ("diloco", "allreduce"):
            plain, validated = res[name], res[f"{name}_validated"]
            assert plain["validations"] == 0 and validated["validations"] == 2, name
            assert validated["sharded"], name
            assert len(validated["steps"]) == len(plain["steps"]) == STEPS
            for step, (a, b) in enumerate(zip(plain["steps"], validated["steps"], strict=True), start=1):
                for key in a:
                    assert torch.equal(a[key], b[key]), f"{name} rank {rank} step {step} {key}: validation moved it"
            for key, value in plain["final"].items():
                assert torch.equal(validated["final"][key], value), (name, rank, key)
        # the block's local progress is real: the validated global model is not what training continues from
        assert len(res["diloco"]["syncs"]) == 2
