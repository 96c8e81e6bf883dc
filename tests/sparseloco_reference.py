"""SparseLoCo as published, written out tile by tile with numpy from the paper's description and the public
training code's settings (not from the package's code), to check the package's vectorised form against.

Per tensor: a matrix is cut in tiles whose sides are the largest divisors of its dimensions not above
``side`` (a vector: runs of up to ``side`` values); of each tile the ``k`` largest magnitudes are kept
(all of a tile of at most ``k`` values; a kept zero is nothing, but in a tile kept whole, which needs no
positions, a zero is a value like the others); the kept values of the tensor are
centred on their mean, cut in ``2^bits`` bins of ``sigmas * std / 2^bits`` (``std`` with ``n - 1``),
a value's bin ``round(centred / width + 2^bits / 2)`` clamped; each bin is decoded as the mean of the
values in it. Error feedback: ``e = beta e + G``, ``s = Q(topk(e))``, ``e -= s``; the average is
``(1/N) sum_r s_r``, summed in rank order.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def divisor_at_most(n: int, limit: int) -> int:
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    raise AssertionError(n)


def tiles_of(shape: tuple[int, ...], side: int) -> list[np.ndarray]:
    """The flat indices (into the tensor, row-major) of each tile, tiles in row-major order."""
    if len(shape) < 2:
        rows, cols = 1, int(np.prod(shape, dtype=np.int64))
        a, b = 1, divisor_at_most(cols, side)
    else:
        rows, cols = shape[0], int(np.prod(shape[1:], dtype=np.int64))
        a, b = divisor_at_most(rows, side), divisor_at_most(cols, side)
    index = np.arange(rows * cols).reshape(rows, cols)
    return [index[i : i + a, j : j + b].reshape(-1) for i in range(0, rows, a) for j in range(0, cols, b)]


def compress(e: np.ndarray, side: int, k: int, bits: int = 2, sigmas: float = 6.0) -> np.ndarray:
    """What one rank sends of its buffer ``e`` (float32, any shape): the decoded kept values, zeros elsewhere."""
    flat = e.reshape(-1)
    kept: list[int] = []
    for tile in tiles_of(e.shape, side):
        if k >= tile.size:
            kept += [int(i) for i in tile]
            continue
        order = np.argsort(-np.abs(flat[tile]), kind="stable")[:k]
        kept += [int(i) for i in tile[order] if flat[i] != 0]
    out = np.zeros_like(flat)
    if not kept:
        return out.reshape(e.shape)
    idx = np.array(kept)
    if bits == 32:
        out[idx] = flat[idx]
        return out.reshape(e.shape)
    v = flat[idx].astype(np.float64)
    bins = 2**bits
    mu = v.mean()
    std = np.sqrt(((v - mu) ** 2).sum() / (v.size - 1)) if v.size > 1 else 0.0
    width = sigmas * std / bins
    if not width > 0:
        width = 1.0
    code = np.clip(np.round((v - mu) / width + bins // 2), 0, bins - 1)
    for c in np.unique(code):
        out[idx[code == c]] = np.float32(v[code == c].mean())
    return out.reshape(e.shape)


def dense_reference(e: np.ndarray, bits: int = 2, sigmas: float = 6.0) -> np.ndarray:
    """Every value of ``e`` on the statistical grid: centred on the tensor's mean, ``2^bits`` bins of
    ``sigmas * std / 2^bits`` (``std`` with ``n - 1``), the bin ``round(centred / width + 2^bits / 2)``
    clamped, decoded as the mean of the values in it (in float64, the lookup as float32)."""
    v = e.reshape(-1).astype(np.float64)
    bins = 2**bits
    mu = v.mean()
    std = math.sqrt(((v - mu) ** 2).sum() / (v.size - 1)) if v.size > 1 else 0.0
    width = sigmas * std / bins if std > 0 else 1.0
    code = np.clip(np.round((v - mu) / width + bins // 2), 0, bins - 1)
    out = np.empty(v.size, dtype=np.float32)
    for c in np.unique(code):
        out[code == c] = np.float32(v[code == c].mean())
    return out.reshape(e.shape)


def simulate(
    syncs: list[list[dict[str, torch.Tensor]]],
    side: int,
    k: int | list[int],
    beta: float,
    bits: int = 2,
    sigmas: float = 6.0,
) -> tuple[list[dict[str, torch.Tensor]], dict[tuple[int, str], torch.Tensor]]:
    """``syncs[j][r]``: rank r's pseudo-gradients at sync j; ``k``: values kept per tile, or a list of them
    per sync. Returns the averages of every sync and the error-feedback buffers after the last, per
    (rank, name)."""
    n = len(syncs[0])
    e: dict[tuple[int, str], np.ndarray] = {}
    out = []
    ks = k if isinstance(k, list) else [k] * len(syncs)
    for by_rank, k in zip(syncs, ks, strict=True):
        avg = {}
        for name, first in by_rank[0].items():
            total = np.zeros(first.shape, dtype=np.float32)
            for r in range(n):
                g = by_rank[r][name].numpy().astype(np.float32)
                acc = e[r, name] * np.float32(beta) + g if (r, name) in e else g.copy()
                s = compress(acc, side, k, bits, sigmas)
                e[r, name] = acc - s
                total = total + s
            avg[name] = torch.from_numpy(np.asarray(total / np.float32(n)))
        out.append(avg)
    return out, {key: torch.from_numpy(np.asarray(v)) for key, v in e.items()}
