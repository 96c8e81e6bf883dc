"""One rank of the non-finite exchange test: a TensorExchange averages seeded tensors for a few
rounds while one rank feeds it an inf or a NaN, or while the ranks' 16-bit sum overflows; saves per
round the names the exchange reported, the averages and both stages' residuals.

Usage: ``nonfinite_worker.py SPEC_JSON OUT_DIR`` with SPEC ``{"bits": b, "rounds": [kind, ...]}``;
a kind is ``"normal"``, ``"inf"`` (rank 1's first matrix gets an inf), ``"nan_small"`` (rank 1's
bias gets a NaN) or ``"overflow"`` (every rank sends 40000 in the first matrix: above float16's
65504 once summed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from rank_env import connect, finish

from lightning_commstrats.compression import TensorExchange


def tensors(rank: int, round_: int, kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * round_ + rank)
    named = {
        "w": torch.randn(24, 10, generator=g),
        "v": torch.randn(8, 40, generator=g),
        "b": torch.randn(5, generator=g),
    }
    if kind == "inf" and rank == 1:
        named["w"][3, 4] = float("inf")
    if kind == "nan_small" and rank == 1:
        named["b"][2] = float("nan")
    if kind == "overflow":
        named["w"].fill_(40000.0)
    return named


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    comm = connect("gloo")
    exchange = TensorExchange(comm, spec["bits"], small_tensor_numel=16)
    rounds = []
    for i, kind in enumerate(spec["rounds"]):
        named = tensors(comm.rank, i, kind)
        bad = exchange.average(named)
        state = exchange.state_dict()
        rounds.append(
            {
                "bad": bad,
                "avg": {k: v.clone() for k, v in named.items()},
                "residuals": {k: {n: r.clone() for n, r in d.items()} for k, d in state.items()},
            }
        )
    torch.save(rounds, out / f"rank{comm.rank}.pt")
    finish(comm)


if __name__ == "__main__":
    main()
