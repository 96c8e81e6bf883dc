"""Fault-tolerant periodic training on real processes (torchft, gloo, CPU): replicas that die by
SIGKILL mid-block or inside an exchange, come back from a fresh initialisation, heal from a live
peer and join the run, while the others keep training.

What every test checks, from the replicas' own records (ft_worker.py): every committed sync (by
torchft's committed step) has the same global model and outer optimizer state, bit for bit, on
every replica that took part; the survivors' syncs after a death average over the replicas left;
at the end every replica that finished holds the same global model and stopped at the same step.
"""

from __future__ import annotations

import random
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from ft_harness import FTRun

pytestmark = [pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[2]


# seconds between a replica's death and its restart: longer than the Lighthouse's heartbeat and join
# timeouts (5 s each in FTRun), so that the survivors' next sync is formed without it first
RESTART_AFTER = 6.0


def committed(results: dict) -> dict[int, dict[str, tuple[str, str]]]:
    """Committed step -> replica -> (global model digest, outer optimizer state digest)."""
    by_step: dict[int, dict[str, tuple[str, str]]] = {}
    for rid, res in results.items():
        for sync in res["syncs"]:
            by_step.setdefault(sync["step"], {})[rid] = (sync["global"], sync["outer_state"])
    return by_step


def assert_agreement(results: dict) -> None:
    for step, seen in committed(results).items():
        assert len(set(seen.values())) == 1, f"committed step {step} differs between replicas: {seen}"
    finals = {rid: (res["global"], res["outer_state"], res["global_step"]) for rid, res in results.items()}
    assert len(set(finals.values())) == 1, f"replicas ended apart: {finals}"


def spec(seed: int, **kwargs) -> dict:
    base = {"init_seed": seed, "min_replicas": 2, "max_steps": 96, "step_sleep": 0.15}
    base["scheme_kwargs"] = {"sync_period": 8}
    base.update(kwargs)
    return base


@pytest.mark.slow  # 30 s; two-rank replicas die, leave, heal and rejoin in the quick suite
def test_killed_replica_is_left_out_then_heals_and_rejoins():
    with FTRun(min_replicas=2) as run:
        for i, rid in enumerate("abc"):
            run.start(rid, spec(i, kill={"after_step": 12} if rid == "c" else None))
        assert run.wait_dead("c") != 0
        time.sleep(RESTART_AFTER)
        run.start("c", spec(7))  # a fresh initialisation, the same name
        results = run.wait()
    a, b, c = results["a"], results["b"], results["c"]
    assert_agreement(results)
    for survivor in (a, b):
        # (which replicas formed the first quorum depends on how fast each started; what follows does not)
        after_death = [s for s in survivor["syncs"] if s["optimizer_steps"] > 12]
        assert after_death[0]["quorum"] == 2, survivor["syncs"]  # c is left out
        assert after_death[-1]["quorum"] == 3, survivor["syncs"]  # and back
        # a survivor never falls behind the run (it may have healed once, joining at its start)
        assert all(h["optimizer_steps"] == 0 for h in survivor["heals"]), survivor["heals"]
    # the restarted c took over the run's step count and its syncs; it never reset the others
    assert c["global_step"] == a["global_step"] == b["global_step"] == 96
    assert c["syncs"][0]["optimizer_steps"] > 12
    assert {s["step"] for s in c["syncs"]} <= {s["step"] for s in a["syncs"]}
    # the learning-rate schedule continued on c (StepLR every 5 steps) as on the others
    assert c["lr"] == a["lr"]


@pytest.mark.parametrize(
    ("scheme_kwargs", "collective"),
    [
        # fp32: one all-reduce of the pseudo-gradient, then the count of replicas that took part: c dies
        # after the average is complete everywhere, so every survivor holds a 3-replica average it must not apply
        ({"sync_period": 8}, 2),
        # 4 bits: fp32 biases, then the all-to-all of packed stripes, then the all-gather: c dies after
        # sending its stripes, before the all-gather
        pytest.param({"sync_period": 8, "pseudo_grad_bits": 4}, 3, marks=pytest.mark.slow),
        # a streaming fragment in flight in the background thread (2 fragments, applied 1 step later)
        pytest.param(
            {"sync_period": 8, "pseudo_grad_bits": 4, "num_fragments": 2, "fragment_sync_delay": 1},
            3,
            marks=pytest.mark.slow,  # (20 s each; the quick suite keeps fp32)
        ),
    ],
    ids=["fp32", "4bit", "streaming"],
)
def test_replica_killed_inside_an_exchange_never_leaves_a_partial_average(scheme_kwargs, collective):
    scheme = "streaming_diloco" if "num_fragments" in scheme_kwargs else "diloco"
    with FTRun(min_replicas=2) as run:
        for i, rid in enumerate("abc"):
            kill = {"sync": 3, "collective": collective} if rid == "c" else None
            run.start(
                rid, spec(i, scheme=scheme, scheme_kwargs=scheme_kwargs, max_steps=40, kill=kill, keep_exchanges=True)
            )
        assert run.wait_dead("c") != 0
        del run.replicas["c"]
        results = run.wait()
    assert_agreement(results)
    a, b = results["a"], results["b"]
    # the sync c died in: its first attempt had all three, the survivors retried it over two and committed that
    died_in = [e for e in a["exchanges"] if e["quorums"][0] == 3 and e["quorums"][-1] == 2]
    assert len(died_in) == 1, [e["quorums"] for e in a["exchanges"]]
    step = died_in[0]["step"]
    mine = {r["replica_id"]: next(e for e in r["exchanges"] if e["step"] == step) for r in (a, b)}
    two_way = (mine["a"]["sent"] + mine["b"]["sent"]) / 2
    if scheme_kwargs.get("pseudo_grad_bits", 32) == 32:
        assert torch.equal(mine["a"]["average"], two_way)  # exactly the survivors' mean, nothing of c's
    else:  # quantized (with the residuals of earlier syncs added): near the survivors' mean
        err = (mine["a"]["average"] - two_way).norm() / two_way.norm()
        assert err < 0.5, float(err)
    assert torch.equal(mine["a"]["average"], mine["b"]["average"])
    assert a["global_step"] == b["global_step"] == 40


@pytest.mark.slow  # 29 s; the Trainer's replicas die and heal in the quick suite
def test_fabric_replicas_survive_a_death_and_a_restart():
    with FTRun(min_replicas=2) as run:
        for i, rid in enumerate("abc"):
            run.start(rid, spec(i, front="fabric", max_steps=96, kill={"after_step": 12} if rid == "c" else None))
        assert run.wait_dead("c") != 0
        time.sleep(RESTART_AFTER)
        run.start("c", spec(9, front="fabric", max_steps=96))
        results = run.wait()
    assert_agreement(results)
    a, c = results["a"], results["c"]
    assert 2 in [s["quorum"] for s in a["syncs"]] and a["syncs"][-1]["quorum"] == 3
    assert c["global_step"] == a["global_step"] == 96
    assert c["syncs"][0]["optimizer_steps"] > 12


@pytest.mark.slow
def test_a_preempted_replica_stops_as_one_and_leaves_the_run_to_the_others():
    """SIGTERM to rank 1 of a two-rank replica (a preemption notice): both of its ranks stop at the
    same step, exit cleanly, its rank 0 leaves the quorums, and the other replicas go on without it;
    started again, it heals and finishes with them."""
    with FTRun(min_replicas=1) as run:
        run.start("a", spec(0, min_replicas=1, max_steps=128, devices=2))  # (replicas of one size)
        term = {"after_step": 12, "signal": "TERM", "rank": 1}
        run.start("b", spec(1, min_replicas=1, max_steps=128, devices=2, kill=term))
        assert run.wait_dead("b") == 0
        stopped = [int((run.out / f"b.rank{r}.stopped").read_text()) for r in range(2)]
        assert stopped[0] == stopped[1] and 12 <= stopped[0] < 128, stopped
        time.sleep(RESTART_AFTER)
        run.start("b", spec(5, min_replicas=1, max_steps=128, devices=2))
        results = run.wait()
    assert_agreement(results)
    a, b = results["a"], results["b"]
    quorums = [s["quorum"] for s in a["syncs"] if s["optimizer_steps"] > stopped[0]]
    assert quorums[0] == 1 and quorums[-1] == 2, a["syncs"]  # b left, then came back
    assert b["heals"] and b["global_step"] == a["global_step"] == 128


@pytest.mark.slow  # about 28 s each (two replicas starting); the quick suite times ReplicaSync on a stand-in Manager
@pytest.mark.parametrize(("scheme", "delay"), [("diloco", 0), ("streaming_diloco", 1)])
def test_a_replica_waiting_for_the_others_quorum_counts_the_wait_as_waiting(scheme, delay):
    # b sleeps 0.1 s a step more than a: a waits about 0.8 s for b's quorum at each of its 4 syncs,
    # whether the sync blocks the loop or runs beside it for a step (then the loop waits to apply it)
    kw = {"scheme": scheme, "max_steps": 32, "scheme_kwargs": {"sync_period": 8, "fragment_sync_delay": delay}}
    with FTRun(min_replicas=2) as run:
        run.start("a", spec(0, step_sleep=0.0, **kw))
        run.start("b", spec(1, step_sleep=0.1, **kw))
        results = run.wait()
    a = results["a"]
    assert a["global_step"] == results["b"]["global_step"] == 32
    late = 4 * 8 * 0.1
    assert a["comm_seconds"] >= 0.8 * late, (a["comm_seconds"], a["quorum_seconds"], a["wall_seconds"])
    assert a["comm_seconds"] <= a["wall_seconds"]


def test_replicas_at_the_same_step_with_different_models_take_one_before_averaging():
    # torchft heals by committed step only; b's global model is changed behind its back after its
    # committed step 3 (as when two replicas each formed a first quorum alone, or a sync committed on
    # some replicas only). At the next sync the fingerprints differ: the replica with the most
    # committed batches (tied here: then the lowest rank, a) gives its state, b takes it and sends zeros.
    with FTRun(min_replicas=2) as run:
        run.start("a", spec(0, max_steps=40))
        run.start("b", spec(1, max_steps=40, perturb_at_step=3))
        results = run.wait()
    a, b = results["a"], results["b"]
    # (at step 0 the run's first agreement: a and b start from different initialisations, b takes a's)
    assert b["reconciled"] == [0, 3] and a["reconciled"] == []
    # b's digest at step 3 is of the model before the change; every later committed step agrees
    assert_agreement(results)


def chaos_schedule(
    seed: int, replicas: str, kills: int, first: int, last: int, ranks: int = 1
) -> dict[str, list[dict]]:
    """Per replica, the kill points of its successive lives: ``kills`` in all, at random optimizer steps
    in [first, last] (at least 16 steps apart), half mid-block, half inside an exchange. With replicas
    of several ``ranks``, a kill takes one rank (either) or the whole replica, a third each."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(first, last, 16), kills))
    plan: dict[str, list[dict]] = {rid: [] for rid in replicas}
    victim = None
    for step in steps:
        victim = rng.choice([r for r in replicas if r != victim])
        if rng.random() < 0.5:
            plan[victim].append({"after_step": step + rng.randrange(8)})
        else:  # the sync at about this step (committed step = syncs so far + 1), in one of its collectives
            plan[victim].append({"sync": step // 8 + 1, "collective": rng.randint(1, 4)})
        if ranks > 1:
            who = rng.choice([*range(ranks), None])
            if who is not None:
                plan[victim][-1]["rank"] = who
    return plan


def run_chaos(plan: dict[str, list[dict]], max_steps: int, seed: int, **extra) -> dict:
    sk = {"sync_period": 8, "pseudo_grad_bits": 4, **extra.pop("scheme_kwargs", {})}
    lives = dict.fromkeys(plan, 0)
    with FTRun(min_replicas=2) as run:
        for i, rid in enumerate(plan):
            run.start(
                rid,
                spec(
                    seed * 10 + i,
                    max_steps=max_steps,
                    step_sleep=0.1,
                    scheme_kwargs=sk,
                    kill=(plan[rid] or [None])[0],
                    **extra,
                ),
            )
        pending = {rid for rid in plan if plan[rid]}
        deaths = 0
        while pending:
            for rid in sorted(pending):
                proc = run.replicas[rid]
                if proc.poll() is None:
                    continue
                if proc.returncode == 0:  # finished before its kill point came
                    pending.discard(rid)
                    continue
                deaths += 1
                lives[rid] += 1
                time.sleep(RESTART_AFTER)
                nxt = plan[rid][lives[rid]] if lives[rid] < len(plan[rid]) else None
                run.start(
                    rid,
                    spec(
                        seed * 10 + 5 + lives[rid],
                        max_steps=max_steps,
                        step_sleep=0.1,
                        scheme_kwargs=sk,
                        kill=nxt,
                        **extra,
                    ),
                )
                if nxt is None:
                    pending.discard(rid)
            time.sleep(0.2)
        results = run.wait(timeout=600)
    return {"results": results, "deaths": deaths}


@pytest.mark.slow
def test_chaos_four_replicas_five_kills_and_restarts():
    plan = chaos_schedule(seed=7, replicas="abcd", kills=6, first=24, last=200)
    chaos = run_chaos(plan, max_steps=320, seed=1)
    calm = run_chaos({rid: [] for rid in "abcd"}, max_steps=320, seed=1)
    assert chaos["deaths"] >= 5
    results = chaos["results"]
    assert_agreement(results)
    assert {r["global_step"] for r in results.values()} == {320}
    # each replica's last life healed once, when it joined; none was left behind by later quorums
    assert all(len(r["heals"]) <= 1 for r in results.values()), {k: r["heals"] for k, r in results.items()}
    # every committed step of the run was committed by at least min_replicas replicas, and never
    # applied twice with different models (assert_agreement); quality close to the fault-free run
    loss, calm_loss = results["a"]["loss"], calm["results"]["a"]["loss"]
    print(f"chaos: {chaos['deaths']} deaths, final loss {loss:.4f} against {calm_loss:.4f} without faults")
    assert loss < 1.25 * calm_loss, (loss, calm_loss)


def test_the_recipe_runs_as_replicas_and_they_report_the_same_model():
    args = [
        sys.executable,
        str(REPO / "recipes" / "train_lm.py"),
        "fit",
        "--config",
        "lstm_tiny",
        "--trainer.max_steps=12",
        "--trainer.val_check_interval=12",
        "--trainer.strategy=lightning_commstrats.DiLoCoStrategy",
        "--trainer.strategy.init_args.sync_period=4",
        "--trainer.strategy.init_args.pseudo_grad_bits=4",
        "--trainer.strategy.init_args.fault_tolerance.min_replicas=2",
    ]
    with FTRun(min_replicas=2) as run:
        for rid in ("r0", "r1"):  # the Lighthouse comes from TORCHFT_LIGHTHOUSE
            run.start(rid, {}, command=[*args, f"--trainer.strategy.init_args.fault_tolerance.replica_id={rid}"])
        run.wait(results=False)
        reports = [
            re.search(r"\[lm\] valid perplexity ([\d.]+)", (run.out / f"{rid}.1.log").read_text())
            for rid in ("r0", "r1")
        ]
        assert all(reports), run.tails()
    assert reports[0].group(1) == reports[1].group(1)  # the same global model on both replicas


def _wait_for(predicate, timeout: float, what: str, run: FTRun) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {timeout:.0f} s:\n{run.tails()}")
        time.sleep(0.1)


@pytest.mark.slow  # about 45 s: the others' period must outlast the wait
def test_a_replica_waiting_for_its_quorum_stops_within_seconds_of_a_sigterm_and_the_others_go_on():
    # a and b sync once, at step 64 (32 s of steps): c, started after their first quorum, waits for
    # the next one; a SIGTERM then stops it within one renewal of its request, a and b finish
    slow = {"min_replicas": 2, "max_steps": 64, "step_sleep": 0.5, "scheme_kwargs": {"sync_period": 64}}
    with FTRun(min_replicas=1) as run:
        run.start("a", spec(0, progress=True, **slow))
        run.start("b", spec(1, **slow))
        step = run.out / "a.step"
        _wait_for(lambda: step.exists() and int(step.read_text() or 0) >= 1, 120, "a's first step", run)
        run.start("c", spec(2, **slow))
        log = run.out / "c.1.log"
        _wait_for(lambda: "is waiting for a quorum" in log.read_text(errors="replace"), 60, "c waiting", run)
        assert int(step.read_text() or 0) < 60  # a and b are still far from their sync
        c = run.replicas["c"]
        signalled = time.monotonic()
        c.send_signal(signal.SIGTERM)
        code = run.wait_dead("c", timeout=30)
        stopped_after = time.monotonic() - signalled
        print(f"c stopped {stopped_after:.1f} s after the SIGTERM (exit {code}); a at step {step.read_text()}")
        assert stopped_after < 10, run.tails()
        assert "stopping on the signal while waiting for a quorum" in log.read_text(errors="replace")
        for rid in "ab":
            assert run.wait_dead(rid, timeout=180) == 0, run.tails()
        results = {rid: torch.load(run.out / f"{rid}.pt", weights_only=False) for rid in "ab"}
    assert results["a"]["global_step"] == results["b"]["global_step"] == 64
    assert [s["quorum"] for s in results["a"]["syncs"]] == [2]  # a and b, without c
