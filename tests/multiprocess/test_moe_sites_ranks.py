"""Mixture-of-experts across sites on real ranks (gloo, CPU): a periodic scheme with
``expert_parallel=True`` and ``shard="fsdp"``, 4 ranks as 2 groups of 2.

Each group holds the 4 experts of every MoE layer once (2 per rank), its tokens' all-to-all inside
the group, its dense part sharded by FSDP2 over the same 2 ranks; rank ``i`` of both groups holds the
same experts and dense shard and DiLoCo averages them across the groups.
"""

import math
from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "empty_init_worker.py"
DIMS = {"vocab": 64, "dim": 16, "blocks": 2, "moe": True}
SITES = {"shard": "fsdp", "group_size": 2, "shard_policy": {"min_unit_numel": 1}, "expert_parallel": True}


def test_a_sync_every_step_equals_expert_parallel_and_a_longer_period_keeps_groups_bit_identical():
    base = {"build": "whole", "dims": DIMS, "max_steps": 4, "optimizer": "sgd_plain"}
    averaging = {"sync_period": 1, "sync_period_unit": "steps", "outer_lr": 1.0, "outer_momentum": 0.0}
    scenarios = {
        # with a sync every step, outer lr 1 and no momentum, DiLoCo averages the weights every step:
        # the same as expert_parallel over the same layout (ep 2 inside consecutive ranks, dp 2 across)
        "sites": {**base, "strategy": "diloco", "kwargs": {**averaging, **SITES}},
        "expert_parallel": {**base, "strategy": "expert_parallel", "kwargs": {"ep_size": 2, "inner": "ep"}},
        "sites_period": {
            **base,
            "strategy": "diloco",
            "build": "empty",
            "max_steps": 5,
            "kwargs": {"sync_period": 2, "sync_period_unit": "steps", **SITES},
        },
    }
    runs = run_ranks({"scenarios": scenarios}, 4, script=WORKER)
    for rank, r in enumerate(runs):
        sites, reference = r["sites"], r["expert_parallel"]
        # this rank's experts are the reference's (the same placement), the dense part is sharded
        for name, n in sites["full_numel"].items():
            assert sites["local_numel"][name] * (1 if ".experts." in name else 2) == n, (rank, name)
        # float32 sums in another order: the reference all-reduces 4 gradients, the sites run
        # reduce-scatters 2 and averages 2 weights; measured below 1e-6 over 4 steps of lr 0.5
        for name, t in reference["whole"].items():
            torch.testing.assert_close(sites["whole"][name], t, atol=1e-5, rtol=0, msg=f"rank {rank} {name}")
        # the all-to-all stays inside the group: ranks 0-1 or 2-3
        group = [0, 1] if rank < 2 else [2, 3]
        assert sites["all_to_all_ranks"] == group and r["sites_period"]["all_to_all_ranks"] == group
        assert sites["tokens_bytes"] > 0
        # what crossed between the sites (ranks 0-1 | 2-3): the weights' averaging (rank i with rank i)
        # for the sites, the gradients' all-reduce for expert_parallel (ep inside, dp across), and the
        # world's small messages; never the tokens' all-to-all nor FSDP2's gathers inside a site
        for run, crossing in ((sites, "weights"), (reference, "grad")):
            stats = run["stats"]
            tags = {key.split("/")[0] for key in stats if key.endswith("/bytes_sent") and stats[key]} - {"across"}
            inside = {"tokens", "tokens_meta", "fsdp_gather", "fsdp_reduce"}
            assert crossing in tags and "tokens" in tags, tags
            for tag in tags:
                across = stats.get(f"across/{tag}/bytes_sent", 0)
                assert across == (0 if tag in inside else stats[f"{tag}/bytes_sent"]), (rank, tag, across)
            assert stats["across/bytes_sent"] == sum(stats[f"{t}/bytes_sent"] for t in tags - inside)
    for i in (0, 1):  # after the last sync rank i of both groups holds the same experts and dense shard
        a, b = runs[i]["sites_period"]["whole"], runs[i + 2]["sites_period"]["whole"]
        for name, t in a.items():
            assert torch.equal(t, b[name]), (i, name)
        losses = runs[i]["sites_period"]["losses"]
        assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_expert_parallel_sites_refuse_what_cannot_work():
    import lightning_commstrats as lc

    with pytest.raises(ValueError, match="expert_parallel=True needs shard='fsdp'"):
        lc.DiLoCoStrategy(sync_period=4, expert_parallel=True)
    with pytest.raises(ValueError, match="expert_parallel must be True or False"):
        lc.DiLoCoStrategy(sync_period=4, expert_parallel="yes", shard="fsdp")


# about 25 s each: the quick suite keeps the sites' case, the slow suite expert_parallel's too
@pytest.mark.parametrize("strategy", ["diloco", pytest.param("expert_parallel", marks=pytest.mark.slow)])
def test_experts_and_shards_checkpointed_mid_period_resume_bit_for_bit(strategy):
    import tempfile

    shard_worker = Path(__file__).parent / "shard_worker.py"
    ckpt = tempfile.mkdtemp(prefix="commstrats-moe-ckpt-")
    shard = {"shard": "fsdp", "shard_policy": {"min_unit_numel": 1}}
    if strategy == "diloco":  # experts inside each group of 2, diloco across; step 4 is mid-period
        kw = {"sync_period": 3, "sync_period_unit": "steps", "group_size": 2, "expert_parallel": True, **shard}
    else:  # dp 2 x ep 2, the dense part sharded over the ep groups
        kw = {"ep_size": 2, "inner": "ep", **shard}
    common = {"strategy": strategy, "model": "moe", "max_steps": 8, "epoch_steps": 4, "optimizer": "adamw"}
    scenarios = {
        "straight": {**common, "kwargs": kw, "ckpt_every": 4, "ckpt_dir": ckpt},
        "resumed": {**common, "kwargs": kw, "resume": ["straight", 4], "resume_dir": ckpt},
    }
    for rank, res in enumerate(run_ranks({"scenarios": scenarios}, 4, script=shard_worker)):
        assert res["straight"]["losses"][4:] == res["resumed"]["losses"], rank
        for name, value in res["straight"]["final"].items():
            assert torch.equal(res["resumed"]["final"][name], value), (rank, name)


def test_experts_resume_onto_another_number_of_groups_rank_i_from_rank_i():
    # 2 groups of 2 saved at a sync (step 4), resumed as 1 group of 2 (resume_mismatch="reshard"): rank i
    # takes saved rank i's experts, dense shard of the global model and inner optimizer state
    import tempfile

    shard_worker = Path(__file__).parent / "shard_worker.py"
    ckpt = tempfile.mkdtemp(prefix="commstrats-moe-reshard-")
    kw = {"sync_period": 2, "sync_period_unit": "steps", "group_size": 2, "expert_parallel": True}
    kw.update(shard="fsdp", shard_policy={"min_unit_numel": 1}, resume_mismatch="reshard")
    common = {"strategy": "diloco", "model": "moe", "epoch_steps": 4, "optimizer": "adamw", "kwargs": kw}
    saved = run_ranks(
        {"scenarios": {"four": {**common, "max_steps": 4, "ckpt_every": 4, "ckpt_dir": ckpt}}}, 4, script=shard_worker
    )
    resumed = run_ranks(
        {"scenarios": {"two": {**common, "max_steps": 6, "resume": ["four", 4], "resume_dir": ckpt, "devices": 2}}},
        2,
        script=shard_worker,
    )
    for i in (0, 1):
        old, new = saved[i]["four"], resumed[i]["two"]
        assert old["syncs"][-1][0] == 4  # the checkpoint is at a sync: every group's weights are the global ones
        experts = [n for n in old["final"] if ".experts." in n]
        assert experts
        for name, value in old["final"].items():
            assert torch.equal(new["start"][name], value), (i, name)
        for name, state in old["opt_final"].items():
            assert state and set(new["opt_start"][name]) == set(state), (i, name)
            for key, value in state.items():
                assert torch.equal(new["opt_start"][name][key], value), (i, name, key)
        assert len(new["losses"]) == 2 and all(math.isfinite(x) for x in new["losses"])
    # the two ranks hold other experts: rank 1 did not take rank 0's
    assert not torch.equal(resumed[0]["two"]["start"][experts[0]], resumed[1]["two"]["start"][experts[0]])
    # groups of another size would give a rank other experts than any saved rank holds: refused
    ones = {**common, "kwargs": {**kw, "group_size": 1}, "max_steps": 6, "resume": ["four", 4], "resume_dir": ckpt}
    with pytest.raises(RuntimeError, match="experts kept whole per rank in groups of 2 ranks"):
        run_ranks({"scenarios": {"ones": {**ones, "devices": 2}}}, 2, script=shard_worker)
