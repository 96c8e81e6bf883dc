"""Runs real multi-rank trainings in separate processes and returns each rank's results.

Ranks are started either the way torchrun does (one process per rank with ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment; Lightning sees them as an
external launch) or under ``mpiexec -n N`` (Lightning's ``MPIEnvironment``). Every rank runs
``tests/multiprocess/worker.py`` on the same JSON spec and saves ``rank<r>.pt``. A run that fails or
outlives its timeout kills every rank and raises with the ranks' output, so a test never hangs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

WORKER = Path(__file__).parent / "multiprocess" / "worker.py"
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpiexec() -> str | None:
    """The ``mpiexec`` beside this interpreter (the mpich wheel's), else one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"  # several ranks share two cores
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a rank stopped by SIGABRT prints every thread's Python stack
    return env


def run_ranks(
    spec: dict[str, Any],
    world_size: int,
    *,
    launcher: str = "env",
    timeout: float = 300.0,
    script: Path = WORKER,
) -> list[dict[str, Any]]:
    """Run ``script`` on ``world_size`` ranks with ``spec``; return the per-rank result dicts in rank order.

    ``MASTER_PORT`` is a port that was free a moment before the ranks start; another process can take
    it in between (the system hands out the same range), and then rank 0 cannot listen on it. Such a
    run is started again on another port, at most twice; any other failure is raised at once."""
    for _ in range(2):
        try:
            return _run_ranks_once(spec, world_size, launcher=launcher, timeout=timeout, script=script)
        except _PortTaken:
            pass
    return _run_ranks_once(spec, world_size, launcher=launcher, timeout=timeout, script=script)


class _PortTaken(RuntimeError):
    """Rank 0 could not listen on ``MASTER_PORT``: another process took it after it was picked."""


def _run_ranks_once(
    spec: dict[str, Any], world_size: int, *, launcher: str, timeout: float, script: Path
) -> list[dict[str, Any]]:
    out = Path(tempfile.mkdtemp(prefix="commstrats-ranks-"))
    args = [sys.executable, str(script), json.dumps(spec), str(out)]
    env = _base_env()
    procs: list[subprocess.Popen] = []
    logs = [open(out / f"log{r}.txt", "w+") for r in range(world_size if launcher == "env" else 1)]
    try:
        if launcher == "env":
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size), NODE_RANK="0")
            for r in range(world_size):
                procs.append(
                    subprocess.Popen(
                        args,
                        env={**env, "LOCAL_RANK": str(r)},
                        stdout=logs[r],
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        elif launcher == "mpiexec":
            exe = mpiexec()
            if exe is None:
                raise RuntimeError("mpiexec not found: install the mpich wheel (`pip install mpich`)")
            procs.append(
                subprocess.Popen(
                    [exe, "-n", str(world_size), *args],
                    env=env,
                    stdout=logs[0],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        else:
            raise ValueError(f"launcher must be 'env' or 'mpiexec', got {launcher!r}")
        try:
            _wait_all(procs, timeout)
        except TimeoutError as err:
            _dump_stacks(procs)
            raise RuntimeError(f"{err}:\n{_tails(logs)}") from err
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            tails = _tails(logs)
            if launcher == "env" and "EADDRINUSE" in tails and f"port: {env['MASTER_PORT']}," in tails:
                raise _PortTaken(f"ranks {failed} failed:\n{tails}")
            raise RuntimeError(f"ranks {failed} failed:\n{tails}")
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    finally:
        for p in procs:
            _kill(p)
        for f in logs:
            f.close()
        shutil.rmtree(out, ignore_errors=True)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            time.sleep(2.0)  # let the other ranks print their side of the failure, then stop them
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks still running after {timeout:.0f}s")
        time.sleep(0.05)


def _dump_stacks(procs: list[subprocess.Popen]) -> None:
    """Ask the ranks still running where they are: SIGABRT, on which Python's fault handler (enabled
    by ``PYTHONFAULTHANDLER``) prints every thread's stack to the rank's log before the process ends."""
    for p in procs:
        _signal_group(p, signal.SIGABRT)
    deadline = time.monotonic() + 5.0
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        _signal_group(p, signal.SIGKILL)
        p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group of ``p`` (its own session) while ``p`` runs."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def _tails(logs: list) -> str:
    parts = []
    for r, f in enumerate(logs):
        f.seek(0)
        parts.append(f"--- log {r} ---\n" + f.read()[-4000:])
    return "\n".join(parts)


def ring_bytes(numel: int, itemsize: int, world: int, passes: int = 2) -> int:
    """What one rank sends in a ring over a buffer of ``numel`` elements, written out for the tests
    (not taken from ``lightning_commstrats.comm.wire``, whose charges they check): ``passes`` rounds
    (2 for an all-reduce: reduce-scatter then all-gather) of ``world - 1`` chunks of
    ``ceil(numel / world)`` elements."""
    if world == 1 or numel == 0:
        return 0
    chunk = -(-numel // world)
    return passes * (world - 1) * chunk * itemsize
