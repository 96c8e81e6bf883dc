"""A SIGTERM to any one rank ends the run on every rank, at the same step, within a bound.

Each trial starts real ranks (``sigterm_worker.py``), sends SIGTERM to one of them at a chosen point
of a step (inside an exchange, inside a collective its peer waits in, from a background exchange
thread, during validation, or at a random time from outside) and checks that every rank ends fit
on Lightning's ``SIGTERMException`` at the same optimizer step within ``BOUND_SECONDS`` of the
signal, that every process exits (exit code 0), and that nothing is left running.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import _base_env, free_port, mpiexec

from lightning_commstrats.comm import MPI4PY_AVAILABLE

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "sigterm_worker.py"
# From the signal to the last rank's exit. Every rank stops at the second batch start after it
# (a few tenths of a second here) plus the step in progress; the rest is the processes' teardown.
BOUND_SECONDS = 20.0
START_TIMEOUT = 180.0


def trial(
    spec: dict[str, Any], world: int = 2, *, launcher: str = "env", victim: int = 0, delay: float | None = None
) -> dict[str, Any]:
    """Run one trial. With ``delay``, the test itself sends SIGTERM to rank ``victim`` that many
    seconds after every rank has passed step 3; else the spec's ``signal`` sends it from inside."""
    out = Path(tempfile.mkdtemp(prefix="commstrats-sigterm-"))
    spec = {**spec, "devices": world}
    args = [str(WORKER), json.dumps(spec), str(out)]
    env = _base_env()
    log = open(out / "log.txt", "w+")
    procs: list[subprocess.Popen] = []
    try:
        if launcher == "env":
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), NODE_RANK="0")
            for r in range(world):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *args],
                        env={**env, "LOCAL_RANK": str(r)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        else:
            exe = mpiexec()
            assert exe is not None, "mpiexec not found"
            procs.append(
                subprocess.Popen(
                    [exe, "-n", str(world), sys.executable, *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        sent = None
        if delay is not None:
            deadline = time.monotonic() + START_TIMEOUT
            while not all((out / f"running{r}").exists() for r in range(world)):
                assert time.monotonic() < deadline, "the run did not start:\n" + _text(log)
                assert all(p.poll() is None for p in procs), "a rank ended early:\n" + _text(log)
                time.sleep(0.05)
            time.sleep(delay)
            sent = time.time()
            os.kill(int((out / f"pid{victim}").read_text()), signal.SIGTERM)
        deadline = time.monotonic() + START_TIMEOUT + 2 * BOUND_SECONDS
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = time.time()
        hung = [i for i, p in enumerate(procs) if p.poll() is None]
        assert not hung, f"processes {hung} still running: the run hung\n" + _text(log)
        if sent is None:
            assert (out / "signal.json").exists(), "the signal was never sent\n" + _text(log)
            sent = json.loads((out / "signal.json").read_text())["time"]
        assert [p.returncode for p in procs] == [0] * len(procs), _text(log)
        results = [json.loads((out / f"result{r}.json").read_text()) for r in range(world)]
        ckpt = out / "stopped.ckpt"
        saved = torch.load(ckpt, weights_only=False)["global_step"] if ckpt.exists() else None
        return {"results": results, "sent": sent, "ended": ended, "log": _text(log), "saved_step": saved}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        log.close()
        shutil.rmtree(out, ignore_errors=True)


def _text(log: Any) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-6000:]


def check_stopped_together(outcome: dict[str, Any], max_steps: int) -> int:
    """Every rank ended on SIGTERM, at one step, before the end, within the bound. Returns the step."""
    results = outcome["results"]
    assert all(r["stopped"] and r["exception"] == "SIGTERMException" for r in results), results
    steps = {r["step"] for r in results}
    assert len(steps) == 1, f"ranks stopped at different steps: {results}"
    step = steps.pop()
    assert step < max_steps, f"the run finished ({step} steps) instead of stopping: {results}"
    assert all(r["received_sigterm"] for r in results)
    last_stop = max(r["time"] for r in results)
    assert last_stop - outcome["sent"] < BOUND_SECONDS, f"stopped {last_stop - outcome['sent']:.1f} s after the signal"
    # every process gone (polled every 50 ms), teardown included
    gone = outcome["ended"] - outcome["sent"]
    assert gone < BOUND_SECONDS, f"the processes exited {gone:.1f} s after the signal"
    return step


# The points of a step the quick suite covers: each one hung (or ended ranks at different steps)
# with Lightning's own SIGTERM handling.
INSIDE = {
    # the reported hang: rank 0 signalled inside flat_weights, at the start of an exchange
    "diloco-flat_weights": (
        {"strategy": "diloco", "kwargs": {"sync_period": 4, "sync_period_unit": "steps"}},
        {"rank": 0, "target": 0, "where": "flat_weights", "nth": 3},
    ),
    # rank 0 blocked in a 4-bit exchange's collective when its signal comes
    "diloco4-collective": (
        {"strategy": "diloco", "kwargs": {"sync_period": 4, "sync_period_unit": "steps", "pseudo_grad_bits": 4}},
        {"rank": 1, "target": 0, "where": "collective", "nth": 2},
    ),
    # a fragment's exchange in the background thread signals its own rank
    "streaming-background": (
        {
            "strategy": "streaming_diloco",
            "kwargs": {"sync_period": 4, "num_fragments": 2, "fragment_sync_delay": 1, "pseudo_grad_bits": 4},
        },
        {"rank": 1, "target": 1, "where": "exchange", "nth": 3},
    ),
    # a gradient scheme, the signal to a rank other than 0 (Lightning's broadcast never hears it)
    "allreduce-rank1": ({"strategy": "allreduce"}, {"rank": 1, "target": 1, "where": "batch", "nth": 6}),
    # 1-bit SGD, rank 0 inside its gradient collective while rank 1 waits in it
    "onebit-collective": ({"strategy": "onebit_sgd"}, {"rank": 0, "target": 1, "where": "collective", "nth": 5}),
    # during a validation inside fit
    "bmuf-validation": (
        {"strategy": "bmuf", "kwargs": {"sync_period": 4, "sync_period_unit": "steps"}, "val_every": 8},
        {"rank": 1, "target": 1, "where": "validation", "nth": 2},
    ),
}


# the reported hang and a rank other than 0 in the quick suite; the other points with the slow ones
QUICK = ("diloco-flat_weights", "allreduce-rank1")


@pytest.mark.parametrize("case", [c if c in QUICK else pytest.param(c, marks=pytest.mark.slow) for c in INSIDE])
def test_sigterm_inside_a_step_stops_every_rank_at_the_same_step(case):
    spec, sig = INSIDE[case]
    outcome = trial({**spec, "signal": sig, "max_steps": 400})
    step = check_stopped_together(outcome, 400)
    took = max(r["time"] for r in outcome["results"]) - outcome["sent"]
    gone = outcome["ended"] - outcome["sent"]
    print(f"{case}: every rank stopped at step {step}, {took:.1f} s after the signal, exited after {gone:.1f} s")


def test_stop_check_every_runs_a_round_every_k_batches():
    """``stop_check_every=4``: rounds start at batches 1, 5, 9... and are read 4 batches later. The
    signal at batch 6 rides the round of batch 9, read at batch 13: every rank stops there, after
    12 steps (with a round per batch: after 6)."""
    spec = {"strategy": "allreduce", "kwargs": {"stop_check_every": 4}}
    outcome = trial({**spec, "signal": {"rank": 1, "target": 1, "where": "batch", "nth": 6}, "max_steps": 400})
    assert check_stopped_together(outcome, 400) == 12


def test_sigterm_checkpoints_the_run_on_every_rank():
    """On SIGTERM every rank is at the same point: a checkpoint saved in ``on_exception`` completes."""
    spec = {"strategy": "model_averaging", "kwargs": {"sync_period": 4, "sync_period_unit": "steps"}}
    outcome = trial({**spec, "signal": {"rank": 1, "target": 0, "where": "batch", "nth": 9}, "checkpoint": True})
    step = check_stopped_together(outcome, 400)
    assert outcome["saved_step"] == step


@pytest.mark.mpi
@pytest.mark.mpi4py
@pytest.mark.skipif(not MPI4PY_AVAILABLE, reason=str(MPI4PY_AVAILABLE))
def test_sigterm_under_mpiexec_stops_every_rank():
    """local_sgd over MPI: no torch.distributed at all, so Lightning's broadcast never ran and the
    signalled rank stopped alone while its peer waited in MPI_Allreduce for ever."""
    spec = {"strategy": "local_sgd", "kwargs": {"sync_period": 4}}
    outcome = trial({**spec, "signal": {"rank": 1, "target": 1, "where": "batch", "nth": 7}}, launcher="mpiexec")
    check_stopped_together(outcome, 400)


SWEEP_SCHEMES = [
    ("allreduce", {}),
    ("diloco", {"sync_period": 4, "sync_period_unit": "steps"}),
    ("diloco", {"sync_period": 4, "sync_period_unit": "steps", "pseudo_grad_bits": 4}),
    ("streaming_diloco", {"sync_period": 4, "num_fragments": 2, "fragment_sync_delay": 1}),
    ("bmuf", {"sync_period": 4, "sync_period_unit": "steps"}),
    ("onebit_sgd", {}),
]


@pytest.mark.slow
@pytest.mark.parametrize("trial_index", range(24))
def test_sigterm_at_random_times_never_hangs(trial_index):
    """24 trials: six schemes, the signal from outside at a random time (seeded) to a random rank of
    two or three; every trial must stop every rank at the same step within the bound."""
    rng = random.Random(trial_index)
    strategy, kwargs = SWEEP_SCHEMES[trial_index % len(SWEEP_SCHEMES)]
    world = 3 if trial_index % 4 == 3 else 2
    victim = rng.randrange(world)
    delay = rng.uniform(0.0, 2.0)
    outcome = trial({"strategy": strategy, "kwargs": kwargs, "max_steps": 2000}, world, victim=victim, delay=delay)
    step = check_stopped_together(outcome, 2000)
    took = max(r["time"] for r in outcome["results"]) - outcome["sent"]
    print(f"trial {trial_index}: {strategy} {kwargs}, {world} ranks, rank {victim} at +{delay:.2f} s:", end=" ")
    print(f"step {step}, stopped after {took:.1f} s, exited after {outcome['ended'] - outcome['sent']:.1f} s")
