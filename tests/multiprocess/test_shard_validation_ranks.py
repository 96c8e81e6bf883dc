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


def _scenarios(group_size: int, runs: dict) -> dict:
    shard = {"shard": "fsdp", "group_size": group_size, "shard_policy": GATHERED}
    out = {}
    for name, (strategy, kw) in runs.items():
        common = {"strategy": strategy, "kwargs": {**kw, **shard}, "max_steps": STEPS, "devices": 2, "trace": True}
        out[name] = common
        out[f"{name}_validated"] = {**common, "val_every": 3}  # after steps 3 and 6: mid-block
    return out


def _check(results: list, names: tuple[str, ...]) -> None:
    for rank, res in enumerate(results):
        for name in names:
            plain, validated = res[name], res[f"{name}_validated"]
            assert plain["validations"] == 0 and validated["validations"] == 2, name
            assert validated["sharded"], name
            assert len(validated["steps"]) == len(plain["steps"]) == STEPS
            for step, (a, b) in enumerate(zip(plain["steps"], validated["steps"], strict=True), start=1):
                for key in a:
                    assert torch.equal(a[key], b[key]), f"{name} rank {rank} step {step} {key}: validation moved it"
            for key, value in plain["final"].items():
                assert torch.equal(validated["final"][key], value), (name, rank, key)


# groups of 1 (progress silently dropped) quick; groups of 2 (a size-mismatch crash) in the slow suite
@pytest.mark.parametrize("group_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_validation_during_a_sharded_periodic_fit_leaves_training_bit_identical(group_size):
    # before: groups of 2 crashed restoring the local shards into gathered parameters (size mismatch);
    # groups of 1 copied them into the gathered copy FSDP2 then dropped, losing each block's progress
    results = run_ranks({"scenarios": _scenarios(group_size, {"diloco": ("diloco", DILOCO)})}, 2, script=WORKER)
    _check(results, ("diloco",))
    for res in results:
        assert len(res["diloco"]["syncs"]) == 2


@pytest.mark.slow  # about 25 s; the per-step scheme swaps nothing in (it held before the fix too)
def test_validation_during_a_sharded_allreduce_fit_leaves_training_bit_identical():
    results = run_ranks({"scenarios": _scenarios(2, {"allreduce": ("allreduce", {})})}, 2, script=WORKER)
    _check(results, ("allreduce",))
