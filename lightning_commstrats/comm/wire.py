"""Bytes a rank puts on the wire for each collective.

Every collective in :mod:`lightning_commstrats.comm` charges the calling rank with the bytes that
*this rank sends* under the bandwidth-optimal algorithm for that collective. These are the formulas,
in one place, so that tests, benchmarks and the cost model use the same numbers.

Notation: ``N`` ranks, ``e`` bytes per element, ``K`` elements.

=====================  ===========================================  ==============================
collective             bytes sent by one rank                       algorithm
=====================  ===========================================  ==============================
all-reduce             ``2 (N-1) ceil(K/N) e``                      ring: reduce-scatter, then
                                                                    all-gather, ``N`` chunks of
                                                                    ``ceil(K/N)`` elements
reduce-scatter         ``(N-1) ceil(K/N) e`` (``K`` = whole input)  ring
all-gather             ``(N-1) K e`` (``K`` = this rank's part)     ring: each rank forwards every
                                                                    part but one
all-to-all             ``sum_{j != r} s_j e`` (``s_j`` = elements   direct: one message per peer
                       this rank sends to rank ``j``)
broadcast              ``c(r) K e``, ``c(r)`` = children of rank    binomial tree rooted at ``src``
                       ``r`` in the binomial tree (root:
                       ``ceil(log2 N)``; leaves: 0)
send                   ``K e``                                      point to point
barrier                0 (control messages only)
=====================  ===========================================  ==============================

With ``K`` divisible by ``N`` the ring all-reduce formula is the familiar ``2 (N-1)/N`` of the
buffer: the per-rank volume is nearly independent of ``N``, which is why ring all-reduce scales.
When ``K`` is not divisible by ``N`` the formula rounds each chunk up, i.e. it is exact for a ring
that pads its chunks and at most ``2 (N-1) e`` bytes above an unpadded one.

These are the bytes of the algorithm, not of a particular library's choice of algorithm: gloo and
NCCL run rings for large all-reduces, MPICH runs Rabenseifner's reduce-scatter + all-gather (the
same volume for power-of-two ``N``) and recursive doubling for small messages (``log2 N`` times
the buffer). The emulated-cluster benchmarks compare these figures with interface counters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _check(world_size: int, *, rank: int | None = None) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def all_reduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements."""
    _check(world_size)
    if world_size == 1 or numel == 0:
        return 0
    return 2 * (world_size - 1) * math.ceil(numel / world_size) * element_size


def reduce_scatter_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter of an input of ``numel`` elements."""
    _check(world_size)
    if world_size == 1 or numel == 0:
        return 0
    return (world_size - 1) * math.ceil(numel / world_size) * element_size


def all_gather_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather in which every rank contributes ``numel`` elements."""
    _check(world_size)
    return (world_size - 1) * numel * element_size


def all_to_all_bytes(send_counts: Sequence[int], element_size: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in an all-to-all; ``send_counts[j]`` elements go to rank ``j``."""
    _check(len(send_counts), rank=rank)
    return (sum(send_counts) - send_counts[rank]) * element_size


def binomial_children(rank: int, src: int, world_size: int) -> int:
    """Number of ranks that ``rank`` forwards to in a binomial broadcast tree rooted at ``src``."""
    _check(world_size, rank=rank)
    _check(world_size, rank=src)
    v = (rank - src) % world_size
    children = 0
    step = 1
    while step < world_size:
        # In round k the ranks with v < 2^k send to v + 2^k.
        if v < step and v + step < world_size:
            children += 1
        step *= 2
    return children


def broadcast_bytes(numel: int, element_size: int, rank: int, src: int, world_size: int) -> int:
    """Bytes rank ``rank`` sends in a binomial-tree broadcast of ``numel`` elements from ``src``."""
    return binomial_children(rank, src, world_size) * numel * element_size
