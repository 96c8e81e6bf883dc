"""Routing tokens to experts: top-1 (Switch) and top-2 (GShard) gates, capacity, SWIPE balancing.

Pure tensor code. A gate turns router logits ``[tokens, experts]`` into an :class:`Routing`: for
each token ``k`` (expert, weight) slots, a mask of the slots that are kept, and the auxiliary
load-balancing loss. Three balancing modes:

- ``"aux"``: dropless; only the auxiliary loss pushes the router towards balance;
- ``"capacity"``: every expert takes at most ``ceil(capacity_factor * tokens * k / experts)``
  slots, first come first served in token order; the rest are dropped (the token skips the
  expert: its output is the residual alone);
- ``"swipe"``: the balancing of the 2022 paper on 174-trillion-parameter MoE training: every
  expert gets exactly its share of the tokens (``tokens / experts``, shares differing by at most
  one when that does not divide), and no token is dropped. Tokens an over-loaded expert cannot
  take move to their next-best expert with room, in rounds: in round ``r`` every unplaced token
  asks its ``r``-th choice, and each expert accepts, up to its remaining share, the askers that
  rate it highest. Top-1 only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

BALANCE_MODES = ("aux", "capacity", "swipe")


@dataclass
class Routing:
    """Where every token goes.

    Attributes:
        experts: ``[tokens, k]`` expert of each slot.
        weights: ``[tokens, k]`` combine weight of each slot (0 for dropped slots).
        kept: ``[tokens, k]`` bool, False for slots dropped by the capacity limit.
        aux_loss: the load-balancing loss (scalar).
        load: ``[experts]`` slots kept per expert.
    """

    experts: Tensor
    weights: Tensor
    kept: Tensor
    aux_loss: Tensor
    load: Tensor

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


def load_balancing_loss(probs: Tensor, top1: Tensor, num_experts: int) -> Tensor:
    """Switch Transformer's auxiliary loss ``E * sum_e f_e * P_e`` (1 when perfectly balanced)."""
    f = torch.bincount(top1, minlength=num_experts).to(probs.dtype) / top1.numel()
    return num_experts * (f * probs.mean(0)).sum()


def capacity(tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    return math.ceil(capacity_factor * tokens * k / num_experts)


def route(logits: Tensor, k: int = 1, balance: str = "aux", capacity_factor: float = 1.25) -> Routing:
    """Route ``[tokens, experts]`` router logits (computed in float32) with a top-``k`` gate.

    Top-1 weights are the expert's softmax probability (Switch); top-2 weights are the two
    probabilities renormalised to sum to 1 (GShard).
    """
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance={balance!r} is not supported; choose one of {BALANCE_MODES}")
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"top-k must be in [1, num_experts={e}], got k={k}")
    probs = F.softmax(logits.float(), dim=-1)
    if balance == "swipe":
        if k != 1:
            raise ValueError("SWIPE balancing routes top-1; use k=1")
        experts = swipe_assign(probs).unsqueeze(1)
    else:
        experts = probs.topk(k, dim=-1).indices
    weights = probs.gather(1, experts)
    if k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    kept = torch.ones_like(experts, dtype=torch.bool)
    if balance == "capacity":
        cap = capacity(t, e, k, capacity_factor)
        # position of each slot in its expert's queue, slots ordered by choice rank then token
        flat = experts.t().reshape(-1)
        one_hot = F.one_hot(flat, e)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
        kept = (position < cap).view(k, t).t()
        weights = weights * kept
    aux = load_balancing_loss(probs, probs.argmax(-1), e)
    load = torch.bincount(experts[kept], minlength=e)
    return Routing(experts, weights, kept, aux, load)


def swipe_assign(probs: Tensor) -> Tensor:
    """Top-1 expert per token such that every expert gets exactly its share and none is dropped."""
    t, e = probs.shape
    share = torch.full((e,), t // e, dtype=torch.long, device=probs.device)
    share[: t % e] += 1  # shares differ by at most one when t % e != 0
    order = probs.argsort(dim=-1, descending=True)  # each token's preference list
    assigned = torch.full((t,), -1, dtype=torch.long, device=probs.device)
    room = share.clone()
    for r in range(e):
        waiting = (assigned < 0).nonzero().squeeze(1)
        if waiting.numel() == 0:
            break
        choice = order[waiting, r]
        score = probs[waiting, choice]
        # within each expert, the askers that rate it highest come first
        by_score = torch.argsort(score, descending=True, stable=True)
        by_expert = torch.argsort(choice[by_score], stable=True)
        ranked = by_score[by_expert]
        chosen = choice[ranked]
        starts = torch.searchsorted(chosen, torch.arange(e, device=probs.device))
        rank_in_expert = torch.arange(ranked.numel(), device=probs.device) - starts[chosen]
        accept = rank_in_expert < room[chosen]
        assigned[waiting[ranked[accept]]] = chosen[accept]
        room -= torch.bincount(chosen[accept], minlength=e)
    return assigned
