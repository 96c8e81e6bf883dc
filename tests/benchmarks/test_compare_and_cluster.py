"""The benchmark harness: the `--quick` smoke run (loopback), and the emulated cluster's cleanup."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from cluster import ClusterUnavailable, check_available, namespaces  # noqa: E402


def _cluster_available() -> str | None:
    try:
        check_available()
    except ClusterUnavailable as err:
        return str(err)
    return None


@pytest.mark.multiprocess
def test_quick_comparison_on_loopback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "compare.py"),
            "--quick",
            "--loopback",
            "--out",
            str(tmp_path),
            "--only",
            "ddp",
            "allreduce",
            "onebit_sgd",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["where"].startswith("loopback")
    rows = {r["label"]: r for r in results["rows"]}
    assert set(rows) == {"ddp", "allreduce", "onebit_sgd"}
    for r in rows.values():
        assert r["steps"] == 6 and r["median_step_s"] > 0 and r["final_ppl"] > 1
    # 2 of the 6 steps are the warm start in fp32; the other 4 send about 1/30 of that
    assert rows["onebit_sgd"]["comm_stats_bytes_per_step"] < 0.5 * rows["allreduce"]["comm_stats_bytes_per_step"]
    table = (tmp_path / "results.md").read_text()
    assert "loopback (no rate limit)" in table and "| onebit_sgd | ours |" in table


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_cluster_leaves_nothing_behind(sig):
    reason = _cluster_available()
    if reason:
        pytest.skip(f"emulated cluster unavailable here: {reason}")
    prefix = f"cst{os.getpid() % 1000}"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "benchmarks" / "cluster.py"),
            "--prefix",
            prefix,
            "hold",
            "--hosts",
            "3",
            "--seconds",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready:"), line + proc.stdout.read()
        assert len(namespaces(prefix)) == 3 + 1  # three hosts and a switch
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert namespaces(prefix) == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert prefix not in links
