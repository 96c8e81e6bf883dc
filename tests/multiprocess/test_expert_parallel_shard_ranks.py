"""``expert_parallel`` with ``shard="fsdp"`` on real ranks (gloo, CPU): ZeRO inside the dp x ep hierarchy.

4 ranks as dp 2 x ep 2, both inner layouts: the dense part sharded by FSDP2 over the inner dimension
(2 ranks), every rank keeping its own 2 of the 4 experts whole. Against the same layout unsharded on
the same data: equal weights up to the order of float32 sums (FSDP2 reduce-scatters a group's two
gradients and the cross-group exchange averages the two groups' shards, where the unsharded run
all-reduces four; over 4 SGD steps of lr 0.5 that is below 1e-5 on weights of order 1), the clip by
the global norm included.
"""

from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "empty_init_worker.py"
DIMS = {"vocab": 64, "dim": 16, "blocks": 2, "moe": True}
ATOL = 1e-5


# about 17 s each: the quick suite keeps inner="ep" (the sites' layout), the slow suite both
@pytest.mark.parametrize("inner", [pytest.param("dp", marks=pytest.mark.slow), "ep"])
def test_expert_parallel_sharded_inside_the_hierarchy_trains_as_unsharded(inner):
    layout = {"ep_size": 2, "inner": inner}
    base = {"strategy": "expert_parallel", "build": "whole", "dims": DIMS, "max_steps": 4, "clip": 0.5}
    scenarios = {
        "sharded": {**base, "kwargs": {**layout, "shard": "fsdp", "shard_policy": {"min_unit_numel": 1}}},
        "unsharded": {**base, "kwargs": layout},
    }
    runs = run_ranks({"scenarios": scenarios}, 4, script=WORKER)
    for rank, r in enumerate(runs):
        sharded, unsharded = r["sharded"], r["unsharded"]
        for name, n in sharded["full_numel"].items():
            if ".experts." in name:  # this rank's 2 of 4 experts, whole
                assert sharded["local_numel"][name] == unsharded["local_numel"][name] == n // 1, (rank, name)
            else:  # the dense part: half on each rank of the inner group
                assert sharded["local_numel"][name] * 2 == n, (rank, name)
        for name, t in unsharded["whole"].items():
            torch.testing.assert_close(sharded["whole"][name], t, atol=ATOL, rtol=0, msg=f"rank {rank} {name}")
        torch.testing.assert_close(
            torch.tensor(sharded["losses"]), torch.tensor(unsharded["losses"]), atol=1e-5, rtol=0
        )
