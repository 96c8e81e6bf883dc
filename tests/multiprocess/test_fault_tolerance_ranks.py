"""Fault-tolerant periodic training on real processes (torchft, gloo, CPU): replicas that die by
SIGKILL mid-block or inside an exchange, come back from a fresh initialisation, heal from a live
peer and join the run, while the others keep training.

What every test checks, from the replicas' own records (ft_worker.py): every committed sync (by
torchft's committed step) has the same global model and outer optimizer state, bit for bit, on
every replica that took part; the survivors' syncs after a death average over the replicas left;
at the end every replica that finished holds the same global model and stopped at the same step.
"""

from __future__ import annotations

import time

import pytest

from ft_harness import FTRun

pytestmark = [pytest.mark.multiprocess]


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
    base = {"init_seed": seed, "min_replicas": 2, "max_steps": 64, "step_sleep": 0.15}
    base["scheme_kwargs"] = {"sync_period": 8}
    base.update(kwargs)
    return base


def test_killed_replica_is_left_out_then_heals_and_rejoins():
    with FTRun(min_replicas=2) as run:
        for i, rid in enumerate("abc"):
            run.start(rid, spec(i, kill={"after_step": 12} if rid == "c" else None))
        assert run.wait_dead("c") != 0
        time.sleep(1.0)
        run.start("c", spec(7))  # a fresh initialisation, the same name
        results = run.wait()
    a, b, c = results["a"], results["b"], results["c"]
    assert_agreement(results)
    for survivor in (a, b):
        # (which replicas formed the first quorum depends on how fast each started; what follows does not)
        after_death = [s for s in survivor["syncs"] if s["optimizer_steps"] > 12]
        assert after_death[0]["quorum"] == 2, survivor["syncs"]  # c is left out
        assert after_death[-1]["quorum"] == 3, survivor["syncs"]  # and back
    # the restarted c took over the run's step count and its syncs; it never reset the others
    assert c["global_step"] == a["global_step"] == b["global_step"] == 64
    assert c["syncs"][0]["optimizer_steps"] > 12
    assert {s["step"] for s in c["syncs"]} <= {s["step"] for s in a["syncs"]}
    # the learning-rate schedule continued on c (StepLR every 5 steps) as on the others
    assert c["lr"] == a["lr"]
