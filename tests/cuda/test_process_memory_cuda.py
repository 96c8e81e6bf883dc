"""The process's peak on a CUDA device (lightning_commstrats/sharding/process_memory.py): the caching
allocator's allocated and reserved peaks, over the run and within phases."""

from __future__ import annotations

import pytest
import torch

from lightning_commstrats.sharding import ProcessMemory, format_process_memory

pytestmark = pytest.mark.cuda
MIB = 2**20


def test_a_phase_sees_the_device_memory_it_freed_and_the_run_keeps_it_after_a_later_phase():
    device = torch.device("cuda", torch.cuda.current_device())
    tracker = ProcessMemory(device)
    base = torch.cuda.memory_allocated(device)
    with tracker.phase("training"):
        x = torch.ones(256 * MIB // 4, device=device)
        del x
    with tracker.phase("sync"):
        y = torch.ones(4 * MIB // 4, device=device)
        del y
    stats = tracker.stats()
    allocated, reserved = stats["allocated"], stats["reserved"]
    assert allocated["device"] == str(device) and stats["rss"]["device"] == "cpu"
    assert allocated["phases"]["training"] >= base + 256 * MIB
    assert allocated["phases"]["sync"] < base + 64 * MIB, "the sync's peak is not its own"
    assert allocated["peak"] >= base + 256 * MIB, "the run's peak lost the training phase's"
    assert reserved["peak"] >= allocated["peak"] and reserved["phases"]["training"] >= base + 256 * MIB
    line = format_process_memory(stats)
    assert f"{device} peak allocated" in line and "(training " in line
