"""Expert parallelism with a shared expert and fine-grained experts, on real ranks, against the
unsharded layer in one process."""

import pytest
from harness import WORKER, run_ranks

pytestmark = pytest.mark.multiprocess

MOE_WORKER = WORKER.parent / "moe_worker.py"


@pytest.mark.parametrize(
    ("world", "experts", "top_k", "expert_dim", "shared"),
    [
        (2, 8, 2, 8, 0),  # fine-grained: 8 experts of half width, two per token
        (2, 4, 1, 8, 8),  # shared expert + routed top-1
        (4, 8, 2, 4, 8),  # shared expert + fine-grained
    ],
)
def test_sharded_layer_with_options_equals_the_single_process_layer(world, experts, top_k, expert_dim, shared):
    spec = {
        "dp": 1, "ep": world, "inner": "dp", "balance": "aux", "experts": experts, "top_k": top_k,
        "f": expert_dim, "shared": shared, "router_init_std": 1e-3, "tokens": 24, "d": 8,
    }  # fmt: skip
    results = run_ranks(spec, world, script=MOE_WORKER)
    per_rank = experts // world
    assert sorted((r["first"], r["count"]) for r in results) == [(i * per_rank, per_rank) for i in range(world)]
    for r in results:
        assert r["expert_dim"] == expert_dim
        shared_names = ["shared.down.bias", "shared.down.weight", "shared.up.bias", "shared.up.weight"]
        assert r["dense"] == sorted(["router.weight", *(shared_names if shared else [])])
