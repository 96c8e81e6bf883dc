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
import torch
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
    with FTRun(min_replicas=2, join_timeout_ms=5000) as run:
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


@pytest.mark.parametrize(
    ("scheme_kwargs", "collective"),
    [
        # fp32: one all-reduce of the pseudo-gradient, then the count of replicas that took part: c dies
        # after the average is complete everywhere, so every survivor holds a 3-replica average it must not apply
        ({"sync_period": 8}, 2),
        # 4 bits: fp32 biases, then the all-to-all of packed stripes, then the all-gather: c dies after
        # sending its stripes, before the all-gather
        ({"sync_period": 8, "pseudo_grad_bits": 4}, 3),
        # a streaming fragment in flight in the background thread (2 fragments, applied 1 step later)
        ({"sync_period": 8, "pseudo_grad_bits": 4, "num_fragments": 2, "fragment_sync_delay": 1}, 3),
    ],
    ids=["fp32", "4bit", "streaming"],
)
def test_replica_killed_inside_an_exchange_never_leaves_a_partial_average(scheme_kwargs, collective):
    scheme = "streaming_diloco" if "num_fragments" in scheme_kwargs else "diloco"
    with FTRun(min_replicas=2, join_timeout_ms=5000) as run:
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
