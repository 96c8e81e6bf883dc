"""One rank of the two-level all-reduce test: averages seeded buffers in two levels and flat, and
keeps both with the bytes each level charged.

Usage: ``two_level_worker.py SPEC_JSON OUT_DIR`` with SPEC ``{"group_size": g, "sizes": [...],
"slow_bits": b, "steps": T}``: for each size, ``T`` calls on the same buffer (the error-feedback test
sums them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from rank_env import connect, finish

from lightning_commstrats.buckets import BucketKey
from lightning_commstrats.compression.hierarchical import TwoLevelAllReduce


def buffer(rank: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + size)
    return torch.randn(size, generator=g) * (1 + rank)


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    comm = connect()
    two = TwoLevelAllReduce(comm, spec["group_size"], spec.get("slow_bits", 32))
    result = {"rank": comm.rank, "sizes": {}}
    for size in spec["sizes"]:
        mine = buffer(comm.rank, size)
        flat = comm.all_reduce(mine.clone(), "avg", tag="flat")
        before = comm.stats.snapshot().as_dict()
        outs = [two(mine.clone(), "two", BucketKey("two", (f"b{size}",))) for _ in range(spec.get("steps", 1))]
        after = comm.stats.snapshot().as_dict()
        charged = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.endswith("bytes_sent")}
        result["sizes"][size] = {"flat": flat, "outs": outs, "charged": charged}
    result["state"] = two.state_dict()
    finish(comm)
    torch.save(result, out / f"rank{comm.rank}.pt")


if __name__ == "__main__":
    main()
