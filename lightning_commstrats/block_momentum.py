"""Block-wise model-update filtering (BMUF, Chen & Huo, ICASSP 2016): the pure update rule.

Workers train locally for a block, starting from ``w_start``; at the block's end their weights are
averaged into ``w_avg`` and the *block gradient* ``G = w_avg - w_start`` is filtered by block
momentum::

    delta    = block_momentum * delta + block_lr * G
    w_global = w_global + delta
    w_start  = w_global + block_momentum * delta     (Nesterov, the default)
             = w_global                              (classical block momentum)

With ``block_momentum = 0`` and ``block_lr = 1`` the filter returns ``w_avg``: plain model
averaging. No Lightning and no communication here; :class:`~lightning_commstrats.BMUFStrategy`
does the averaging.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def block_momentum_from_time_constant(time_constant: float, sync_period: float) -> float:
    """``exp(-sync_period / time_constant)``: the block momentum of a given time constant (CNTK's
    ``blockMomentumAsTimeConstant``), both in the same unit (samples or steps)."""
    if not time_constant > 0:
        raise ValueError(f"block_momentum_as_time_constant must be > 0, got {time_constant}")
    return math.exp(-sync_period / time_constant)


def time_constant_from_block_momentum(block_momentum: float, sync_period: float) -> float:
    """``-sync_period / ln(block_momentum)`` (0 for no momentum)."""
    return -sync_period / math.log(block_momentum) if block_momentum > 0 else 0.0


class BlockMomentumFilter:
    """The BMUF state and update on flat float32 weight vectors.

    Args:
        block_momentum: ``eta`` in [0, 1).
        block_lr: ``zeta`` > 0, the block learning rate.
        nesterov: start the next block from the look-ahead point ``w_global + eta * delta``.

    Attributes:
        w_global: the global model after the last block.
        delta: the filtered block update (the block momentum buffer).
        blocks: blocks filtered so far.
    """

    def __init__(self, block_momentum: float, block_lr: float = 1.0, nesterov: bool = True) -> None:
        if not 0.0 <= block_momentum < 1.0:
            raise ValueError(f"block_momentum must be in [0, 1), got {block_momentum}")
        if not block_lr > 0:
            raise ValueError(f"block_learning_rate must be > 0, got {block_lr}")
        self.block_momentum = block_momentum
        self.block_lr = block_lr
        self.nesterov = nesterov
        self.w_global: Tensor | None = None
        self.delta: Tensor | None = None
        self.blocks = 0

    def start(self, weights: Tensor) -> None:
        """Begin from ``weights`` (identical on every rank): ``w_global = weights``, ``delta = 0``."""
        self.w_global = weights.detach().to(torch.float32, copy=True)
        self.delta = torch.zeros_like(self.w_global)
        self.blocks = 0

    @property
    def w_start(self) -> Tensor:
        """Where the current block started (and where the next one starts after :meth:`update`)."""
        assert self.w_global is not None and self.delta is not None, "call start() first"
        if self.nesterov:
            return self.w_global + self.block_momentum * self.delta
        return self.w_global.clone()

    def update(self, w_avg: Tensor) -> Tensor:
        """Filter the block that ended with the averaged weights ``w_avg``; returns the next ``w_start``."""
        block_grad = w_avg.to(torch.float32) - self.w_start
        self.delta.mul_(self.block_momentum).add_(block_grad, alpha=self.block_lr)
        self.w_global.add_(self.delta)
        self.blocks += 1
        return self.w_start

    def state_dict(self) -> dict:
        return {"w_global": self.w_global, "delta": self.delta, "blocks": self.blocks}

    def load_state_dict(self, state: dict) -> None:
        self.w_global = state["w_global"].to(torch.float32)
        self.delta = state["delta"].to(torch.float32)
        self.blocks = int(state["blocks"])
