"""CUDA in one process (one GPU): device timing that never makes a collective wait, and fused
buffers that stay on the GPU from step to step (and are remade for another stream)."""

from __future__ import annotations

import pytest
import torch

from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression import BucketedAllReduce

pytestmark = pytest.mark.cuda


class SlowPeer(Communicator):
    """Rank 0 of 2 whose "all-reduce" runs a kernel of ``cycles`` GPU cycles and adds 1 (the peer)."""

    def __init__(self, cycles: int = 0) -> None:
        super().__init__(rank=0, world_size=2)
        self.cycles = cycles
        self.storages: list[int] = []

    def _all_reduce(self, tensor, op):
        self.storages.append(tensor.data_ptr())
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        tensor.add_(1.0)

    def _reduce_scatter(self, out, tensor, op):
        raise AssertionError("not used")

    _all_gather = _all_to_all = _broadcast = _reduce_scatter

    def _barrier(self):
        pass


def test_device_seconds_are_measured_without_waiting_and_read_when_asked():
    comm = SlowPeer()
    t = torch.zeros(1024, device="cuda")
    # one warm-up call: CUDA loads a kernel's module at its first launch (lazy loading), and loading
    # one while another kernel runs waits for the device (seen on an H200: 0.26 s booked at the mark)
    comm.all_reduce(t, "sum", tag="grad")
    torch.cuda.synchronize()
    comm.stats.mark_step()
    comm.cycles = 500_000_000  # a fraction of a second of GPU time
    comm.all_reduce(t, "sum", tag="grad")
    step = comm.stats.mark_step()  # the host is far ahead of the device: nothing was waited for
    assert (step.calls, step.bytes_sent, step.comm_seconds) == (1, 2 * 512 * 4, 0.0)
    seconds = comm.stats.comm_seconds  # reading waits for the device
    assert seconds > 0.05 and comm.stats.by_tag["grad"].comm_seconds == seconds
    print(f"one slow collective: booked {seconds * 1e3:.1f} ms of device time once read")


def test_fused_buffers_stay_on_the_gpu_across_steps_and_are_remade_for_another_stream():
    comm = SlowPeer()
    fused = BucketedAllReduce(comm, cap_bytes=4096)
    tensors = [torch.randn(n, device="cuda") for n in (700, 300, 2000, 5)]
    kept = None
    for _ in range(3):
        expected = [(t + 1.0) / 2 for t in tensors]
        fused(tensors, tag="grad")
        for t, e in zip(tensors, expected, strict=True):
            assert torch.equal(t, e)
        kept = kept or fused.buffers("grad")
        assert fused.buffers("grad") is kept and all(f.is_cuda for f in kept.flats)
    n = len(kept.flats)
    assert comm.storages[-n:] == comm.storages[:n] == [f.data_ptr() for f in kept.flats]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        expected = [(t + 1.0) / 2 for t in tensors]
        fused(tensors, tag="grad")
    torch.cuda.current_stream().wait_stream(side)
    assert fused.buffers("grad") is not kept  # never written from one stream while another reads it
    for t, e in zip(tensors, expected, strict=True):
        assert torch.equal(t, e)
