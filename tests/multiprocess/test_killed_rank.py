"""A rank that dies never hangs the job: the others stop within seconds, naming the rank that stopped."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness import WORKER, _base_env, free_port

pytestmark = pytest.mark.multiprocess

BOUND_SECONDS = 30.0  # from the kill to the last survivor's exit


def _kill_one(world: int, victim: int, strategy: str = "allreduce", **kwargs) -> tuple[float, list[int], list[str]]:
    out = Path(tempfile.mkdtemp(prefix="commstrats-kill-"))
    long = {"strategy": strategy, "kwargs": kwargs, "model": "lm", "max_steps": 100_000, "marker_at": 3}
    long["devices"] = world
    spec = {"scenarios": {"long": long}}
    env = _base_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), NODE_RANK="0")
    logs = [open(out / f"log{r}.txt", "w+") for r in range(world)]
    args = [sys.executable, str(WORKER), json.dumps(spec), str(out)]
    procs = [
        subprocess.Popen(
            args, env={**env, "LOCAL_RANK": str(r)}, stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True
        )
        for r in range(world)
    ]
    try:
        deadline = time.monotonic() + 180
        while not all((out / f"running{r}").exists() for r in range(world)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
            time.sleep(0.2)
        os.killpg(procs[victim].pid, signal.SIGKILL)
        killed = time.monotonic()
        survivors = [p for r, p in enumerate(procs) if r != victim]
        while any(p.poll() is None for p in survivors) and time.monotonic() - killed < 3 * BOUND_SECONDS:
            time.sleep(0.1)
        elapsed = time.monotonic() - killed
        codes = [p.poll() for p in survivors]
        texts = []
        for f in logs:
            f.seek(0)
            texts.append(f.read())
        return elapsed, codes, [t for r, t in enumerate(texts) if r != victim]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for f in logs:
            f.close()
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize(("world", "victim"), [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_the_others_stop_within_seconds_naming_the_killed_rank(world, victim):
    elapsed, codes, logs = _kill_one(world, victim)
    assert None not in codes, f"survivors still running {elapsed:.0f} s after the kill"
    assert all(code != 0 for code in codes)
    assert elapsed < BOUND_SECONDS
    for text in logs:
        assert "stopped (killed, out of memory, or exited on an error)" in text, text[-3000:]
        assert f"rank(s) [{victim}]" in text, text[-3000:]
    print(f"{world} ranks, rank {victim} killed: the others exited in {elapsed:.1f} s")


def test_a_sharded_run_stops_naming_the_killed_rank_when_fsdp2s_own_collective_fails():
    # one group of 2: the partner's next collective is FSDP2's all-gather (or reduce-scatter), which the
    # package does not issue itself; its gloo error ("Connection closed by peer") must still come out
    # as the CollectiveError that names the rank that stopped
    elapsed, codes, logs = _kill_one(2, 1, shard="fsdp", group_size=2, shard_policy={"min_unit_numel": 1})
    assert None not in codes, f"the survivor still ran {elapsed:.0f} s after the kill"
    assert codes == [codes[0]] and codes[0] != 0
    assert elapsed < BOUND_SECONDS
    for text in logs:
        assert "CollectiveError" in text, text[-3000:]
        assert "rank(s) [1]" in text, text[-3000:]


@pytest.mark.parametrize(
    ("victim", "mode"),
    # a dead worker in the slow suite (13 s each: the quick suite's budget); the server's death stays quick
    [pytest.param(1, "sync", marks=pytest.mark.slow), (0, "sync"), pytest.param(1, "async", marks=pytest.mark.slow)],
)
def test_a_parameter_server_run_stops_when_a_worker_or_the_server_dies(victim, mode):
    """Killed worker: the server (rank 0) waits for a round that cannot complete, and its watch of
    the heartbeats names the dead rank. Killed server: the workers' calls fail at once."""
    kwargs = {"mode": mode} if mode == "sync" else {"mode": mode, "sync_period": 2, "sync_period_unit": "steps"}
    elapsed, codes, logs = _kill_one(3, victim, "parameter_server", **kwargs)
    assert None not in codes, f"survivors still running {elapsed:.0f} s after the kill"
    assert all(code != 0 for code in codes)
    assert elapsed < BOUND_SECONDS
    for text in logs:
        assert "CollectiveError" in text, text[-3000:]
    if victim != 0:  # rank 0 alive: its store names the dead rank
        assert any(f"rank(s) [{victim}]" in text for text in logs), logs[0][-3000:]
    print(f"parameter_server {mode}, rank {victim} killed: the others exited in {elapsed:.1f} s")
