"""Runs fault-tolerant periodic trainings: a Lighthouse and replicas in separate processes that a
test can kill (SIGKILL, as a failing machine) and start again, and their results.

Every replica is its own Lightning job (``tests/multiprocess/ft_worker.py``, one CPU device) and
saves ``<out>/<replica_id>.pt``. Nothing outlives the run: :meth:`FTRun.close` kills what is left
and removes the run's folder.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import _base_env, _kill

WORKER = Path(__file__).parent / "multiprocess" / "ft_worker.py"


class FTRun:
    """A Lighthouse (``commstrats-lighthouse``, torchft's) and the replicas of one run."""

    def __init__(self, min_replicas: int = 1, join_timeout_ms: int = 5000, heartbeat_timeout_ms: int = 5000) -> None:
        self.out = Path(tempfile.mkdtemp(prefix="commstrats-ft-"))
        self.env = _base_env()
        self.env.pop("TORCHFT_LIGHTHOUSE", None)
        self.replicas: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        self._logs: list[Any] = []
        log = open(self.out / "lighthouse.log", "w+")
        self._logs.append(log)
        self.lighthouse_proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from lightning_commstrats.fault_tolerance import lighthouse_main; lighthouse_main()",
                "--port",
                "0",
                "--min-replicas",
                str(min_replicas),
                "--join-timeout-ms",
                str(join_timeout_ms),
                "--heartbeat-timeout-ms",
                str(heartbeat_timeout_ms),
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        self.lighthouse = ""
        while not self.lighthouse:
            text = (self.out / "lighthouse.log").read_text()
            found = re.search(r"listening at (http://\S+)", text)
            if found:
                # the host name torchft prints may not resolve in a sandbox: the loopback address does
                self.lighthouse = "http://127.0.0.1:" + found.group(1).rsplit(":", 1)[1]
                self.env["TORCHFT_LIGHTHOUSE"] = self.lighthouse
            elif self.lighthouse_proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the Lighthouse did not start:\n{text}")
            else:
                time.sleep(0.1)

    def start(self, replica_id: str, spec: dict[str, Any], command: list[str] | None = None) -> None:
        """Start (or start again) replica ``replica_id`` with ``spec`` (see ft_worker.py), or run
        ``command`` as the replica (with ``TORCHFT_LIGHTHOUSE`` set to this run's Lighthouse)."""
        self.starts[replica_id] = self.starts.get(replica_id, 0) + 1
        full = {"lighthouse": self.lighthouse, "replica_id": replica_id, **spec}
        log = open(self.out / f"{replica_id}.{self.starts[replica_id]}.log", "w+")
        self._logs.append(log)
        self.replicas[replica_id] = subprocess.Popen(
            command or [sys.executable, str(WORKER), json.dumps(full), str(self.out)],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_dead(self, replica_id: str, timeout: float = 120.0) -> int:
        """Wait until the replica's process has ended; returns its exit status."""
        proc = self.replicas[replica_id]
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"replica {replica_id} still running after {timeout:.0f}s:\n{self.tails()}") from None

    def wait(self, timeout: float = 300.0, results: bool = True) -> dict[str, dict[str, Any]]:
        """Wait for every replica; raise with their logs if one failed; return the results by replica
        (``results=False``: replicas that save none)."""
        deadline = time.monotonic() + timeout
        for rid, proc in self.replicas.items():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"replica {rid} still running after {timeout:.0f}s:\n{self.tails()}") from None
            if proc.returncode != 0:
                raise RuntimeError(f"replica {rid} failed ({proc.returncode}):\n{self.tails()}")
        if not results:
            return {}
        return {rid: torch.load(self.out / f"{rid}.pt", weights_only=False) for rid in self.replicas}

    def tails(self, lines: int = 25) -> str:
        parts = []
        for path in sorted(self.out.glob("*.log")):
            text = [
                line for line in path.read_text(errors="replace").splitlines() if "[INFO]" not in line and line.strip()
            ]
            parts.append(f"--- {path.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    def close(self) -> None:
        for proc in [*self.replicas.values(), self.lighthouse_proc]:
            _kill(proc)
        for log in self._logs:
            log.close()
        shutil.rmtree(self.out, ignore_errors=True)

    def __enter__(self) -> FTRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
