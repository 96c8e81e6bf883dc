"""Whether Adam's variance has settled when a scheme stops updating it: the figure that tells a
freeze too early from a good one, for ``onebit_adam`` (which can also move its freeze later) and
``zero_one_adam``.

The figure is how far the bias-corrected ``r = sqrt(v)`` moved over the last ``window`` optimizer
steps before the freeze, over all the tensors the scheme freezes::

    moved = sum |r_T - r_{T-window}| / sum |r_T|            (L1, every value of every tensor)

Measured on the recipe's Transformer with a tied 10k-word vocabulary (AdamW, lr 3e-3, 2 ranks,
100 steps; ``docs/benchmarks/quality.md``), 10-step windows: 32% at step 20, 19% at 40, 11% at 60,
7.9% at 80, and ``onebit_adam`` frozen there ended +29.5%, +7.8%, +4.4% and +1.6% in perplexity
against ``allreduce``. The default threshold, 15%, flags the first two.

Cost: one copy of ``r`` (in bfloat16: half an optimizer moment) held from ``window`` steps before
the freeze to the freeze, and one transfer of two floats per tensor to the host at the freeze;
nothing on the other steps. Every rank holds the same variance before a freeze (the gradients were
averaged in fp32 and every rank took the same Adam step), so every rank measures the same figure;
the delay is still agreed (rank 0's decision) so that no rank freezes alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

SNAPSHOT_DTYPE = torch.bfloat16  # 3 significant digits: the figure is a sum of many values' changes


def check_settling_args(threshold: float | None, window: int, max_delay: int | None = None) -> None:
    """Construction-time checks, naming the argument and what it takes."""
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf
    ):
        raise ValueError(
            "settling_warning must be a positive share (how far sqrt(v) may still move, L1, over the last"
            f" settling_window steps before the freeze; 0.15 is 15%) or None (no check), got {threshold!r}"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"settling_window must be an int >= 1 (optimizer steps), got {window!r}")
    if max_delay is not None and (isinstance(max_delay, bool) or not isinstance(max_delay, int) or max_delay < 0):
        raise ValueError(
            "delay_freeze must be an int >= 0 (the most optimizer steps the freeze may move later while"
            f" sqrt(v) still moves more than settling_warning; 0: never), got {max_delay!r}"
        )


def variance_roots(optimizer: Optimizer, params: Sequence[torch.nn.Parameter]) -> list[Tensor]:
    """The bias-corrected ``sqrt(v)`` of each of ``params`` that has Adam state, in order."""
    wanted = {id(p) for p in params}
    roots: list[Tensor] = []
    for group in optimizer.param_groups:
        b2 = group["betas"][1]
        states = [optimizer.state.get(p) for p in group["params"] if id(p) in wanted]
        states = [s for s in states if s and "exp_avg_sq" in s]
        if not states:
            continue
        r = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_mul_(r, [1 / math.sqrt(1 - b2 ** float(s["step"])) for s in states])
        roots += r
    return roots


class VarianceSettling:
    """Measures ``moved`` (the module's figure) at a freeze and warns, or
    (``max_delay > 0``) moves the freeze later by ``window`` steps at a time while it is above
    ``threshold``, at most ``max_delay`` steps in all.

    The strategy calls :meth:`observe` at the start of every optimizer step before the freeze
    (cheap: an integer comparison on all but two steps) and :meth:`decide` at the step the freeze
    is due; the effective freeze step is :attr:`freeze_at`.

    State (:meth:`state_dict`): the freeze step in force (it moved if delayed) and, between the
    snapshot and the freeze, the snapshot itself, so that a run resumed in between measures the
    same figure.
    """

    def __init__(
        self,
        freeze_step: int,
        threshold: float | None = 0.15,
        window: int = 10,
        max_delay: int = 0,
        *,
        scheme: str = "onebit_adam",
        setting: str = "freeze_step",
    ) -> None:
        check_settling_args(threshold, window, max_delay)
        self.planned = freeze_step
        self.freeze_at = freeze_step
        self.threshold = None if threshold is None else float(threshold)
        self.window = window
        self.max_delay = max_delay
        self.scheme, self.setting = scheme, setting
        self.last: float | None = None  # the figure measured at the last decision
        self._snapshot: list[Tensor] | None = None
        self._taken_at: int | None = None

    @property
    def active(self) -> bool:
        return self.threshold is not None

    def snapshot_step(self) -> int:
        """The completed optimizer steps after which ``r`` is copied (at least one step of history)."""
        return max(1, self.freeze_at - self.window)

    def due(self, steps: int) -> bool:
        """Whether the copy of ``r`` is taken at the start of the step after ``steps`` completed ones."""
        return self.active and steps == self.snapshot_step() and steps < self.freeze_at

    @torch.no_grad()
    def observe(self, steps: int, optimizer: Optimizer, params: Sequence[torch.nn.Parameter]) -> None:
        """At the start of a step that follows ``steps`` completed ones, before the freeze: the copy
        of ``r`` when it is due (the strategy may ask :meth:`due` first and skip listing ``params``)."""
        if self.due(steps):
            self._take(steps, optimizer, params)

    def _take(self, steps: int, optimizer: Optimizer, params: Sequence[torch.nn.Parameter]) -> None:
        self._snapshot = [r.to(SNAPSHOT_DTYPE) for r in variance_roots(optimizer, params)]
        self._taken_at = steps

    @torch.no_grad()
    def moved(self, optimizer: Optimizer, params: Sequence[torch.nn.Parameter]) -> float | None:
        """The L1 share ``r`` moved since the snapshot (``None`` without one); drops the snapshot."""
        snapshot, self._snapshot = self._snapshot, None
        if not snapshot:
            return None
        now = variance_roots(optimizer, params)
        if len(now) != len(snapshot):
            return None
        diffs = torch._foreach_sub(now, [s.to(n.dtype) for s, n in zip(snapshot, now, strict=True)])
        sums = [d.abs().sum() for d in diffs] + [n.sum() for n in now]  # r >= 0: its L1 is its sum
        totals = torch.stack([s.float() for s in sums]).view(2, -1).sum(dim=1).tolist()
        return totals[0] / totals[1] if totals[1] > 0 else math.inf

    def decide(self, steps: int, optimizer: Optimizer, params: Sequence[torch.nn.Parameter], agree: Any = None) -> bool:
        """At the start of the step due to freeze (``steps == freeze_at`` completed): ``True`` to
        freeze now; ``False`` when the freeze moved ``window`` steps later (a new snapshot taken).
        ``agree(flag) -> flag``: rank 0's decision for every rank (``None``: a single process)."""
        taken_at = self._taken_at
        moved = self.moved(optimizer, params)
        self.last = moved
        if moved is None or self.threshold is None or moved <= self.threshold:
            return True
        delay = self.freeze_at + self.window - self.planned <= self.max_delay
        if agree is not None and self.max_delay > 0:
            delay = bool(agree(delay))
        span = steps - (taken_at if taken_at is not None else steps)
        if delay:
            self.freeze_at += self.window
            self._take(steps, optimizer, params)
            rank_zero_info(
                f"{self.scheme}: sqrt(v) moved {moved:.1%} (L1) over the last {span} optimizer steps, more than"
                f" settling_warning={self.threshold}: the freeze moves to step {self.freeze_at}"
                f" ({self.setting}={self.planned}, delay_freeze={self.max_delay})"
            )
            return False
        later = (
            f" after delaying it {self.freeze_at - self.planned} steps (delay_freeze={self.max_delay})"
            if self.freeze_at > self.planned
            else ""
        )
        advice = (
            f"a later {self.setting}, or delay_freeze=N to let it move up to N steps later while the variance moves"
            if self.setting == "freeze_step"
            else f"a larger {self.setting} (the fp32 steps before the first 1-bit one)"
        )
        event = (
            f"the variance is frozen at optimizer step {steps}{later}"
            if self.setting == "freeze_step"
            else f"the momentum goes out compressed from optimizer step {steps + 1}"
        )
        rank_zero_warn(
            f"{self.scheme}: {event} while sqrt(v) still moved"
            f" {moved:.1%} (L1) over the last {span} steps, more than settling_warning={self.threshold}: the"
            f" frozen preconditioner misjudges the values' scales and the compressed run falls behind (on the"
            f" recipe's Transformer, freezes where it moved 32% and 19% in 10 steps ended +29.5% and +7.8% in"
            f" perplexity against allreduce, 11% and 8% ended +4.4% and +1.6%). Take {advice};"
            " settling_warning=None silences this."
        )
        return True

    def tensors(self) -> list[Tensor]:
        """What it holds now (the snapshot, between its step and the freeze), for the memory accounting."""
        return list(self._snapshot or [])

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"freeze_at": self.freeze_at}
        if self._snapshot is not None:
            state["snapshot"] = [t.clone() for t in self._snapshot]
            state["taken_at"] = self._taken_at
        return state

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        self.freeze_at = int(state.get("freeze_at", self.planned))
        snapshot = state.get("snapshot")
        self._snapshot = None if snapshot is None else [t.to(device) if device else t for t in snapshot]
        self._taken_at = state.get("taken_at")
