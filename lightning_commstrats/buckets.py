"""Fusing many small tensors into few large buffers, so that each collective moves one buffer.

Pure tensor code. A bucket holds tensors of one dtype and device, in the order given, up to a size
cap; the order is the parameters' registration order, identical on every rank, so every rank
builds the same buckets without talking.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

DEFAULT_BUCKET_CAP_MB = 25.0


def plan_buckets(tensors: Sequence[Tensor], cap_bytes: int) -> list[list[int]]:
    """Group tensor indices into buckets of one dtype and device, each at most ``cap_bytes`` (a tensor
    larger than the cap gets a bucket of its own)."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    buckets: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        size = t.numel() * t.element_size()
        indices, used = open_buckets.get(key, ([], 0))
        if indices and used + size > cap_bytes:
            buckets.append(indices)
            indices, used = [], 0
        indices.append(i)
        open_buckets[key] = (indices, used + size)
    buckets.extend(indices for indices, _ in open_buckets.values() if indices)
    return sorted(buckets, key=lambda b: b[0])


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One new contiguous 1-D buffer holding ``tensors`` back to back."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (in place)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat buffer has {flat.numel()} elements, tensors hold {offset}")
