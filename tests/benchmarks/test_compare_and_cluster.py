"""The benchmark harness: the `--quick` smoke run (loopback), and the emulated cluster's cleanup."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import compare  # noqa: E402
from cluster import ClusterUnavailable, check_available, namespaces  # noqa: E402


def _cluster_available() -> str | None:
    try:
        check_available()
    except ClusterUnavailable as err:
        return str(err)
    return None


def _race(out, *args):
    """``compare.py --quick`` (loopback, tiny config, 2 ranks, seed 0) with ``args``; its results."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compare.py"), "--quick", "--seeds", "0", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads((out / "loopback" / "results.json").read_text())
    assert results["where"].startswith("loopback")
    return {r["key"]: r for r in results["rows"]}, (out / "loopback" / "results.md").read_text()


@pytest.mark.multiprocess
@pytest.mark.slow  # 19 s; the race's other ending (the budget) stays in the quick suite
def test_race_ends_at_an_easy_target(tmp_path):
    # the tiny model starts near ppl 2000 and passes 300 within about fifty steps
    rows, table = _race(tmp_path, "--only", "ddp", "allreduce", "--target-ppl", "300", "--budget-seconds", "120")
    assert set(rows) == {"ddp", "allreduce"}
    for r in rows.values():
        assert r["stop_reason"] == "target"
        assert r["steps"] < 400 < r["settings"]["max_steps"]
        *before, last = r["curve"]
        assert last["val_ppl"] <= 300 < min(p["val_ppl"] for p in before)
        assert last["step"] == r["steps"] and last["train_seconds"] == pytest.approx(r["train_seconds"])
        assert 0 < r["train_seconds"] < 120 and r["val_seconds"] > 0
        assert r["tx_bytes_per_step"] > 0
        assert compare.time_to_target(r["curve"], 300, 120) == last["train_seconds"]
    assert rows["allreduce"]["comm_stats_bytes_per_step"] > 0 and rows["allreduce"]["comm_share"] > 0
    assert "not reached" not in table
    for section in ("(a) Quality at equal samples", "(b) Quality at equal training time", "(c) Time to target"):
        assert section in table
    assert "- time to target: this package's best, allreduce" in table


@pytest.mark.multiprocess
@pytest.mark.slow  # 26 s; the quick suite runs the race to an easy target
def test_race_ends_at_the_budget_when_the_target_is_out_of_reach(tmp_path):
    # the torch-hook DiLoCo peer and this package's onebit_sgd: the stop decision is broadcast
    # through torch.distributed in one and through the package's communicator in the other
    rows, table = _race(tmp_path, "--only", "diloco_peer", "onebit_sgd", "--target-ppl", "1", "--budget-seconds", "3")
    for r in rows.values():
        assert r["stop_reason"] == "budget"
        assert 3 <= r["train_seconds"] < 5  # stops at the first validation past the budget
        assert r["curve"][-2]["train_seconds"] < 3 <= r["curve"][-1]["train_seconds"]
    assert table.count("| not reached in budget |") == 2
    assert rows["diloco_peer"]["outer_syncs"] == rows["diloco_peer"]["steps"] // 32 >= 1
    assert rows["diloco_peer"]["comm_share"] > 0
    # 1-bit SGD: 16 warm-up steps at the fp32 ring all-reduce (4 bytes a value on 2 ranks), then
    # about 1/30 of it (at most 1/10 here, with the column scales and the full-precision biases)
    onebit = rows["onebit_sgd"]
    fp32_ring = 4 * sum(math.prod(s) for s in onebit["param_shapes"])
    assert onebit["steps"] > 16
    bound = fp32_ring * (16 + (onebit["steps"] - 16) / 10) / onebit["steps"]
    assert 0.9 * fp32_ring * 16 / onebit["steps"] < onebit["comm_stats_bytes_per_step"] < bound


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
