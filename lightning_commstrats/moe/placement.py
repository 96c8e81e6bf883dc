"""Experts parallel inside each group of ranks: the MoE placement a periodic scheme holds across sites.

With ``expert_parallel=True`` and ``shard="fsdp"``, a periodic scheme (``diloco``,
``streaming_diloco``, ``sparseloco``, ``bmuf``, ``model_averaging``) runs every group of
``group_size`` ranks (a site, a node) as one expert-parallel model: each group holds every expert
once, spread over its ranks (rank ``i`` of a group holds experts ``i E/g .. (i+1) E/g - 1`` of every
MoE layer), tokens travel by all-to-all inside the group only, and the dense part is sharded by FSDP2
over the same ranks. Rank ``i`` of every group thus holds the same experts and the same dense shard,
and the scheme's exchange across groups (over the cross-group channel: rank ``i`` with rank ``i``)
carries both, with no rank relaying for another.

Gradients inside a group: FSDP2 averages the dense gradients over the group's ranks; an expert's
owner receives, through the all-to-all's backward, the gradient of every rank's loss of the group
(each a mean over that rank's tokens), which :meth:`ExpertPlacement.scale_gradients` divides by the
group's size, so that experts and dense parameters both step on the group's average. With a sync
every step, an outer learning rate of 1, no outer momentum and plain SGD inside, this is
``expert_parallel`` over ``groups x group_size`` ranks with ``inner="ep"``, step for step.

The expert bias of ``balance="bias"`` is updated from the load summed over all ranks (the recipe's
LightningModule sums it through the strategy's communicator every step: a few bytes per MoE layer
cross the groups), so it is the same on every rank of every group; SWIPE balances each group's own
tokens over its own experts. No Lightning here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_commstrats.comm import Communicator
from lightning_commstrats.moe.layer import MoELayer


class ExpertPlacement:
    """The MoE layers of a model, their experts spread over the ranks of one group (see the module
    docstring)."""

    def __init__(self) -> None:
        self.layers: list[MoELayer] = []
        self.comm: Communicator | None = None  # the group's ranks: the all-to-all's

    def __repr__(self) -> str:
        size = None if self.comm is None else self.comm.world_size
        return f"ExpertPlacement({len(self.layers)} MoE layer(s) over groups of {size})"

    def place(self, module: nn.Module, comm: Communicator) -> None:
        """Keep this rank's share of every MoE layer's experts; tokens travel over ``comm`` (this
        rank's group). Raises ``ValueError`` for a model without MoE layers or experts that do not
        divide over the group."""
        layers = [m for m in module.modules() if isinstance(m, MoELayer)]
        if not layers:
            raise ValueError(
                "expert_parallel=True needs a model with MoE layers (lightning_commstrats.moe.MoELayer);"
                " this one has none"
            )
        for layer in layers:
            if layer.num_experts % comm.world_size:
                raise ValueError(
                    f"expert_parallel=True spreads every MoE layer's experts over a group of {comm.world_size}"
                    f" ranks: num_experts={layer.num_experts} does not divide over them"
                )
        for layer in layers:
            layer.shard(comm)
        self.layers, self.comm = layers, comm

    def params(self) -> list[nn.Parameter]:
        """This rank's experts' parameters, in the model's order."""
        return [p for layer in self.layers for p in layer.experts.parameters()]

    def scale_gradients(self) -> None:
        """Divide this rank's expert gradients by the group's size (see the module docstring)."""
        if self.comm is None or self.comm.world_size == 1:
            return
        grads = [p.grad for p in self.params() if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, self.comm.world_size)

    def clip_by_global_norm(self, dense: list[torch.Tensor], max_norm: float) -> None:
        """Clip this rank's gradients by the norm of the group's whole model: ``dense`` are this rank's
        shards of the dense gradients (FSDP2's, spread over the group as the experts are), the
        experts' its own. One 4-byte all-reduce over the group (tag ``"control"``); every rank of the
        group applies the same factor, as ``clip_grad_norm_`` on the unsharded model would."""
        experts = [p.grad for p in self.params() if p.grad is not None]
        grads = [*dense, *experts]
        if not grads:
            return
        square = squared_norm(grads, grads[0].device)
        if self.comm is not None and self.comm.world_size > 1:
            square = self.comm.all_reduce(square.reshape(1), "sum", tag="control")[0]
        factor = torch.clamp(max_norm / (square.sqrt() + 1e-6), max=1.0)
        torch._foreach_mul_(grads, factor)


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of ``grads`` (float32, a 0-d tensor on ``device``), each tensor's norm in one
    fused operation over the list, as ``torch.nn.utils.clip_grad_norm_`` takes them."""
    if not grads:
        return torch.zeros((), device=device)
    norms = torch._foreach_norm([g if g.dtype == torch.float32 else g.float() for g in grads])
    return torch.linalg.vector_norm(torch.stack(norms)) ** 2


def clipped_by_the_strategy(optimizer: Any, clip_val: float) -> None:
    """The precision plugin's clip by norm where the strategy clips by the norm of the whole model
    itself (ranks hold different experts: ``expert_parallel``, ``expert_parallel=True``): nothing more."""
