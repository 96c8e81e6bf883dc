"""One rank of the communication-layer test: runs every collective on known inputs, checks the
results against values computed locally, and saves the recorded bytes per collective next to the
payloads this rank really handed to the backend (elements and bytes per element of the buffers
given to ``torch.distributed`` or to mpi4py), so the test can check the charges independently.

Usage: ``comm_worker.py SPEC_JSON OUT_DIR`` with SPEC ``{"backend": "gloo" | "mpi", "numels": [...]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rank_env import connect, finish

HANDED: list[tuple[str, int, int]] = []  # (backend call, elements, bytes per element) as handed over


def spy_on_torch_distributed() -> None:
    """Record the first tensor argument of every torch.distributed collective the package calls."""
    for name in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all_single", "broadcast"):
        real = getattr(dist, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            # reduce_scatter(out, inputs) and all_gather(outputs, input) carry the payload second
            payload = args[1] if _name in ("reduce_scatter", "all_gather") else args[0]
            if _name == "all_to_all_single":
                payload = args[1]
            if isinstance(payload, list):
                payload = torch.cat([t.reshape(-1) for t in payload]) if _name == "reduce_scatter" else payload[0]
            HANDED.append((_name, payload.numel(), payload.element_size()))
            return _real(*args, **kwargs)

        setattr(dist, name, spy)


class MPISpy:
    """Stands in for the mpi4py communicator: records the send buffer of each call, then forwards."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        real = getattr(self.inner, name)
        if name not in ("Allreduce", "Reduce_scatter_block", "Allgather", "Alltoallv", "Bcast"):
            return real

        def spy(*args, **kwargs):
            buf = args[1] if name == "Allreduce" else args[0]  # Allreduce(IN_PLACE, buf)
            arr = np.asarray(buf[0] if isinstance(buf, list) else buf)
            HANDED.append((name, arr.size, arr.itemsize))
            return real(*args, **kwargs)

        return spy


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    comm = connect(spec["backend"])
    if spec["backend"] == "mpi":
        comm.comm = MPISpy(comm.comm)
    else:
        spy_on_torch_distributed()
    rank, world = comm.rank, comm.world_size
    recorded: dict[str, int] = {}
    handed: dict[str, list[tuple[str, int, int]]] = {}

    def charge(name: str, fn):
        before, first = comm.stats.bytes_sent, len(HANDED)
        result = fn()
        recorded[name] = comm.stats.bytes_sent - before
        handed[name] = HANDED[first:]
        return result

    for k in spec["numels"]:
        t = torch.arange(k, dtype=torch.float32) + rank
        charge(f"all_reduce_{k}", lambda t=t: comm.all_reduce(t, "sum"))
        expected = (torch.arange(k, dtype=torch.float32) * world) + sum(range(world))
        torch.testing.assert_close(t, expected)

    t = torch.full((3,), float(rank))
    charge("all_reduce_avg", lambda: comm.all_reduce(t, "avg"))
    torch.testing.assert_close(t, torch.full((3,), (world - 1) / 2))

    t = torch.full((2,), float(rank))
    charge("all_reduce_max", lambda: comm.all_reduce(t, "max"))
    torch.testing.assert_close(t, torch.full((2,), float(world - 1)))

    # reduce-scatter: rank r gets chunk r of the sum
    t = torch.arange(4 * world, dtype=torch.float32) * (rank + 1)
    chunk = charge("reduce_scatter", lambda: comm.reduce_scatter(t, "sum"))
    total = torch.arange(4 * world, dtype=torch.float32) * sum(range(1, world + 1))
    torch.testing.assert_close(chunk, total[4 * rank : 4 * rank + 4])

    # all-gather of equal shapes
    t = torch.full((2, 3), float(rank))
    g = charge("all_gather", lambda: comm.all_gather(t))
    torch.testing.assert_close(g, torch.stack([torch.full((2, 3), float(r)) for r in range(world)]))

    # uneven all-gather: rank r contributes r+1 rows
    t = torch.full((rank + 1, 2), float(rank), dtype=torch.int64)
    parts = charge("all_gather_uneven", lambda: comm.all_gather_uneven(t))
    for r, p in enumerate(parts):
        assert torch.equal(p, torch.full((r + 1, 2), r, dtype=torch.int64))

    # all-to-all with uneven splits (including zero): rank r sends (r + j) % 3 rows to rank j,
    # each row [r, j, i] with width 3; uint8 payload as the quantizers send it.
    send_splits = [(rank + j) % 3 for j in range(world)]
    rows = [torch.tensor([rank, j, i], dtype=torch.uint8) for j in range(world) for i in range(send_splits[j])]
    x = torch.stack(rows) if rows else torch.empty(0, 3, dtype=torch.uint8)
    y = charge("all_to_all", lambda: comm.all_to_all(x, send_splits))
    expected_rows = [torch.tensor([s, rank, i], dtype=torch.uint8) for s in range(world) for i in range((s + rank) % 3)]
    assert torch.equal(y, torch.stack(expected_rows) if expected_rows else torch.empty(0, 3, dtype=torch.uint8))
    recorded["all_to_all_rows_sent"] = sum(send_splits) - send_splits[rank]

    # broadcast from the last rank
    t = torch.full((5,), float(rank))
    charge("broadcast", lambda: comm.broadcast(t, src=world - 1))
    torch.testing.assert_close(t, torch.full((5,), float(world - 1)))

    obj = charge("broadcast_object", lambda: comm.broadcast_object({"from": rank, "x": [1, 2]} if rank == 0 else None))
    assert obj == {"from": 0, "x": [1, 2]}
    objs = comm.all_gather_object(("rank", rank))
    assert objs == [("rank", r) for r in range(world)]

    # bf16 and uint8 travel too
    t = torch.full((4,), 1.5, dtype=torch.bfloat16)
    charge("all_reduce_bf16", lambda: comm.all_reduce(t, "sum"))
    torch.testing.assert_close(t.float(), torch.full((4,), 1.5 * world))
    t = torch.full((6 * world,), 0.5, dtype=torch.bfloat16)
    chunk = charge("reduce_scatter_bf16", lambda: comm.reduce_scatter(t, "sum"))
    torch.testing.assert_close(chunk.float(), torch.full((6,), 0.5 * world))
    comm.barrier()
    torch.save(
        {
            "recorded": recorded,
            "handed": handed,
            "calls": comm.stats.calls,
            "by_tag": comm.stats.by_tag,
            "comm": repr(comm),
        },
        out / f"rank{rank}.pt",
    )
    if spec["backend"] != "mpi":
        finish(comm)


if __name__ == "__main__":
    main()
