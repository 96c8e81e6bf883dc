"""One rank of the two-stage quantized all-reduce test: aggregates seeded gradients for a few
steps and checks every step, bit for bit, against a reference that simulates all ranks locally.

Usage: ``quant_worker.py SPEC_JSON OUT_DIR`` with SPEC ``{"bits": b, "codec": "uniform" | "e3m0", "shapes": [...],
"steps": T}`` (``codec`` optional, uniform by default).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from rank_env import connect, finish

from lightning_commstrats.compression import ColumnCodec, E3M0Codec, QuantizedAllReduce, make_codec


def grads_of(rank: int, step: int, shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"p{i}": torch.randn(*s, generator=g) * (i + 1) for i, s in enumerate(shapes)}


class Reference:
    """All N ranks of the algorithm, simulated in one process, with a plain loop over stripes."""

    def __init__(self, codec: ColumnCodec | E3M0Codec, world: int) -> None:
        self.codec, self.world = codec, world
        self.r1: dict = {}
        self.r2: dict = {}

    def __call__(self, all_grads: list[dict[str, torch.Tensor]]) -> tuple[dict, list[int], list[int]]:
        n, codec = self.world, self.codec
        out, stage1_sizes, stage2_sizes = {}, [0] * n, [0] * n
        for name, g0 in all_grads[0].items():
            rows, cols = g0.shape[0], math.prod(g0.shape[1:])
            width = -(-cols // n)
            bounds = [(min(k * width, cols), min((k + 1) * width, cols)) for k in range(n)]
            final = torch.zeros(cols, rows)
            sent = {}
            for j in range(n):
                v = all_grads[j][name].reshape(rows, cols).t().contiguous() + self.r1.get((j, name), 0)
                r = torch.zeros_like(v)
                for k, (c0, c1) in enumerate(bounds):
                    if c1 > c0:
                        payload, deq = codec.encode(v[c0:c1].contiguous())
                        r[c0:c1] = v[c0:c1] - deq
                        sent[j, k] = payload
                        if k != j:
                            stage1_sizes[j] += payload.numel()
                self.r1[j, name] = r
            for k, (c0, c1) in enumerate(bounds):
                if c1 == c0:
                    continue
                total = torch.zeros(c1 - c0, rows)
                for j in range(n):
                    total += codec.decode(sent[j, k], c1 - c0, rows)
                total += self.r2.get((k, name), 0)
                payload, deq = codec.encode(total)
                self.r2[k, name] = total - deq
                stage2_sizes[k] += payload.numel()
                final[c0:c1] = codec.decode(payload, c1 - c0, rows)
            out[name] = (final / n).t().reshape(g0.shape)
        return out, stage1_sizes, stage2_sizes


def main() -> None:
    spec = json.loads(sys.argv[1])
    out_dir = Path(sys.argv[2])
    comm = connect("gloo")
    rank, world = comm.rank, comm.world_size
    kind = spec.get("codec", "uniform")
    agg = QuantizedAllReduce(make_codec(kind, spec["bits"]), comm)
    ref = Reference(make_codec(kind, spec["bits"]), world)
    results = []
    for step in range(spec["steps"]):
        before = comm.stats.bytes_sent
        mine = grads_of(rank, step, spec["shapes"])
        got = agg(mine)
        sent = comm.stats.bytes_sent - before
        expected, s1, s2 = ref([grads_of(r, step, spec["shapes"]) for r in range(world)])
        for name in expected:
            assert torch.equal(got[name], expected[name]), f"step {step}, {name}: differs from the reference"
        assert sent == s1[rank] + (world - 1) * max(s2), (sent, s1, s2)
        true_mean = {n: sum(grads_of(r, step, spec["shapes"])[n] for r in range(world)) / world for n in mine}
        results.append({"got": got, "true": true_mean, "bytes": sent})
    torch.save(results, out_dir / f"rank{rank}.pt")
    finish(comm)


if __name__ == "__main__":
    main()
