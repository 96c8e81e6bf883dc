"""Routing tokens to experts: top-1 (Switch) and top-2 (GShard) gates, capacity, SWIPE and bias balancing.

Pure tensor code. A gate turns router logits ``[tokens, experts]`` into an :class:`Routing`: for
each token ``k`` (expert, weight) slots, a mask of the slots that are kept, and the auxiliary
load-balancing loss. Four balancing modes:

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
- ``"bias"``: auxiliary-loss-free balancing (DeepSeek-V3, arXiv:2412.19437, section 2.1.2; Wang et
  al. 2024, arXiv:2408.15664): a per-expert bias is added to the routing scores (the softmax
  probabilities) to choose the experts, and only to choose them: the combine weights come from the
  unbiased probabilities. Dropless. The bias itself is a control loop outside the gate, updated
  after every optimizer step from the observed load (:meth:`~lightning_commstrats.moe.MoELayer.update_bias`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

BALANCE_MODES = ("aux", "capacity", "swipe", "bias")


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


def route(
    logits: Tensor, k: int = 1, balance: str = "aux", capacity_factor: float = 1.25, bias: Tensor | None = None
) -> Routing:
    """Route ``[tokens, experts]`` router logits (computed in float32) with a top-``k`` gate.

    Top-1 weights are the expert's softmax probability (Switch); top-2 weights are the two
    probabilities renormalised to sum to 1 (GShard). ``bias`` (``[experts]``, ``balance="bias"``
    only) is added to the probabilities to choose the experts; the weights ignore it.
    """
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance={balance!r} is not supported; choose one of {BALANCE_MODES}")
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"top-k must be in [1, num_experts={e}], got k={k}")
    if (bias is not None) != (balance == "bias"):
        raise ValueError(f"a bias goes with balance='bias' and only with it; got balance={balance!r}")
    if bias is not None and bias.shape != (e,):
        raise ValueError(f"bias must have shape ({e},) (one value per expert), got {tuple(bias.shape)}")
    probs = F.softmax(logits.float(), dim=-1)
    if balance == "swipe":
        if k != 1:
            raise ValueError("SWIPE balancing routes top-1; use k=1")
        experts = swipe_assign(probs).unsqueeze(1)
    elif bias is not None:
        experts = (probs + bias.float()).topk(k, dim=-1).indices
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
    load = torch.zeros(e, dtype=torch.long, device=logits.device).index_add_(
        0, experts.reshape(-1), kept.reshape(-1).long()
    )
    return Routing(experts, weights, kept, aux, load)


def swipe_assign(probs: Tensor) -> Tensor:
    """Top-1 expert per token such that every expert gets exactly its share and none is dropped.

    Runs without a host round trip: every round works on all ``tokens`` at full length, placed
    tokens masked, so no shape depends on the data (no ``nonzero``, no ``.item()``). Round ``r``:

    1. every token takes its ``r``-th choice; a token placed in an earlier round asks the sentinel
       expert ``experts`` instead, which has no room;
    2. the tokens are ordered by (expert asked, score for it descending, token index): two stable
       sorts. A token's rank within its expert is its position minus the expert's first position;
    3. a token is accepted when that rank is below the expert's remaining room, which then shrinks
       by the accepted count (a scatter-add, not ``bincount``, whose length would be data-dependent).

    The loop always runs ``experts`` rounds (it cannot stop early without asking the host whether
    everyone is placed); after them every token is: an expert left with room never rejects anyone.
    """
    t, e = probs.shape
    device = probs.device
    share = torch.full((e,), t // e, dtype=torch.long, device=device)
    share[: t % e] += 1  # shares differ by at most one when t % e != 0
    order = probs.argsort(dim=-1, descending=True)  # each token's preference list
    assigned = torch.full((t,), -1, dtype=torch.long, device=device)
    room = torch.cat([share, share.new_zeros(1)])  # the sentinel expert e has no room
    position = torch.arange(t, device=device)
    for r in range(e):
        placed = assigned >= 0
        choice = order[:, r]
        asked = torch.where(placed, e, choice)
        score = probs.gather(1, choice.unsqueeze(1)).squeeze(1)
        # within each expert, the askers that rate it highest come first, ties in token order
        by_score = torch.argsort(score, descending=True, stable=True)
        ranked = by_score[torch.argsort(asked[by_score], stable=True)]
        sorted_asked = asked[ranked]
        asking = torch.zeros(e + 1, dtype=torch.long, device=device).index_add_(0, asked, torch.ones_like(asked))
        starts = asking.cumsum(0) - asking
        accept_sorted = position - starts[sorted_asked] < room[sorted_asked]
        accept = torch.empty_like(accept_sorted).scatter_(0, ranked, accept_sorted)
        assigned = torch.where(accept, choice, assigned)
        room = room - torch.zeros_like(room).index_add_(0, asked, accept.long())
    return assigned


def balancing_shift(scores: Tensor, experts: Tensor) -> Tensor:
    """``[experts]``: for every expert alone, the change of its bias that would have brought its load
    in this batch to the mean, the other biases left as they are.

    ``scores`` ``[tokens, experts]`` are the biased routing scores, ``experts`` ``[tokens, k]`` the
    chosen experts (the top ``k`` scores). An expert ``d`` slots over the mean (rounded) gives up
    its ``d`` tokens of smallest margin (own score minus the best score not chosen) when its bias
    falls by that ``d``-th margin: the shift is minus the midpoint of the ``d``-th and ``(d+1)``-th
    smallest margins. One ``d`` under the mean takes in the ``d`` tokens that choose it next (its
    score closest below their ``k``-th chosen score): plus the midpoint of the ``d``-th and
    ``(d+1)``-th smallest gaps. Within half a slot of the mean: 0. Without host round trips.
    """
    t, e = scores.shape
    k = experts.shape[1]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, experts, True)
    load = chosen.sum(0).to(scores.dtype)
    excess = load - t * k / e
    inf = torch.full_like(scores, math.inf)
    kth = scores.masked_fill(~chosen, math.inf).min(1, keepdim=True).values  # the lowest chosen score
    best_other = scores.masked_fill(chosen, -math.inf).max(1, keepdim=True).values  # -inf when k = e
    margins = torch.where(chosen, scores - best_other, inf).sort(0).values
    gaps = torch.where(chosen, inf, kth - scores).sort(0).values
    need = excess.abs().round().long()
    cut = torch.where(excess > 0, margins, gaps)  # [tokens, experts], each column ascending
    cut = torch.cat([cut, torch.full_like(cut[:1], math.inf)])
    first = cut.gather(0, (need - 1).clamp(min=0).unsqueeze(0)).squeeze(0)
    second = cut.gather(0, need.unsqueeze(0)).squeeze(0)
    second = torch.where(torch.isfinite(second), second, first)
    step = torch.where(torch.isfinite(first), (first + second) / 2, torch.zeros_like(first))
    return torch.where(need > 0, -torch.sign(excess) * step, torch.zeros_like(step))


def balancing_bias(probs: Tensor, bias: Tensor, top_k: int, rounds: int = 8) -> Tensor:
    """``[experts]``: the change of ``bias`` after which the tokens of ``probs`` (``[tokens, experts]``,
    the router's probabilities) load every expert evenly, all experts moved together.

    Each round moves every expert by half its lone shift (:func:`balancing_shift` of the scores
    ``probs + bias`` so far): a token that one expert gives up another takes in, so the lone shifts
    of both count it, and whole shifts overshoot. The rounds converge fast: on 1,120 tokens of a
    skewed router, eight rounds land every expert on the mean (the test checks within one slot).
    ``rounds`` top-k selections and sorts of ``[tokens, experts]``; no host round trips.
    """
    start = bias.float()
    moved = start
    for _ in range(rounds):
        scores = probs + moved
        moved = moved + 0.5 * balancing_shift(scores, scores.topk(top_k, dim=-1).indices)
    return moved - start
