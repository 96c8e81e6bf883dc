"""One rank of the CUDA communication tests (started by ``tests/harness.py``): every check runs here,
on this rank's GPU, and a failed one fails the rank.

Usage: ``cuda_worker.py SPEC_JSON OUT_DIR`` with SPEC ``{"backend": "nccl" | "gloo"}``. Rank ``r``
computes on ``cuda:(r mod GPUs)``: NCCL needs a GPU per rank, gloo ranks may share one. With one
rank the package's collectives are local no-ops, so the NCCL backend hooks are driven directly.
Saves ``OUT_DIR/rank<r>.pt`` with the figures the test reports.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from lightning_commstrats.comm import (
    TorchCommunicator,
    create_communicator,
    destroy_process_group,
    init_process_group,
    wire,
)
from lightning_commstrats.compression import BucketedAllReduce

SYNCS: list[str] = []  # host synchronisations with a device, as they happen


def spy_on_synchronisation() -> None:
    """Record every call of the Python-level CUDA synchronisations."""
    for owner, name, label in [
        (torch.cuda, "synchronize", "torch.cuda.synchronize"),
        (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
        (torch.cuda.Event, "synchronize", "Event.synchronize"),
    ]:
        real = getattr(owner, name)

        def spy(*args: Any, _real: Any = real, _label: str = label, **kwargs: Any) -> Any:
            SYNCS.append(_label)
            return _real(*args, **kwargs)

        setattr(owner, name, spy)


def timed_all_reduces(
    comm: TorchCommunicator, device: torch.device, tag: str, calls: int, background: bool = False
) -> dict[str, Any]:
    """``calls`` all-reduces of 4 MiB on ``device``; the synchronisations they made; their figures.
    ``background``: issued from another thread than the training loop's, their seconds are
    background seconds, not waiting."""
    t = torch.full((1 << 20,), float(comm.rank), device=device)
    before = len(SYNCS)
    for _ in range(calls):
        comm.all_reduce(t, "avg", tag=tag)
    during = SYNCS[before:]
    mean = sum(range(comm.world_size)) / comm.world_size
    assert torch.equal(t, torch.full_like(t, mean)), t[:4]
    counters = comm.stats.by_tag[tag]  # reading waits for the device: the seconds are in
    assert counters.calls == calls
    assert counters.bytes_sent == calls * wire.all_reduce_bytes(1 << 20, 4, comm.world_size)
    assert during == [], f"the collectives synchronised with the device: {during}"
    waited, beside = (
        (counters.background_seconds, counters.comm_seconds)
        if background
        else (
            counters.comm_seconds,
            counters.background_seconds,
        )
    )
    assert waited > 0 and beside == 0, counters
    return {"calls": counters.calls, "bytes": counters.bytes_sent, "seconds": waited}


def collectives(comm: TorchCommunicator, device: torch.device) -> dict[str, Any]:
    rank, world = comm.rank, comm.world_size
    assert comm.device == (device if comm.backend == "nccl" else torch.device("cpu")), comm.device

    # object collectives: their tensors on the GPU for NCCL (it refuses CPU tensors), on the CPU for gloo
    obj = comm.broadcast_object({"from": rank, "x": [1, 2]} if rank == 0 else None)
    assert obj == {"from": 0, "x": [1, 2]}, obj
    assert comm.all_gather_object(("rank", rank)) == [("rank", r) for r in range(world)]

    # CPU tensors handed to the communicator (a metric Lightning reduces) come back on the CPU, right
    metric = torch.full((3,), float(rank))
    comm.all_reduce(metric, "sum", tag="metrics")
    assert metric.device.type == "cpu" and torch.equal(metric, torch.full((3,), float(sum(range(world)))))
    ranks = comm.all_gather(torch.tensor([rank]), tag="metrics")
    assert ranks.device.type == "cpu" and ranks.flatten().tolist() == list(range(world))
    comm.barrier()

    result: dict[str, Any] = {"device": str(comm.device), "backend": comm.backend}
    result["timed"] = timed_all_reduces(comm, device, "timed", 20)

    # the fused all-reduce: the same buffers on the GPU step after step, the right averages
    fused = BucketedAllReduce(comm, cap_bytes=4096)  # several buckets
    tensors = [torch.empty(n, device=device) for n in (700, 300, 2000, 5)]
    kept = None
    for step in range(3):
        for t in tensors:
            t.fill_(float(rank + step))
        fused(tensors, tag="grad")
        mean = sum(r + step for r in range(world)) / world
        assert all(torch.equal(t, torch.full_like(t, mean)) for t in tensors)
        kept = kept or fused.buffers("grad")
        assert fused.buffers("grad") is kept and all(f.device == device for f in kept.flats)
    result["buffers"] = [f.data_ptr() for f in kept.flats]

    # a background thread on a second channel (as streaming DiLoCo runs its exchanges): its
    # current CUDA device is cuda:0 whatever this rank's is; its collectives are booked all the same
    second = comm.duplicate()
    failures: list[BaseException] = []

    def background() -> None:
        try:
            result["background"] = timed_all_reduces(second, device, "background", 5, background=True)
        except BaseException as err:  # reported by the main thread
            failures.append(err)

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]
    return result


def one_rank(comm: TorchCommunicator, device: torch.device) -> dict[str, Any]:
    """A one-rank NCCL group: the backend hooks the collectives call, driven directly."""
    assert comm.backend == "nccl" and comm.device == device, (comm.backend, comm.device)
    metric = torch.arange(4.0)  # NCCL refuses CPU tensors: this one goes through a copy on the GPU
    comm._all_reduce(metric, "sum")
    assert metric.device.type == "cpu" and torch.equal(metric, torch.arange(4.0))
    out = torch.zeros(1, 4)
    comm._all_gather(out, metric)
    assert torch.equal(out[0], metric)
    t = torch.ones(1 << 20, device=device)
    before = len(SYNCS)
    for _ in range(10):
        comm._timed("timed", 0, t, lambda: comm._all_reduce(t, "sum"))
    during = SYNCS[before:]
    seconds = comm.stats.by_tag["timed"].comm_seconds
    assert during == [] and seconds > 0, (during, seconds)
    return {"device": str(comm.device), "backend": comm.backend, "timed": {"calls": 10, "seconds": seconds}}


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    spy_on_synchronisation()
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if world == 1:
        init_process_group(
            spec["backend"],
            rank=0,
            world_size=1,
            main_address=address,
            main_port=port,
            device=device,
            timeout=timedelta(minutes=2),
        )
        result = one_rank(TorchCommunicator(device=device), device)
    else:
        comm = create_communicator(
            spec["backend"], rank=rank, world_size=world, device=device, main_address=address, main_port=port
        )
        assert isinstance(comm, TorchCommunicator)
        result = collectives(comm, device)
        comm.barrier()
    torch.save(result, out / f"rank{rank}.pt")
    destroy_process_group()


if __name__ == "__main__":
    main()
