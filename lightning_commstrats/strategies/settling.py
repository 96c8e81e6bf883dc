"""Whether Adam's variance has settled when a scheme stops updating it: the figure that tells a
freeze too early from a good one, for ``onebit_adam`` (which can also move its freeze later) and
``zero_one_adam``.

The figure is how far each tensor's scale of ``r = sqrt(v)`` (bias-corrected) drifted over the last
``window`` optimizer steps before the freeze, ``S_k`` the sum of ``r`` over tensor ``k``::

    drift = sum_k |S_k(T) - S_k(T - window)| / sum_k S_k(T)

Why per tensor and not per value: the per-value change ``sum |r_T - r_{T-window}| / sum r_T`` is
Adam's own averaging, not the variance settling. Measured on two models, it is 0.65 times the
weight the last ``window`` steps have in ``v``'s bias-corrected average, at every step (the
recipe's Transformer, beta2 0.999: 32.0% at step 20 against 0.65 x 0.503 = 32.7%, 11.2% at 60
against 11.1%, 4.2% at 160 against 4.4%; LitGPT's pythia-14m, beta2 0.95: 26.3% at step 120
against 26.1%): each value's squared gradients scatter about their mean, and the newest steps'
share of the average moves ``r`` by that scatter whatever the model does. With beta2 0.95 that
share never falls below 40% in 10 steps, so a per-value check would flag every freeze. A tensor's
sum averages its values' scatter away and keeps what a freeze misjudges: the drift of the
tensor's gradient scale while the model still changes fast.

Measured on the recipe's Transformer with a tied 10k-word vocabulary (AdamW, lr 3e-3, 2 ranks,
100 steps; ``docs/benchmarks/quality.md``), 10-step windows, seeds 0 and 1: the drift was 14.5% and
16.6% at step 20, 6.0% and 3.2% at 40, 2.5% and 3.3% at 60, 2.1% and 1.4% at 80, and
``onebit_adam`` frozen there ended +29.5% (seed 0), +5.9%/+9.6%, +2.5%/+6.4% and +0.4%/+2.8% in
perplexity against ``allreduce``. The default threshold, 3%, set from these two seeds of one model,
flags every freeze before step 60 on both; the figure is noisy at that level (3.2%, 4.0%, 3.3% at
steps 40-60 of seed 1). On LitGPT's pythia-14m (beta2 0.95) it was 32.6% at step 20, 9.9% at 40 and
6.6% at 50 and 60.

Cost: one float per tensor, copied ``window`` steps before the freeze, and one transfer of a float
per tensor to the host at the copy and at the freeze; nothing on the other steps. Every rank holds
the same variance before a freeze (the gradients were averaged in fp32 and every rank took the same
Adam step), so every rank measures the same figure; the delay is still agreed (rank 0's decision)
so that no rank freezes alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer


def check_settling_args(threshold: float | None, window: int, max_delay: int | None = None) -> None:
    """Construction-time checks, naming the argument and what it takes."""
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf
    ):
        raise ValueError(
            "settling_warning must be a positive share (how far the tensors' scale of sqrt(v) may still drift"
            f" over the last settling_window steps before the freeze; 0.03 is 3%) or None (no check), got {threshold!r}"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"settling_window must be an int >= 1 (optimizer steps), got {window!r}")
    if max_delay is not None and (isinstance(max_delay, bool) or not isinstance(max_delay, int) or max_delay < 0):
        raise ValueError(
            "delay_freeze must be an int >= 0 (the most optimizer steps the freeze may move later while"
            f" sqrt(v) still drifts more than settling_warning; 0: never), got {max_delay!r}"
        )


def _second_moments(
    optimizer: Optimizer | Sequence[Optimizer], params: Sequence[torch.nn.Parameter]
) -> list[tuple[Tensor, float]]:
    """``(v, 1 / sqrt(1 - beta2 ** step))`` for each of ``params`` that has Adam state, in order: the
    second moment and the factor that bias-corrects its square root. ``optimizer``: one, or every
    optimizer of the run (in their order), so that a figure taken at one optimizer's step and one taken
    at another's compare the same tensors."""
    wanted = {id(p) for p in params}
    out = []
    for opt in [optimizer] if isinstance(optimizer, Optimizer) else optimizer:
        for group in opt.param_groups:
            b2 = group["betas"][1]
            for p in group["params"]:
                state = opt.state.get(p) if id(p) in wanted else None
                if state and "exp_avg_sq" in state:
                    out.append((state["exp_avg_sq"], 1 / math.sqrt(1 - b2 ** float(state["step"]))))
    return out


def variance_roots(optimizer: Optimizer, params: Sequence[torch.nn.Parameter]) -> list[Tensor]:
    """The bias-corrected ``sqrt(v)`` of each of ``params`` that has Adam state, in order (a copy of the
    whole second moment: ``benchmarks/variance_settling.py`` reads it; the check uses :func:`variance_sums`)."""
    moments = _second_moments(optimizer, params)
    if not moments:
        return []
    roots = torch._foreach_sqrt([v for v, _ in moments])
    torch._foreach_mul_(roots, [c for _, c in moments])
    return list(roots)


def variance_sums(optimizer: Optimizer | Sequence[Optimizer], params: Sequence[torch.nn.Parameter]) -> Tensor:
    """Per tensor of ``params`` with Adam state, the sum of its bias-corrected ``sqrt(v)`` (float32, one
    vector on the tensors' device). One tensor's ``sqrt(v)`` exists at a time: no copy of the whole
    second moment, whose size a large model cannot spare at the freeze."""
    sums = [v.sqrt().sum(dtype=torch.float32) * c for v, c in _second_moments(optimizer, params)]
    return torch.stack(sums) if sums else torch.zeros(0)


class VarianceSettling:
    """Measures the drift (see the module) at a freeze and warns, or (``max_delay > 0``) moves the
    freeze later by ``window`` steps at a time while it is above ``threshold``, at most
    ``max_delay`` steps in all.

    The strategy calls :meth:`observe` at the start of every optimizer step before the freeze
    (cheap: an integer comparison on all but two steps) and :meth:`decide` at the step the freeze
    is due; the effective freeze step is :attr:`freeze_at`.

    State (:meth:`state_dict`): the freeze step in force (it moved if delayed) and, between the
    copy and the freeze, the per-tensor sums copied, so that a run resumed in between measures the
    same figure.
    """

    def __init__(
        self,
        freeze_step: int,
        threshold: float | None = 0.03,
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
        self._snapshot: Tensor | None = None  # per tensor, the sum of r at the copy
        self._taken_at: int | None = None

    @property
    def active(self) -> bool:
        return self.threshold is not None

    def snapshot_step(self) -> int:
        """The completed optimizer steps after which the sums are copied (at least one step of history)."""
        return max(1, self.freeze_at - self.window)

    def due(self, steps: int) -> bool:
        """Whether the sums are copied at the start of the step after ``steps`` completed ones."""
        return self.active and steps == self.snapshot_step() and steps < self.freeze_at

    @torch.no_grad()
    def observe(
        self, steps: int, optimizer: Optimizer | Sequence[Optimizer], params: Sequence[torch.nn.Parameter]
    ) -> None:
        """At the start of a step that follows ``steps`` completed ones, before the freeze: the copy
        when it is due (the strategy may ask :meth:`due` first and skip listing ``params``)."""
        if self.due(steps):
            self._take(steps, optimizer, params)

    def _take(
        self, steps: int, optimizer: Optimizer | Sequence[Optimizer], params: Sequence[torch.nn.Parameter]
    ) -> None:
        self._snapshot = variance_sums(optimizer, params)
        self._taken_at = steps

    @torch.no_grad()
    def drift(self, optimizer: Optimizer | Sequence[Optimizer], params: Sequence[torch.nn.Parameter]) -> float | None:
        """The drift since the copy (``None`` without one); drops the copy."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            return None
        now = variance_sums(optimizer, params)
        if now.shape != snapshot.shape:
            return None
        moved, total = torch.stack([(now - snapshot.to(now.device)).abs().sum(), now.sum()]).tolist()
        return moved / total if total > 0 else math.inf

    def decide(
        self,
        steps: int,
        optimizer: Optimizer | Sequence[Optimizer],
        params: Sequence[torch.nn.Parameter],
        agree: Any = None,
    ) -> bool:
        """At the start of the step due to freeze (``steps == freeze_at`` completed): ``True`` to
        freeze now; ``False`` when the freeze moved ``window`` steps later (the sums copied again).
        ``agree(flag) -> flag``: rank 0's decision for every rank (``None``: a single process)."""
        taken_at = self._taken_at
        moved = self.drift(optimizer, params)
        self.last = moved
        over = moved is not None and self.threshold is not None and moved > self.threshold
        delay = over and self.freeze_at + self.window - self.planned <= self.max_delay
        if agree is not None and self.max_delay > 0:
            # every rank asks, whatever its own figure: a rank whose variance settled must not skip
            # the collective that one whose variance drifted enters (their moments can differ where a
            # rank's optimizer state is its own), and every rank follows rank 0
            delay = bool(agree(delay))
        if not over and not delay:
            return True
        span = steps - (taken_at if taken_at is not None else steps)
        if delay:
            self.freeze_at += self.window
            self._take(steps, optimizer, params)
            figure = "?" if moved is None else f"{moved:.1%}"  # rank 0's decision, this rank's figure
            rank_zero_info(
                f"{self.scheme}: the tensors' scale of sqrt(v) drifted {figure} over the last {span} optimizer"
                " steps, more than"
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
            f"{self.scheme}: {event} while the tensors' scale of sqrt(v) still drifted"
            f" {moved:.1%} over the last {span} steps, more than settling_warning={self.threshold}: the"
            f" frozen preconditioner misjudges the gradients' scale and the compressed run falls behind (on the"
            f" recipe's Transformer, freezes where it drifted 14.5% and 6.0% in 10 steps ended +29.5% and +5.9%"
            f" in perplexity against allreduce, 2.5% and 2.1% ended +2.5% and +0.4%). Take {advice};"
            " settling_warning=None silences this."
        )
        return True

    def tensors(self) -> list[Tensor]:
        """What it holds now (the copied sums, between their step and the freeze), for the memory accounting."""
        return [] if self._snapshot is None else [self._snapshot]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"freeze_at": self.freeze_at}
        if self._snapshot is not None:
            state["snapshot"] = self._snapshot.clone()
            state["taken_at"] = self._taken_at
        return state

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        self.freeze_at = int(state.get("freeze_at", self.planned))
        snapshot = state.get("snapshot")
        self._snapshot = None if snapshot is None else snapshot.to(device) if device else snapshot
        self._taken_at = state.get("taken_at")
