"""Memory as the operating system counts it: the process's peak over the run and within phases, and the
glibc setting that hands freed memory back (lightning_commstrats/sharding/process_memory.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_commstrats import AllReduceStrategy, CommStatsMonitor
from lightning_commstrats.sharding import (
    ProcessMemory,
    fix_mmap_threshold,
    format_memory,
    format_process_memory,
    format_ranks_peaks,
)
from lightning_commstrats.sharding import process_memory as pm

MIB = 2**20
linux_only = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")


def rss_now() -> int:
    status = pm._status()
    assert status is not None
    return status["VmRSS"]


def touch_and_free(nbytes: int) -> None:
    x = torch.ones(nbytes // 4)  # written: every page resident
    del x


@linux_only
def test_a_phase_sees_what_it_freed_and_the_run_keeps_it_after_a_later_phase():
    tracker = ProcessMemory(phases="reset")
    if tracker.phase_note is not None or pm._reset_kernel_peak() is not None:
        pytest.skip(f"the kernel's peak cannot be reset here: {tracker.phase_note}")
    base = rss_now()
    with tracker.phase("training"):
        touch_and_free(64 * MIB)
    with tracker.phase("sync"):
        touch_and_free(4 * MIB)
    stats = tracker.stats()["rss"]
    assert stats["phases"]["training"] >= base + 60 * MIB, "the phase lost the 64 MiB it held and freed"
    # the sync's peak is its own: the kernel's peak was reset when it began
    assert stats["phases"]["sync"] < base + 32 * MIB, f"sync's peak {stats['phases']['sync'] - base} above base"
    assert stats["peak"] >= base + 60 * MIB, "the run's peak lost the training phase's after the sync reset it"
    assert stats["now"] < base + 32 * MIB and stats["start"] is not None and stats["device"] == "cpu"
    assert tracker.open_phases == []


@linux_only
def test_an_outer_phase_keeps_the_peak_of_an_inner_one_and_a_phase_entered_again_its_largest():
    tracker = ProcessMemory(phases="reset")
    if tracker.phase_note is not None or pm._reset_kernel_peak() is not None:
        pytest.skip(f"the kernel's peak cannot be reset here: {tracker.phase_note}")
    base = rss_now()
    tracker.begin("training")
    with tracker.phase("sync"):
        touch_and_free(48 * MIB)
        with tracker.phase("send"):  # resets the kernel's peak again: training must have seen it before
            pass
    with tracker.phase("sync"):  # a later, smaller sync does not lower the sync's peak
        touch_and_free(4 * MIB)
    open_now = tracker.stats()["rss"]["phases"]  # an open phase reports its peak so far
    tracker.end("training")
    phases = tracker.stats()["rss"]["phases"]
    assert phases["sync"] >= base + 44 * MIB
    assert phases["training"] >= base + 44 * MIB, "training lost the peak of the sync inside it"
    assert open_now["training"] >= base + 44 * MIB
    with pytest.raises(ValueError, match="'sync' is not the innermost open phase"):
        tracker.end("sync")
    tracker.begin("training")
    with pytest.raises(ValueError, match="'training' is already open"):
        tracker.begin("training")
    tracker.close()
    assert tracker.open_phases == []


@linux_only
def test_without_clear_refs_the_run_peak_stays_and_the_phases_say_why(monkeypatch, tmp_path):
    monkeypatch.setattr(pm, "_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    tracker = ProcessMemory(phases="reset")
    base = rss_now()
    with tracker.phase("training"):
        touch_and_free(64 * MIB)
    stats = tracker.stats()["rss"]
    assert stats["phases"] == {"training": None}
    assert "cannot be reset" in stats["note"] and "clear_refs" in stats["note"]
    assert stats["peak"] >= base + 60 * MIB
    line = format_process_memory(tracker.stats())
    assert line.startswith("peak RSS ") and "(phases not measured: the kernel's peak cannot be reset" in line


def test_the_memory_line_shows_the_process_figures_beside_the_tensors():
    report = {"parameters": {"cpu": 3 * MIB}, "gradients": {}, "optimizer": {"cpu": MIB}, "scheme": {}}
    plain = "parameters 3.0, gradients 0.0, optimizer 1.0, scheme 0.0 MiB on cpu"
    assert format_memory(report) == plain  # as before without the process's figures
    process = {
        "rss": {
            "device": "cpu",
            "start": 300 * MIB,
            "now": 400 * MIB,
            "peak": int(1.2 * 2**30),
            "phases": {"training": int(1.1 * 2**30), "sync": 900 * MIB},
        },
        "allocated": {"device": "cuda:0", "start": 0, "now": 0, "peak": 3 * 2**30, "phases": {"sync": 2**30}},
        "reserved": {"device": "cuda:0", "start": 0, "now": 0, "peak": 4 * 2**30, "phases": {}},
    }
    assert format_memory(report, process) == (
        plain + " | peak RSS 1.20 GiB (training 1.10 GiB, sync 900.0 MiB); cuda:0 peak allocated 3.00 GiB"
        " (sync 1.00 GiB); cuda:0 peak reserved 4.00 GiB"
    )


class Tracked(AllReduceStrategy):
    """The package's wiring (strategies/base.py: a tracker per fit, the ``training`` phase from the
    start of training to its end, the ``sync`` phase around each step's exchange), with an exchange
    that takes 40 MiB and gives it back."""

    def after_backward(self, optimizer: Any) -> None:
        super().after_backward(optimizer)
        touch_and_free(40 * MIB)  # what an exchange's buffers would take, then give back


@linux_only
def test_the_memory_line_and_the_saved_figures_hold_the_process_peaks(tmp_path, caplog):
    monitor = CommStatsMonitor(save_dir=str(tmp_path))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        strategy=Tracked(),
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(BoringModel())
    line = next(line for line in caplog.text.splitlines() if "[memory] rank 0: " in line)
    assert " MiB on cpu | peak RSS " in line and "(training " in line and ", sync " in line
    saved = json.loads((tmp_path / "comm_stats.rank0.json").read_text())["process_memory"]["rss"]
    assert set(saved) >= {"device", "start", "now", "peak", "phases"} and saved["peak"] >= saved["phases"]["training"]
    if "note" not in saved:  # the phases measured: the sync's 40 MiB is in both
        assert saved["phases"]["training"] >= saved["phases"]["sync"] >= saved["start"] + 36 * MIB
    assert trainer.strategy.process_memory.open_phases == []


def test_fix_mmap_threshold_refuses_a_bad_threshold_and_does_nothing_without_glibc(monkeypatch):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threshold must be a positive number of bytes"):
            fix_mmap_threshold(bad)

    def no_glibc(name: str) -> str:
        raise ValueError(name)

    monkeypatch.setattr(pm.os, "confstr", no_glibc)
    applied, why = fix_mmap_threshold()
    assert not applied and "unknown" in why and pm.host_allocator() == "unknown"


@linux_only
def test_host_allocator_asks_the_linker_and_the_threshold_is_left_alone_under_another_malloc(monkeypatch):
    if not _glibc():
        pytest.skip("not glibc")
    assert pm.host_allocator() == "glibc"  # this test process: glibc's malloc (nothing preloaded here)
    called = []
    monkeypatch.setattr(pm.ctypes, "CDLL", lambda *a: called.append(a))
    for name, library in (
        ("jemalloc", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
        ("tcmalloc", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10"),
        ("unknown", "/opt/python/bin/python3.11"),  # an allocator linked into the executable
    ):
        monkeypatch.setattr(pm, "_malloc_library", lambda library=library: library)
        assert pm.host_allocator() == name
        applied, why = fix_mmap_threshold()
        assert not applied and f"malloc is not glibc's ({name})" in why
    assert called == []  # glibc's mallopt never called: it would set an allocator that is not in use


# A fresh process frees one 16 MiB block (glibc then raises its mmap threshold to 16 MiB), fills 256 MiB
# with 1 MiB tensors and frees all but the last (which pins the heap's top): how much stays resident. A
# process of its own for each setting: blocks already free in a heap are reused before any new mapping,
# and stay in the heap when freed again, whatever the threshold.
KEEPS = """
import importlib.util, sys, torch
# the module alone (it needs only torch): importing the package would start Lightning, seconds here
spec = importlib.util.spec_from_file_location("process_memory", sys.argv[2])
pm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pm)
def rss(): return pm._status()["VmRSS"]
big = torch.ones(4 * 2**20); del big
if sys.argv[1] == "fixed":
    applied, why = pm.fix_mmap_threshold()
    assert applied, why
base = rss()
held = [torch.ones(2**18) for _ in range(256)]
last = held[-1]
del held
print(rss() - base)
"""


@linux_only
def test_with_the_mmap_threshold_fixed_freed_tensors_go_back_to_the_system():
    if not _glibc():
        pytest.skip("not glibc")
    procs = {
        setting: subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(KEEPS), setting, pm.__file__],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for setting in ("default", "fixed")
    }
    kept = {}
    for setting, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        kept[setting] = int(out.split()[-1])
    # glibc's defaults keep the freed 1 MiB blocks in the heap (the test sees the difference) ...
    assert kept["default"] > 200 * MIB, f"glibc's defaults handed back all but {kept['default'] / MIB:.0f} MiB"
    # ... and with the threshold fixed they go back
    assert kept["fixed"] < 32 * MIB, f"{kept['fixed'] / MIB:.0f} MiB stayed resident with the threshold fixed"


def _glibc() -> bool:
    try:
        return pm.os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


def kernel_peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@linux_only
def test_only_phases_reset_touch_the_kernels_peak_other_readers_see():
    # /usr/bin/time, ru_maxrss and profilers read VmHWM: the default (sampled) and False leave it alone
    for phases in (True, False, "reset"):
        tracker = ProcessMemory(phases=phases)
        touch_and_free(64 * MIB)
        high = kernel_peak()
        with tracker.phase("sync"):
            pass
        kept = kernel_peak()
        if phases == "reset":
            assert kept < high - 32 * MIB or tracker.phase_note is not None  # reset: the 64 MiB is gone
        else:
            assert kept >= high, f"phases={phases!r} lowered the kernel's peak from {high} to {kept}"
        if phases is False:
            assert tracker.stats()["rss"]["phases"]["sync"] is None
            assert "never reset" in tracker.stats()["rss"]["note"]
        assert tracker.stats()["rss"]["peak"] >= high  # the tracker keeps the run's peak either way
    for bad in ("no", 1, "sample"):
        with pytest.raises(ValueError, match=r"memory_phases must be True .*'reset'.* or False"):
            AllReduceStrategy(memory_phases=bad)


@linux_only
def test_a_sampled_phase_that_sets_a_new_high_has_it_exactly_and_one_below_gets_its_own_samples():
    tracker = ProcessMemory()  # the default: sampled
    touch_and_free(96 * MIB)  # an earlier high, above anything below
    high = kernel_peak()
    base = rss_now()
    with tracker.phase("training"):
        with tracker.phase("sync"):
            x = torch.ones(48 * MIB // 4)  # held below the earlier high for 50 intervals: the sampler sees it
            pm.threading.Event().wait(50 * tracker.interval)
            del x
        with tracker.phase("idle"):
            pass
    stats = tracker.stats()["rss"]
    phases = stats["phases"]
    assert stats["method"] == "sampled" and kernel_peak() >= high
    assert base + 44 * MIB <= phases["sync"] < high, f"sync {(phases['sync'] - base) / MIB:.1f} MiB over base"
    assert phases["training"] >= phases["sync"], "training lost the peak of the sync inside it"
    assert phases["idle"] < base + 24 * MIB, "a phase took the process's earlier high for its own"
    assert "sampled" in format_process_memory(tracker.stats())
    # above every earlier high: the kernel's new peak, exactly, even for a block held less than an interval
    tracker = ProcessMemory(interval=3600.0)  # the sampler never reads: only the boundaries and the kernel
    with tracker.phase("sync"):
        sampler = tracker._sampler[0]
        touch_and_free(high - rss_now() + 64 * MIB)
    assert tracker.stats()["rss"]["phases"]["sync"] >= high + 60 * MIB
    assert tracker._sampler is None and not sampler.is_alive()  # no thread outlives its phases


def test_the_ranks_line_names_the_largest_and_the_smallest_peak_of_each_counter():
    def stats(rss: int, allocated: int | None = None) -> dict:
        out = {"rss": {"peak": rss}}
        if allocated is not None:
            out["allocated"] = {"peak": allocated, "device": "cuda:0"}
        return out

    line = format_ranks_peaks(
        [stats(300 * MIB, 5 * 2**30), stats(2**30 + 2**29, 4 * 2**30), stats(100 * MIB, 6 * 2**30)]
    )
    assert line == (
        "peak RSS over 3 ranks: largest 1.50 GiB (rank 1), smallest 100.0 MiB (rank 2);"
        " peak allocated over 3 ranks: largest 6.00 GiB (rank 2), smallest 4.00 GiB (rank 1)"
    )


class _Raises(BoringModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("a step that fails")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_raised_leaves_no_sampler_running():
    strategy = AllReduceStrategy()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, strategy=strategy, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="a step that fails"):
        trainer.fit(_Raises())
    assert strategy.process_memory._sampler is None and strategy.process_memory.open_phases == []
