"""Fault-tolerant replicas of two ranks each (torchft, gloo, CPU), sharded and not: every rank runs
its own torchft Manager and exchanges its part of the model with the same rank of the other
replicas; a rank that dies takes its replica out of the run within seconds; a restarted replica
heals rank by rank; a restart of the whole run continues from the newest checkpoint.

Each replica is a Lightning job of two processes (ft_worker.py, ``devices=2``); rank 0 saves
``<rid>.pt`` and rank 1 ``<rid>.rank1.pt``, with digests of that rank's global model (its shard
when sharded) and outer optimizer state at every committed sync.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from ft_harness import FTRun
from test_fault_tolerance_ranks import RESTART_AFTER, assert_agreement

pytestmark = [pytest.mark.multiprocess]


def spec(seed: int, **kwargs) -> dict:
    base = {"init_seed": seed, "min_replicas": 1, "max_steps": 64, "step_sleep": 0.1, "devices": 2}
    base["scheme_kwargs"] = {"sync_period": 8}
    base.update(kwargs)
    return base


def load_rank(run: FTRun, rid: str, rank: int) -> dict:
    return torch.load(run.out / (f"{rid}.pt" if rank == 0 else f"{rid}.rank{rank}.pt"), weights_only=False)


def ranks_agree(by_replica: dict[str, dict]) -> None:
    """Every replica's rank i ended with, and committed, the same global model (shard) and outer state."""
    assert_agreement(by_replica)


def wait_group_gone(pgid: int, timeout: float) -> float:
    """Wait until no process of process group ``pgid`` is left; returns when (time.time())."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return time.time()
        time.sleep(0.1)
    raise AssertionError(f"processes of group {pgid} still alive after {timeout} s")


@pytest.mark.parametrize(
    ("shard", "victim"),
    # rank 1 dies: Lightning's launcher (rank 0's process) ends the replica; rank 0 dies: rank 1,
    # orphaned, learns it from the heartbeats (or its next collective) and leaves on its own
    [(None, 1), pytest.param("fsdp", 0, marks=pytest.mark.slow)],  # (31 s each: the quick suite's budget)
    ids=["replicated-rank1-dies", "sharded-rank0-dies"],
)
def test_a_dead_rank_takes_its_replica_out_and_the_restarted_replica_heals_rank_by_rank(shard, victim):
    sk = {"sync_period": 8, **({"shard": shard} if shard else {})}
    with FTRun(min_replicas=1) as run:
        # a holds at step 48 until the restarted b is set up: on a loaded machine a could otherwise end
        # the run before b's restart comes up (b would find the run ended and have nothing to heal from)
        run.start("a", spec(0, scheme_kwargs=sk, max_steps=128, hold={"at_step": 48, "until": "b.restarted"}))
        run.start("b", spec(1, scheme_kwargs=sk, max_steps=128, kill={"after_step": 12, "rank": victim}))
        group = run.replicas["b"].pid  # the replica's processes: one session, one group
        assert run.wait_dead("b") != 0
        gone = wait_group_gone(group, 30)
        killed = float((run.out / "b.killed").read_text())
        time.sleep(RESTART_AFTER)
        run.start("b", spec(5, scheme_kwargs=sk, max_steps=128, mark_setup="b.restarted"))
        run.wait()
        ranks = {r: {rid: load_rank(run, rid, r) for rid in "ab"} for r in (0, 1)}
    print(f"every process of b gone {gone - killed:.1f} s after its rank {victim} was killed")
    assert gone - killed < 10, gone - killed
    a0 = ranks[0]["a"]
    # a went on alone within 10 s of the kill (the Lighthouse dropped b), and b came back
    alone = [s for s in a0["syncs"] if s["time"] > killed and s["quorum"] == 1]
    assert alone and alone[0]["time"] - killed < 10, [(s["time"] - killed, s["quorum"]) for s in a0["syncs"]]
    assert a0["syncs"][-1]["quorum"] == 2
    for r in (0, 1):
        ranks_agree(ranks[r])  # rank r of a and of b: the same global model (shard) and outer state
        b = ranks[r]["b"]
        assert b["heals"], f"rank {r} of the restarted b healed from rank {r} of a"
        assert b["global_step"] == ranks[r]["a"]["global_step"] == 128
    for r in (0, 1):  # the [ft] line's figures against what the worker recorded of each quorum
        for rid in "ab":
            got = ranks[r][rid]
            line, figures = got["summary"]
            assert figures["quorums"] == len(got["quorums"]) and figures["heals"] == len(got["heals"]), (rid, figures)
            sizes = got["quorums"]
            assert (figures["smallest_quorum"], figures["largest_quorum"]) == (min(sizes), max(sizes))
            drops = sum(max(p - q, 0) for p, q in __import__("itertools").pairwise(sizes))
            assert figures["replicas_left"] == drops and line.startswith(f"[ft] replica {rid!r}: "), line
        a, b = ranks[r]["a"]["summary"][1], ranks[r]["b"]["summary"][1]
        assert a["replicas_left"] >= 1 and a["replicas_joined"] >= 1  # a saw b go and come back
        assert b["heals"] >= 1 and b["heal_bytes"] > 0 and b["quorum_seconds"] >= b["heal_seconds"] > 0
    if shard:  # the two ranks hold different shards
        assert ranks[0]["a"]["global"] != ranks[1]["a"]["global"]
    else:  # the same model on both ranks; each rank carried about half of the exchange across replicas
        assert ranks[0]["a"]["global"] == ranks[1]["a"]["global"]
        sent = [ranks[r]["a"]["bytes"]["weights"] for r in (0, 1)]
        assert all(0.35 < s / sum(sent) < 0.65 for s in sent), sent
        assert ranks[0]["a"]["bytes"].get("gather", 0) > 0  # and gathered the other half inside the replica


@pytest.mark.slow  # (about 40 s: the quick suite's budget)
def test_mixture_of_experts_replicas_a_killed_rank_and_a_heal_rank_by_rank():
    # each replica is a group of 2 ranks holding the 4 experts once (2 each, their all-to-all inside the
    # replica) and the dense part sharded by FSDP2; rank i of every replica holds the same experts and
    # dense shard, exchanges them with rank i of the other, and heals from it
    sk = {"sync_period": 8, "shard": "fsdp", "expert_parallel": True, "shard_policy": {"min_unit_numel": 1}}
    moe = {"scheme_kwargs": sk, "max_steps": 96, "moe": True}
    with FTRun(min_replicas=1) as run:
        run.start("a", spec(0, **moe, hold={"at_step": 40, "until": "b.restarted"}))
        run.start("b", spec(1, **moe, kill={"after_step": 12, "rank": 1}))
        assert run.wait_dead("b") != 0
        killed = float((run.out / "b.killed").read_text())
        time.sleep(RESTART_AFTER)
        run.start("b", spec(5, **moe, mark_setup="b.restarted"))
        run.wait()
        ranks = {r: {rid: load_rank(run, rid, r) for rid in "ab"} for r in (0, 1)}
    a0 = ranks[0]["a"]
    alone = [s for s in a0["syncs"] if s["time"] > killed and s["quorum"] == 1]
    assert alone, "a went on alone after b's rank was killed"
    assert a0["syncs"][-1]["quorum"] == 2
    for r in (0, 1):
        ranks_agree(ranks[r])  # rank r of a and of b: the same experts, dense shard and outer state
        assert ranks[r]["b"]["heals"], f"rank {r} of the restarted b healed from rank {r} of a"
        assert ranks[r]["b"]["global_step"] == ranks[r]["a"]["global_step"] == 96
        # this rank's experts: 2 of each MoE tensor's 4 (its slice), whole (not FSDP2 shards)
        assert ranks[r]["a"]["expert_rows"] == 2, ranks[r]["a"]["expert_rows"]
    assert ranks[0]["a"]["global"] != ranks[1]["a"]["global"]  # the two ranks hold other experts and shards


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scheme", "scheme_kwargs", "collective"),
    [
        ("diloco", {"sync_period": 8}, 2),
        ("diloco", {"sync_period": 8, "pseudo_grad_bits": 4}, 3),
        (
            "streaming_diloco",
            {"sync_period": 8, "pseudo_grad_bits": 4, "num_fragments": 2, "fragment_sync_delay": 1},
            3,
        ),
    ],
    ids=["fp32", "4bit", "streaming"],
)
def test_a_rank_killed_inside_an_exchange_leaves_no_partial_average(scheme, scheme_kwargs, collective):
    # b's rank 1 dies inside its cross-replica exchange at committed step 3: rank 1 of a loses its
    # peer, rank 0 of a may complete; torchft's commit is the replica's, so neither rank of a applies it
    with FTRun(min_replicas=1) as run:
        run.start("a", spec(0, scheme=scheme, scheme_kwargs=scheme_kwargs, max_steps=40, keep_exchanges=True))
        kill = {"sync": 3, "collective": collective, "rank": 1}
        run.start("b", spec(1, scheme=scheme, scheme_kwargs=scheme_kwargs, max_steps=40, kill=kill))
        assert run.wait_dead("b") != 0
        del run.replicas["b"]
        run.wait()
        ranks = [load_rank(run, "a", r) for r in (0, 1)]
    for a in ranks:
        died_in = [e for e in a["exchanges"] if e["quorums"][0] == 2 and e["quorums"][-1] == 1]
        assert len(died_in) == 1, [e["quorums"] for e in a["exchanges"]]
        if scheme_kwargs.get("pseudo_grad_bits", 32) == 32:
            # alone: a's average is exactly what a sent, nothing of b's
            assert torch.equal(died_in[0]["average"], died_in[0]["sent"])
        assert a["global_step"] == 40
    assert ranks[0]["syncs"][-1]["global"] == ranks[1]["syncs"][-1]["global"]


@pytest.mark.slow  # 28 s: the quick suite's budget (a restarted replica heals in the quick test above)
def test_a_full_restart_continues_from_the_newest_checkpoint():
    # one-rank replicas: a and b save every 8 steps and are both killed; restarted, a from an older
    # checkpoint than b. The lowest replica id (a) would win a tie; b's committed progress wins.
    one = {"devices": 1, "min_replicas": 2, "ckpt_every": 8}
    with FTRun(min_replicas=2) as run:
        for i, rid in enumerate("ab"):
            run.start(rid, spec(i, **one, max_steps=200, kill={"after_step": 42}))
        for rid in "ab":
            assert run.wait_dead(rid) != 0
        old = run.out / "a" / "ckpts" / "step=16.ckpt"
        new = max((run.out / "b" / "ckpts").glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
        assert old.exists() and int(new.stem.split("=")[1]) >= 32, sorted((run.out / "b" / "ckpts").iterdir())
        time.sleep(RESTART_AFTER)
        run.start("a", spec(3, **one, max_steps=64, resume=str(old)))
        run.start("b", spec(4, **one, max_steps=64, resume=str(new)))
        results = run.wait()
    a, b = results["a"], results["b"]
    newest = int(new.stem.split("=")[1])
    assert b["started"]["optimizer_steps"] == a["started"]["optimizer_steps"] == newest
    assert a["started"]["global_"] == b["started"]["global_"]  # a took b's state
    assert a["heals"] and not b["heals"]
    assert_agreement(results)
    assert a["global_step"] == b["global_step"] == 64


@pytest.mark.slow  # 21 s; the agreed end at max_steps is in every quick replica test
def test_max_epochs_ends_every_replica_at_the_same_step_after_a_kill_and_a_heal():
    # 40 batches an epoch, 2 epochs: 80 steps. b dies at step 12 and comes back; healed, it takes over
    # the run's step count but starts its own epoch from its first batch, so its own limit would end it
    # later. The replicas agree at every sync on the first end: both stop at step 80.
    one = {"devices": 1, "max_steps": -1, "max_epochs": 2, "limit_train_batches": 40}
    with FTRun(min_replicas=1) as run:
        run.start("a", spec(0, **one, hold={"at_step": 40, "until": "b.restarted"}))  # (see the quick test)
        run.start("b", spec(1, **one, kill={"after_step": 12}))
        assert run.wait_dead("b") != 0
        time.sleep(RESTART_AFTER)
        run.start("b", spec(2, **one, mark_setup="b.restarted"))
        results = run.wait()
    a, b = results["a"], results["b"]
    assert b["heals"] and b["heals"][0]["step"] > 2, b["heals"]
    assert a["global_step"] == b["global_step"] == 80
    assert_agreement(results)


@pytest.mark.slow  # 29 s; max_epochs keeps the agreed end in the quick suite
def test_early_stopping_on_one_replica_ends_every_replica_at_the_next_sync():
    # Only a has EarlyStopping (its first validation, after 150 batches of its epoch, is below the
    # threshold); b dies at step 6 and is back (healed) well before. The stop waits for the next sync
    # (step 152), where both agree on it; b, which validates at other steps, stops there too.
    val = {"devices": 1, "max_steps": 400, "limit_val_batches": 2, "val_check_interval": 150}
    with FTRun(min_replicas=1) as run:
        run.start("a", spec(0, **val, early_stop_below=100.0, hold={"at_step": 60, "until": "b.restarted"}))
        run.start("b", spec(1, **val, kill={"after_step": 6}))
        assert run.wait_dead("b") != 0
        time.sleep(RESTART_AFTER)
        run.start("b", spec(2, **val, mark_setup="b.restarted"))
        results = run.wait()
    a, b = results["a"], results["b"]
    assert b["heals"], b
    assert a["global_step"] == b["global_step"] == 152  # the first sync after a asked to stop
    assert_agreement(results)


@pytest.mark.slow  # 16 s: the quick suite's budget (a replica joining a finished run)
def test_a_replica_started_after_the_run_ended_exits_at_once_saying_why():
    one = {"devices": 1, "max_steps": 24, "min_replicas": 2}
    with FTRun(min_replicas=2) as run:
        for i, rid in enumerate("ab"):
            run.start(rid, spec(i, **one))
        run.wait()
        began = time.monotonic()
        run.start("c", spec(2, **one))
        code = run.wait_dead("c", timeout=60)
        took = time.monotonic() - began
        log = (run.out / "c.1.log").read_text()
    assert code != 0 and "the run has ended" in log and "finished it at optimizer step 24" in log, log[-2000:]
    assert "start a fresh Lighthouse" in log, log[-2000:]  # the way to another run, or to train this one further
    assert took < 10 + 5, took  # (within 10 s of joining; the process's own start-up is a few seconds more)


@pytest.mark.slow
def test_chaos_three_two_rank_replicas_kills_of_one_rank_and_of_whole_replicas():
    from test_fault_tolerance_ranks import chaos_schedule, run_chaos

    # the last kill leaves the run time to take the replica back (one that comes back after the end
    # exits at once: the run is over)
    plan = chaos_schedule(seed=11, replicas="abc", kills=4, first=24, last=128, ranks=2)
    print("plan:", plan)
    chaos = run_chaos(plan, max_steps=288, seed=2, devices=2)
    calm = run_chaos({rid: [] for rid in "abc"}, max_steps=288, seed=2, devices=2)
    results = chaos["results"]
    assert chaos["deaths"] >= 3
    assert_agreement(results)
    assert {r["global_step"] for r in results.values()} == {288}
    loss, calm_loss = results["a"]["loss"], calm["results"]["a"]["loss"]
    print(f"chaos (2-rank replicas): {chaos['deaths']} deaths, final loss {loss:.4f} against {calm_loss:.4f} calm")
    assert loss < 1.25 * calm_loss, (loss, calm_loss)


@pytest.mark.slow  # 28 s
def test_buffers_are_averaged_across_replicas_and_travel_with_a_heal():
    # BatchNorm's running statistics see no gradient: each replica's own would drift apart. They are
    # averaged across replicas at every period and a healed replica takes them from its source.
    one = {"devices": 1, "max_steps": 128, "batchnorm": True, "min_replicas": 2}
    with FTRun(min_replicas=2) as run:
        hold = {"at_step": 48, "until": "b.restarted"}  # a and c wait there for b's restart (see the quick test)
        run.start("a", spec(0, **one, hold=hold))
        run.start("b", spec(1, **one, kill={"after_step": 12}))
        run.start("c", spec(2, **one, hold=hold))
        assert run.wait_dead("b") != 0
        time.sleep(RESTART_AFTER)
        run.start("b", spec(3, **one, mark_setup="b.restarted"))
        results = run.wait()
    assert results["b"]["heals"]
    assert len({r["buffers"] for r in results.values()}) == 1, {k: r["buffers"] for k, r in results.items()}
    assert results["a"]["running_mean"].abs().sum() > 0  # the statistics did move
    assert_agreement(results)


@pytest.mark.slow  # 13 s: the quick suite's budget (refused at join, before any quorum)
def test_replicas_of_different_sizes_are_refused_naming_both():
    # the first replica to join sets the run's size in the run's store; the other is refused as it
    # joins, before any quorum (whichever of the two is second)
    with FTRun(min_replicas=2) as run:
        run.start("a", spec(0, devices=1, min_replicas=2, max_steps=24))
        run.start("b", spec(1, devices=2, min_replicas=2, max_steps=24))
        deadline = time.monotonic() + 90
        while all(p.poll() is None for p in run.replicas.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = [rid for rid, p in run.replicas.items() if p.poll() is not None]
        assert len(ended) == 1 and run.replicas[ended[0]].returncode != 0, ended
        log = (run.out / f"{ended[0]}.1.log").read_text()
    assert "every replica of a run must have the same number of ranks" in log, log[-3000:]
    assert ("has 2 ranks and the run's replicas have 1" in log) or ("has 1 ranks and the run's replicas have 2" in log)


@pytest.mark.slow  # two replicas of two ranks each starting
def test_a_replica_of_the_same_size_and_another_layout_is_refused_at_join_naming_both():
    # a: two ranks, each holding the whole model (its half of the tensors exchanged); b: two ranks
    # sharding the model with FSDP2 (each exchanging its shard). The same number of ranks, other parts
    # of the model per rank: the cross-replica collectives would not match.
    short = {"ft": {"timeout": 10.0, "quorum_timeout": 60.0}, "min_replicas": 2, "max_steps": 16}
    with FTRun(min_replicas=2) as run:
        run.start("a", spec(0, **short, mark_setup="a.setup"))
        deadline = time.monotonic() + 120
        while not (run.out / "a.setup").exists():
            assert time.monotonic() < deadline and run.replicas["a"].poll() is None, run.tails()
            time.sleep(0.2)
        time.sleep(2.0)  # a joins the run (and says what it is) before b starts
        began = time.monotonic()
        run.start("b", spec(1, **short, scheme_kwargs={"sync_period": 8, "shard": "fsdp"}))
        code = run.wait_dead("b", timeout=120)
        took = time.monotonic() - began
        log = (run.out / "b.1.log").read_text()
        a_alive = run.replicas["a"].poll() is None
    assert code != 0, log[-3000:]
    assert "2 ranks, unsharded" in log and "2 ranks, shard='fsdp' in groups of 2" in log, log[-3000:]
    assert took < 45, took  # its own start-up (two ranks, FSDP2) and seconds more, not a collective's timeout
    assert a_alive  # the run's replica is left alone


@pytest.mark.slow  # three replicas of two ranks: six processes start
def test_every_rank_of_a_replica_healing_from_two_different_models_ends_with_the_same_one():
    # b and c are at the same committed step (restored so) with different models and as many committed
    # batches; a starts fresh and heals. torchft gives each rank of a healing replica its source offset
    # by the rank: a's rank 0 heals from b, its rank 1 from c. a sorts first in the quorum: where the
    # replicas compared one fingerprint summed over their ranks, the tie made a's mix the run's model.
    committed = {"step": 5, "batches_committed": 10}
    three = {"min_replicas": 3, "max_steps": 8}
    with FTRun(min_replicas=3) as run:
        run.start("a", spec(0, **three))
        run.start("b", spec(1, **three, committed=committed))
        run.start("c", spec(2, **three, committed=committed))
        run.wait()
        ranks = {r: {rid: load_rank(run, rid, r) for rid in "abc"} for r in (0, 1)}
    assert ranks[0]["a"]["heals"] and ranks[1]["a"]["heals"]
    started = {f"{rid}{r}": ranks[r][rid]["started"]["global_"][:8] for rid in "abc" for r in (0, 1)}
    assert len(set(started.values())) == 1, f"the replicas' ranks started from different global models: {started}"
    # one source kept its own model: the run's model is one replica's, not a mix of two
    assert not ranks[0]["b"]["reconciled"] or not ranks[0]["c"]["reconciled"]
    for r in (0, 1):
        ranks_agree(ranks[r])
    for rid in "abc":
        assert ranks[0][rid]["global"] == ranks[1][rid]["global"], rid
