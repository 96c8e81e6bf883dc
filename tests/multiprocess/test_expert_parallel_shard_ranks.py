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
EP_2x2 = {"ep_size": 2, "inner": "ep"}


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


def test_the_dense_state_per_rank_halves_on_a_2_way_shard_by_the_tensors_and_by_the_kernel():
    # a model whose dense part (a tied 16,384 x 256 embedding, 4.2M values) dwarfs its experts:
    # dp 2 x ep 2, unsharded or with the dense part sharded over each ep group of 2
    dims = {"vocab": 16384, "dim": 256, "blocks": 1, "moe": True}
    base = {"build": "whole", "dims": dims, "max_steps": 2, "record_weights": False, "strategy": "expert_parallel"}
    scenarios = {
        # first, so that what a process pays once (gloo, FSDP2's first use) lands in neither figure
        "warm": {**base, "dims": {**dims, "vocab": 64}, "kwargs": {**EP_2x2, "shard": "fsdp"}},
        "sharded": {**base, "kwargs": {**EP_2x2, "shard": "fsdp"}},
        "unsharded": {**base, "kwargs": EP_2x2},
    }
    dense = 16384 * 256 + 256 * 2 + 256 * 4  # the embedding, the norm, the router (4 experts)
    for r in run_ranks({"scenarios": scenarios}, 4, script=WORKER):
        kinds = ("parameters", "gradients", "optimizer", "scheme")
        held = {k: sum(r[k]["memory"][kind].get("cpu", 0) for kind in kinds) for k in ("sharded", "unsharded")}
        kernel = {k: r[k]["rss"]["end"] - r[k]["rss"]["start"] for k in ("sharded", "unsharded")}
        print({k: (f"{held[k] / 2**20:.1f} MiB held", f"{kernel[k] / 2**20:.1f} MiB by the kernel") for k in held})
        # the tensors: parameters, gradients, SGD momentum and the exchange's bucket of the dense part,
        # each 4 bytes a value, whole or a half shard (the experts, 2 of 4 per rank, alike in both)
        saved = held["unsharded"] - held["sharded"]
        assert abs(saved - 4 * 4 * dense / 2) < 0.02 * 4 * 4 * dense, (saved, dense)
        assert held["sharded"] < 0.6 * held["unsharded"], held
        # the kernel's count of the process with that state in place (glibc's mmap threshold fixed by
        # the worker, so freed blocks went back): it falls by at least 80% of what the tensors say
        assert kernel["unsharded"] - kernel["sharded"] > 0.8 * saved, (kernel, saved)


def test_fabric_runs_expert_parallel_sharded_as_the_trainer_does():
    kwargs = {**EP_2x2, "shard": "fsdp", "shard_policy": {"min_unit_numel": 1}}
    base = {"strategy": "expert_parallel", "build": "whole", "dims": DIMS, "max_steps": 4, "kwargs": kwargs}
    scenarios = {"trainer": base, "fabric": {**base, "front": "fabric"}}
    for rank, r in enumerate(run_ranks({"scenarios": scenarios}, 4, script=WORKER)):
        trainer, fabric = r["trainer"], r["fabric"]
        assert fabric["sharded"] is False  # the experts stay whole beside the dense DTensors
        assert [fabric["local_numel"][n] * (1 if ".experts." in n else 2) for n in fabric["full_numel"]] == list(
            fabric["full_numel"].values()
        )
        assert fabric["losses"] == trainer["losses"], rank
        for name, t in trainer["whole"].items():
            assert torch.equal(fabric["whole"][name], t), (rank, name)
