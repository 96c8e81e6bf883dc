"""Row selection for sampled-vocabulary gradient exchange (the 2018 multi-GPU NLM paper).

Pure tensor code. The rows of the vocabulary matrices exchanged in a step are
``V_all = V_base U V_alpha U V_beta``: the words of the step's minibatches on all ranks, the
``alpha`` most frequent words, and ``beta`` random words drawn from a generator that every rank
seeds identically for the step, so the ranks agree without talking.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


def resolve_count(value: float, vocab_size: int, name: str) -> int:
    """A number of words from a count (int) or a fraction of the vocabulary (float in [0, 1])."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a count (int) or a fraction (float), got {value!r}")
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} as a fraction must be in [0, 1]")
        return round(value * vocab_size)
    if not 0 <= value <= vocab_size:
        raise ValueError(f"{name}={value} must be between 0 and the vocabulary size {vocab_size}")
    return value


def batch_token_ids(batch: Any, vocab_size: int) -> Tensor:
    """Distinct token ids in ``[0, vocab_size)`` found in every integer tensor of ``batch`` (int64)."""
    found: list[Tensor] = []

    def collect(t: Tensor) -> Tensor:
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            found.append(t.reshape(-1))
        return t

    apply_to_collection(batch, Tensor, collect)
    if not found:
        return torch.empty(0, dtype=torch.int64)
    ids = torch.cat([f.to(torch.int64) for f in found])
    return torch.unique(ids[(ids >= 0) & (ids < vocab_size)])


def most_frequent(counts: Tensor, k: int) -> Tensor:
    """The ids of the ``k`` largest counts, ascending (ties broken by the smaller id)."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=counts.device)
    order = torch.argsort(counts, descending=True, stable=True)
    return torch.sort(order[:k]).values


def random_rows(vocab_size: int, k: int, seed: int, step: int) -> Tensor:
    """``k`` distinct ids drawn uniformly for ``step``; every rank with the same seed draws the same."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.sort(torch.randperm(vocab_size, generator=g)[:k]).values


def union(*ids: Tensor) -> Tensor:
    """Sorted distinct ids of all the given id tensors (moved to the first one's device)."""
    device = ids[0].device
    return torch.unique(torch.cat([i.to(device, torch.int64) for i in ids]))
