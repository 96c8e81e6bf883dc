"""1-bit SGD's compressor (Seide et al., 2014), written from the paper for the tests' simulations of
the 1-bit schemes (``onebit_adam``, ``zero_one_adam``), not from the package's code."""

from __future__ import annotations

import torch


def compress(x: torch.Tensor) -> torch.Tensor:
    """1-bit, per column of the [shape[0], rest] view: the mean of its entries of the same sign."""
    cols = x.reshape(x.shape[0], -1).double()
    positive = cols >= 0
    pos = torch.where(positive, cols, 0).sum(0) / positive.sum(0).clamp(min=1)
    neg = torch.where(positive, 0, cols).sum(0) / (~positive).sum(0).clamp(min=1)
    return torch.where(positive, pos, neg).reshape(x.shape)
