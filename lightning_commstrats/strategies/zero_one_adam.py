"""``zero_one_adam``: 0/1 Adam (Lu et al., 2022): Adam's variance updated on an exponentially sparser
schedule, the momentum exchanged in 1 bit with error feedback, and rounds skipped with local steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats.buckets import DEFAULT_BUCKET_CAP_MB
from lightning_commstrats.compression.exchange import GradientCompression
from lightning_commstrats.sharding import tensors_in
from lightning_commstrats.strategies.allreduce import AllReduceStrategy, dense_grad, trainable_params
from lightning_commstrats.strategies.base import DEFAULT_TIMEOUT
from lightning_commstrats.strategies.onebit_adam import (
    FrozenVarianceAdam,
    check_floor_args,
    clip_like_the_trainer,
    floors,
    refuse_grad_scaler,
    unsettled_rows,
    warn_unsettled,
)
from lightning_commstrats.strategies.settling import VarianceSettling


def _positive_int(name: str, value: Any, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 ({meaning}), got {value!r}")
    return value


class ZeroOneAdam:
    """The optimizer half of 0/1 Adam, on the user's own ``torch.optim.Adam``/``AdamW``: its two
    schedules, its step, and the state the step keeps between rounds. No communication here: the
    strategy averages what :meth:`prepare` leaves in the gradients, then calls :meth:`finish_step`.

    The schedules (steps ``t`` counted from 1; the settings are those DeepSpeed's ``ZeroOneAdam``
    documents):

    - ``T_v``, the steps that update the variance: every step at first, then every 2nd, 4th, ...:
      the interval doubles after every ``var_update_scaler`` (the paper's kappa) updates at it, and
      a step is in ``T_v`` when the interval divides ``t``. None after ``var_freeze_step``.
    - ``T_u``, the steps that synchronise: every step up to ``var_freeze_step``; after it, the steps
      that the local-step interval divides, the interval starting at 1 and doubling every
      ``local_step_scaler`` steps up to ``local_step_clipper`` (the paper's H).

    Per step ``t`` and parameter group (its ``lr`` read at every step: schedulers work; ``betas``,
    ``eps``, ``weight_decay``), with ``s_t = lr_t / (1 - b1^t)`` (``lr_t`` without bias correction)
    and ``d = sqrt(v / (1 - b2^n)) + eps`` for the ``n`` variance updates so far (``sqrt(v) + eps``
    without bias correction):

    - ``t`` in ``T_v``: the gradient averaged in fp32, ``g``; ``m = b1 m + (1 - b1) g``,
      ``v = b2 v + (1 - b2) g^2``, ``x = x - s_t m / d`` (Adam; the first ``var_update_scaler``
      steps are exactly Adam's).
    - otherwise, per rank ``i`` with its own gradient ``g_i``: ``m_i = b1 m + (1 - b1) g_i``,
      ``u_i = u_i + s_t m_i``, ``S = S + s_t``;

      - ``t`` in ``T_u``: ``u = average of u_i`` (the strategy: 1-bit, error feedback on the
        worker and the server), ``m = u / S``, ``x = x' - u / d`` from the weights ``x'`` of the
        last synchronisation; ``u_i = 0``, ``S = 0``;
      - else a local step: ``m = m_i``, ``x = x - s_t m_i / d`` (no communication).

    Weight decay: Adam's L2 term joins each rank's gradient; AdamW's decoupled decay multiplies the
    weights by ``1 - lr wd`` every step, and a synchronisation applies the interval's product of
    those factors to ``x'`` (the paper has no weight decay; DeepSpeed adds ``wd x`` to the update
    that accumulates in ``u``, preconditioned again at the synchronisation).

    State (:meth:`state_dict`, the same on every rank): ``S`` and the decay product per group,
    ``x'`` while an interval of local steps is open. Each rank's ``u_i`` is rank state
    (:meth:`rank_state_dict`). The schedules are functions of ``t``; Adam's ``exp_avg``,
    ``exp_avg_sq`` and ``step`` stay in the optimizer's state.
    """

    def __init__(
        self,
        var_freeze_step: int,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        bias_correction: bool = True,
        variance_floor: float = 0.1,
        compress_after_preconditioner: bool = True,
        floor_warning: float | None = 0.01,
    ) -> None:
        self.var_freeze_step = _positive_int(
            "var_freeze_step", var_freeze_step, "the last step that may update the variance; step 1 always does"
        )
        self.var_update_scaler = _positive_int(
            "var_update_scaler", var_update_scaler, "variance updates at each interval before it doubles"
        )
        self.local_step_scaler = _positive_int(
            "local_step_scaler",
            local_step_scaler,
            "steps after var_freeze_step between doublings of the local interval",
        )
        self.local_step_clipper = _positive_int(
            "local_step_clipper", local_step_clipper, "the longest interval between synchronisations, in steps"
        )
        if not isinstance(bias_correction, bool):
            raise ValueError(f"bias_correction must be True or False, got {bias_correction!r}")
        self.bias_correction = bias_correction
        self.variance_floor, self.compress_after_preconditioner, self.floor_warning = check_floor_args(
            variance_floor, compress_after_preconditioner, floor_warning
        )
        self.lr_sums: dict[int, float] = {}  # param group -> S, the sum of s_t since the last sync
        self.decays: dict[int, float] = {}  # param group -> the product of 1 - lr wd since the last sync
        self.anchor: dict[str, Tensor] = {}  # x', while local steps are open
        self.accum: dict[str, Tensor] = {}  # u_i (this rank's)
        self.open = False  # local steps taken since the last synchronisation
        self._pending: dict[int, tuple[float, float, bool]] = {}  # a synchronisation's s_t and decay
        self._denoms: dict[int, tuple[Any, list[Tensor]]] = {}  # param group -> (its key, d)

    # ------------------------------------------------------------------ the schedules

    def variance_updates(self, t: int) -> int:
        """How many of the steps ``1..t`` update the variance."""
        t = min(t, self.var_freeze_step)
        done, end, interval = 0, 0, 1
        while True:
            first = (end // interval + 1) * interval
            last = first + (self.var_update_scaler - 1) * interval
            if t < first:
                return done
            if t <= last:
                return done + (t - first) // interval + 1
            done, end, interval = done + self.var_update_scaler, last, interval * 2

    def first_compressed_step(self) -> int:
        """The first step that sends the momentum compressed (the first not in ``T_v``)."""
        t = 1
        while self.updates_variance(t):
            t += 1
        return t

    def updates_variance(self, t: int) -> bool:
        """Whether step ``t`` is in ``T_v``."""
        return self.variance_updates(t) > self.variance_updates(t - 1)

    def local_interval(self, t: int) -> int:
        """The local-step interval in force at step ``t``."""
        if t <= self.var_freeze_step:
            return 1
        doublings = (t - self.var_freeze_step - 1) // self.local_step_scaler
        return self.local_step_clipper if doublings >= 30 else min(self.local_step_clipper, 2**doublings)

    def syncs(self, t: int) -> bool:
        """Whether step ``t`` is in ``T_u``."""
        return t % self.local_interval(t) == 0

    def exchanges(self, t: int) -> str:
        """What step ``t`` sends: ``"fp32"`` (a variance step), ``"1-bit"`` or ``"nothing"``."""
        if self.updates_variance(t):
            return "fp32"
        return "1-bit" if self.syncs(t) else "nothing"

    # ------------------------------------------------------------------ the step

    @staticmethod
    def _groups(optimizer: Optimizer, params: Sequence[torch.nn.Parameter], names: Sequence[str]):
        wanted = {id(p): n for p, n in zip(params, names, strict=True)}
        for index, group in enumerate(optimizer.param_groups):
            ps = [p for p in group["params"] if id(p) in wanted]
            if ps:
                yield index, group, ps, [wanted[id(p)] for p in ps]

    @staticmethod
    def _state(optimizer: Optimizer, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = optimizer.state[p]
        if "exp_avg_sq" not in state:  # Adam's own layout, so that its checkpoints stay Adam's
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _factors(self, group: dict[str, Any], t: int) -> tuple[float, float, float]:
        """``(s_t, the variance's correction 1/sqrt(1 - b2^n), 1 - lr wd)`` for ``group`` at ``t``."""
        lr, (b1, b2), wd = float(group["lr"]), group["betas"], group["weight_decay"]
        decay = 1 - lr * wd if wd and group.get("decoupled_weight_decay", False) else 1.0
        if not self.bias_correction:
            return lr, 1.0, decay
        return lr / (1 - b1**t), 1 / math.sqrt(1 - b2 ** self.variance_updates(t)), decay

    def _denominators(
        self,
        index: int,
        group: dict[str, Any],
        states: list[dict[str, Any]],
        names: list[str],
        t: int,
        floored: bool = True,
    ) -> list[Tensor]:
        """``d = max(r, variance_floor * rms(r)) + eps`` with ``r = sqrt(v) * correction``, kept while ``v``
        and the correction do not change (between variance steps, and for good after ``var_freeze_step``):
        one copy of the weights. ``floored=False``: Adam's own, for the step that has just updated ``v``
        (a fresh variance needs no floor), not kept."""
        key = (self.variance_updates(t), group["eps"], tuple(names))
        cached = self._denoms.get(index)
        if floored and cached is not None and cached[0] == key:
            return cached[1]
        self._denoms.pop(index, None)  # its memory is free before the new one is made
        _, correction, _ = self._factors(group, t)
        denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        if correction != 1.0:
            torch._foreach_mul_(denom, correction)
        if floored and self.variance_floor > 0:
            torch._foreach_maximum_(denom, floors(denom, self.variance_floor))
        torch._foreach_add_(denom, group["eps"])
        if floored:
            self._denoms[index] = (key, denom)
        return denom

    @staticmethod
    def _l2(group: dict[str, Any], grads: list[Tensor], ps: list[Tensor]) -> None:
        if group["weight_decay"] and not group.get("decoupled_weight_decay", False):
            torch._foreach_add_(grads, ps, alpha=group["weight_decay"])

    @torch.no_grad()
    def variance_step(
        self, optimizer: Optimizer, params: Sequence[torch.nn.Parameter], names: Sequence[str], t: int
    ) -> None:
        """Step ``t`` of ``T_v`` on the averaged gradients the parameters hold (Adam's step)."""
        for index, group, ps, ns in self._groups(optimizer, params, names):
            s, _, decay = self._factors(group, t)
            b1, b2 = group["betas"]
            states = [self._state(optimizer, p, group) for p in ps]
            grads = [dense_grad(p) for p in ps]
            self._l2(group, grads, ps)
            moments = [st["exp_avg"] for st in states]
            torch._foreach_lerp_(moments, grads, 1 - b1)
            torch._foreach_mul_(variances := [st["exp_avg_sq"] for st in states], b2)
            torch._foreach_addcmul_(variances, grads, grads, value=1 - b2)
            torch._foreach_add_([st["step"] for st in states], 1)
            self._denoms.pop(index, None)  # v changed
            denom = self._denominators(index, group, states, ns, t, floored=False)
            if decay != 1.0:
                torch._foreach_mul_(ps, decay)
            torch._foreach_addcdiv_(ps, moments, denom, value=-s)
            for p in ps:
                p.grad = None

    @torch.no_grad()
    def report_floor(
        self, optimizer: Optimizer, params: Sequence[torch.nn.Parameter], names: Sequence[str], scheme: str
    ) -> None:
        """After ``var_freeze_step``: warn when more than ``floor_warning`` of the values never had a gradient."""
        if self.floor_warning is None:
            return
        rows: list[tuple[str, int, int, int]] = []
        t = self.var_freeze_step
        for _, group, ps, ns in self._groups(optimizer, params, names):
            states = [self._state(optimizer, p, group) for p in ps]
            roots = torch._foreach_sqrt([st["exp_avg_sq"] for st in states])
            torch._foreach_mul_(roots, self._factors(group, t)[1])
            rows += unsettled_rows(ns, roots, self.variance_floor)
        warn_unsettled(scheme, rows, t, self.variance_floor, self.floor_warning, "var_freeze_step")

    def _open(self, ps: list[Tensor], ns: list[str]) -> None:
        """Keep ``x'`` of the tensors that have none in the interval (all of them when it opens; a
        tensor made trainable inside it, whose weights no rank has moved, joins at its value)."""
        fresh = {n for n in ns if n not in self.anchor}
        for p, n in zip(ps, ns, strict=True):
            if n in fresh:
                self.anchor[n] = p.detach().clone()
                self.accum[n] = torch.zeros_like(p)
        if not self.open:
            kept = [(p, n) for p, n in zip(ps, ns, strict=True) if n not in fresh]
            if kept:
                torch._foreach_copy_([self.anchor[n] for _, n in kept], [p for p, _ in kept])
                torch._foreach_zero_([self.accum[n] for _, n in kept])

    @torch.no_grad()
    def prepare(self, optimizer: Optimizer, params: Sequence[torch.nn.Parameter], names: Sequence[str], t: int) -> bool:
        """A step ``t`` outside ``T_v``: this rank's momentum ``m_i`` from its gradient. A local step
        (``t`` not in ``T_u``) is taken here and False returned; for a synchronisation the gradients
        are left holding ``u_i`` (to be averaged in place), nothing else changes until
        :meth:`synchronize` (or :meth:`abandon`), and True is returned."""
        sync = self.syncs(t)
        self._pending = {}
        for index, group, ps, ns in self._groups(optimizer, params, names):
            s, _, decay = self._factors(group, t)
            b1 = group["betas"][0]
            states = [self._state(optimizer, p, group) for p in ps]
            grads = [dense_grad(p) for p in ps]
            self._l2(group, grads, ps)
            moments = [st["exp_avg"] for st in states]
            denom = self._denominators(index, group, states, ns, t)
            if sync:
                torch._foreach_lerp_(grads, moments, b1)  # m_i = g_i + b1 (m - g_i), in the gradient
                torch._foreach_mul_(grads, s)
                if self.compress_after_preconditioner:
                    torch._foreach_div_(grads, denom)
                if self.open:
                    torch._foreach_add_(grads, [self.accum[n] for n in ns])
                self._pending[index] = (s, decay, True)
                continue
            self._open(ps, ns)
            torch._foreach_lerp_(moments, grads, 1 - b1)  # m = m_i
            torch._foreach_add_([st["step"] for st in states], 1)
            if self.compress_after_preconditioner:  # u_i in the units of the step (d is fixed in an interval)
                torch._foreach_addcdiv_([self.accum[n] for n in ns], moments, denom, value=s)
            else:
                torch._foreach_add_([self.accum[n] for n in ns], moments, alpha=s)
            self.lr_sums[index] = self.lr_sums.get(index, 0.0) + s
            self.decays[index] = self.decays.get(index, 1.0) * decay
            if decay != 1.0:
                torch._foreach_mul_(ps, decay)
            torch._foreach_addcdiv_(ps, moments, denom, value=-s)
            for p in ps:
                p.grad = None
        if not sync:
            self.open = True
        return sync

    @torch.no_grad()
    def synchronize(
        self, optimizer: Optimizer, params: Sequence[torch.nn.Parameter], names: Sequence[str], t: int
    ) -> None:
        """The end of a synchronisation at step ``t``: the gradients hold the average ``u``."""
        for index, group, ps, ns in self._groups(optimizer, params, names):
            s, decay, counts = self._pending.pop(index, (0.0, 1.0, False))
            total = self.lr_sums.pop(index, 0.0) + s
            decay *= self.decays.pop(index, 1.0)
            states = [self._state(optimizer, p, group) for p in ps]
            if counts:
                torch._foreach_add_([st["step"] for st in states], 1)
            averaged = [p.grad for p in ps]
            torch._foreach_copy_(moments := [st["exp_avg"] for st in states], averaged)
            torch._foreach_div_(moments, total)
            denom = self._denominators(index, group, states, ns, t)
            if self.compress_after_preconditioner:  # the average is u / d: m = (u / d) d / S
                torch._foreach_mul_(moments, denom)
            if self.open:
                torch._foreach_copy_(ps, [self.anchor[n] for n in ns])
            if decay != 1.0:
                torch._foreach_mul_(ps, decay)
            if self.compress_after_preconditioner:
                torch._foreach_sub_(ps, averaged)
            else:
                torch._foreach_addcdiv_(ps, averaged, denom, value=-1.0)
            for p in ps:
                p.grad = None
        self._pending = {}
        self.open = False

    @torch.no_grad()
    def abandon(self, optimizer: Optimizer, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
        """A synchronisation whose average is not finite, skipped: the interval's local steps are
        dropped (every rank back to ``x'``, the same everywhere) and, where local steps moved it, the
        momentum restarts at zero; the step counts stay those of the last step that ran."""
        self._pending = {}
        if not self.open:
            return
        for _, group, ps, ns in self._groups(optimizer, params, names):
            states = [self._state(optimizer, p, group) for p in ps]
            torch._foreach_copy_(ps, [self.anchor[n] for n in ns])
            torch._foreach_zero_([st["exp_avg"] for st in states])
            torch._foreach_zero_([self.accum[n] for n in ns])
        self.lr_sums.clear()
        self.decays.clear()
        self.open = False

    def load_accumulated(self, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
        """Put ``u_i`` in the gradients for a synchronisation without a new gradient (the end of fit)."""
        self._pending = {}
        for p, n in zip(params, names, strict=True):
            # u_i itself: the exchange averages it in place, and the round that follows closes the
            # interval (the next one zeroes it), so no copy is needed
            p.grad = self.accum[n] if n in self.accum else torch.zeros_like(p)

    def reset(self) -> None:
        """Start afresh: no interval open, ``x'``, ``u_i`` and the cached preconditioner dropped
        (rebuilt when needed)."""
        self.anchor.clear()
        self.accum.clear()
        self._denoms.clear()
        self.lr_sums.clear()
        self.decays.clear()
        self._pending = {}
        self.open = False

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr_sums": dict(self.lr_sums),
            "decays": dict(self.decays),
            "open": self.open,
            "anchor": dict(self.anchor) if self.open else {},  # references: the checkpoint copies them
        }

    def rank_state_dict(self) -> dict[str, Any]:
        units = "preconditioned" if self.compress_after_preconditioner else "momentum"
        return {"accum": dict(self.accum) if self.open else {}, "accum_units": units}

    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any], device: torch.device) -> None:
        self.lr_sums = {int(k): float(v) for k, v in state.get("lr_sums", {}).items()}
        self.decays = {int(k): float(v) for k, v in state.get("decays", {}).items()}
        self.open = bool(state.get("open", False))
        self.anchor = {n: t.to(device) for n, t in state.get("anchor", {}).items()}
        self.accum = {n: t.to(device) for n, t in rank_state.get("accum", {}).items()}
        units = "preconditioned" if self.compress_after_preconditioner else "momentum"
        saved_units = rank_state.get("accum_units", "momentum")  # before the floor: the momentum's units
        if self.open and self.accum and saved_units != units:
            raise ValueError(
                f"it was saved inside an interval of local steps, its accumulated momentum in {saved_units!r} units,"
                f" this run keeps it in {units!r} units (compress_after_preconditioner="
                f"{self.compress_after_preconditioner}): resume with the other setting, or from a checkpoint at a"
                " synchronisation"
            )
        if self.open and set(self.accum) != set(self.anchor):
            raise ValueError("its accumulated momentum and its weights at the last synchronisation name other tensors")


class ZeroOneAdamStrategy(AllReduceStrategy):
    """0/1 Adam: the user's Adam (or AdamW) with its variance updated on an exponentially sparser
    schedule, the momentum exchanged in 1 bit with error feedback in between, and, once the variance
    is no longer updated, rounds skipped with local steps (the momentum accumulated and synchronised
    every 2, 4, ... up to ``local_step_clipper`` steps).

    What it adds to ``onebit_adam``: no fixed warm-up in fp32 (the variance is updated, in an fp32
    round, at each of the first 16 steps, then at every 2nd step for 16 updates, every 4th for 16
    more, ...; the other steps send the momentum in 1 bit), and local steps that skip rounds. The
    paper (BERT, GPT-2, ImageNet on up to 128 GPUs) reports up to 87% less volume and 54% fewer
    rounds than 1-bit Adam at the same accuracy.

    Each step (see :class:`ZeroOneAdam` for the equations):

    1. a step of ``T_v`` (the variance's schedule): the gradients averaged in fp32, Adam's step;
    2. otherwise each rank's momentum from its own gradient, accumulated (scaled by the step's
       learning rate) into ``u_i``;
    3. a step of ``T_u`` (every step up to ``var_freeze_step``, then every ``interval``): ``u_i``
       averaged through the package's two-stage 1-bit all-reduce (stage 1: ``u_i`` plus this
       rank's residual quantized, stripes to their owners; stage 2: the owner quantizes the sum with
       its own residual and all-gathers), the momentum becomes ``u / S`` and the weights
       ``x' - u / d`` from the last synchronisation's ``x'``: every rank the same again;
    4. any other step is local: ``x -= s_t m_i / d``, nothing sent.

    Tensors of at most ``small_tensor_numel`` values and 1-D ones carry ``u`` in fp32. When fit
    ends inside an interval of local steps, the ranks synchronise once more (every rank ends with
    the same model). Validation inside an interval sees each rank's own weights.

    Where it differs from DeepSpeed's ``ZeroOneAdam`` (which the settings follow): the schedules
    count the documented way (no variance update after ``var_freeze_step``, local steps from the
    next step; DeepSpeed's first call only allocates its buffers and does not step); before
    ``var_freeze_step`` the momentum (``u_i = s_t m_i``) travels in 1 bit as the paper's algorithm
    has it, where DeepSpeed sends the gradient; torch's bias correction by default (``m`` by
    ``1 - b1^t``, ``v`` by ``1 - b2^n`` for its ``n`` updates; ``bias_correction=False`` is the
    paper's step); AdamW's decay as described in :class:`ZeroOneAdam`; ``x'`` kept as a copy, so
    that the ranks' weights after a synchronisation are identical to the bit (undoing the local
    steps in place, as DeepSpeed does, leaves each rank its own rounding); the error-feedback
    residuals carry over when local steps begin (they are in the units of ``u`` throughout; DeepSpeed
    zeroes them there, its earlier ones being a gradient's). As DeepSpeed, a ``T_v`` step updates
    ``m`` from the fp32 average and takes the step with the ``v`` it has just updated (Adam's order).
    A synchronisation whose average is not finite (``nonfinite="skip"``) drops its interval: every
    rank returns to ``x'`` and the momentum restarts at zero.

    Where it departs from the paper (and DeepSpeed) for values whose variance has not settled (an
    LM's vocabulary rows that no token has used yet; measured: a Transformer LM whose vocabulary has
    such rows ended 25-40% worse than ``allreduce`` in loss, the rows moved by hundreds per step at lr
    0.01): each rank sends ``u_i / d``, not ``u_i``, and ``d`` has a floor of ``variance_floor`` times
    its tensor's RMS, as ``onebit_adam`` (the derivation is in
    :class:`~lightning_commstrats.strategies.onebit_adam.FrozenVarianceAdam`). Between two variance
    steps and through an interval of local steps ``d`` is fixed, so ``u_i / d`` is the interval's
    sum of steps; the error-feedback residuals are in those units and carry over a variance step
    (``d`` moves little between them). The bytes are the paper's. Right after ``var_freeze_step``
    it warns (``floor_warning``) when more than 1% of the values never had a gradient. At its first
    compressed step (``var_update_scaler + 1`` unless ``var_freeze_step`` comes first) it warns when
    the tensors' scale of ``sqrt(v)`` still drifted more than ``settling_warning`` (3%) over the last
    ``settling_window`` steps (:mod:`~lightning_commstrats.strategies.settling`): the momentum goes
    out in 1 bit before the variance settled (measured at the default 16: 8.7-11.7% behind
    ``allreduce`` on a Transformer LM).

    Memory: the preconditioner ``d`` kept while ``v`` is unchanged (one copy of the weights), and
    after ``var_freeze_step``, with an interval above 1, two more (``x'`` and ``u_i``), plus the
    residuals (as ``onebit_adam``).

    Bytes per rank: a ``T_v`` step is ``allreduce``'s; a 1-bit step about 1/32 of it; a local step
    none. Before ``var_freeze_step`` about ``16 log2(1 + t / 16)`` of the first ``t`` steps send
    fp32 (59 of 200).

    Tuning: ``var_freeze_step`` where the learning rate's warm-up ends (DeepSpeed: "does not require
    tuning"), or 15-25% of a run without warm-up; ``var_update_scaler`` at least the steps the variance
    needs to settle, since every step after the first ``var_update_scaler`` that does not update the
    variance sends the momentum in 1 bit (on a Transformer LM with a tied 10k-word vocabulary, 100
    steps, two seeds: the default 16 was 8.7-11.7% behind ``allreduce`` in perplexity whatever
    ``var_freeze_step``, 64 with ``var_freeze_step=60`` as close as ``onebit_adam`` frozen at 60,
    ``docs/benchmarks/quality.md``); ``local_step_scaler`` so that the interval reaches
    ``local_step_clipper`` well before the end (DeepSpeed's 32678 is for runs of hundreds of
    thousands of steps); ``local_step_clipper`` 16 (the paper's H), lower if the model drifts apart
    between rounds (many ranks, a high learning rate).

    Reference: Y. Lu, C. Li, M. Zhang, C. De Sa, Y. He, "Maximizing Communication Efficiency for
    Large-scale Training via 0/1 Adam", ICLR 2023 (arXiv 2202.06009).

    Args:
        var_freeze_step: the last step that may update the variance (>= 1).
        var_update_scaler: variance updates at each interval before it doubles (kappa, 16).
        local_step_scaler: steps after ``var_freeze_step`` between doublings of the local interval.
        local_step_clipper: the longest interval between synchronisations (H, 16; 1: no local steps).
        num_quantization_bits: bits per value of ``u`` (1, 2, 4, 8, 16 or 32).
        bias_correction: torch's bias correction (default) or the paper's step without it.
        variance_floor: the least ``sqrt(v)`` in the preconditioner, as a share of its tensor's RMS,
            in ``[0, 1)`` (0.1; 0 is the paper's).
        compress_after_preconditioner: send ``u_i / d`` (default) or ``u_i`` (the paper's).
        floor_warning: warn after ``var_freeze_step`` when more than this share of the values never
            had a gradient (0.01); ``None``: never.
        settling_warning: warn at the first compressed step when the tensors' scale of ``sqrt(v)``
            drifted more than this share over the last ``settling_window`` steps (0.03); ``None``: no check.
        settling_window: the optimizer steps the settling figure spans (10).
        small_tensor_numel: tensors this small (or 1-D) carry ``u`` in fp32.
        half_dtype: the 16-bit format.
        residuals: where the error-feedback residuals (the compressed exchange's, both stages, and with
            ``slow_hop_bits`` the slow hop's) wait between steps: ``"device"`` (default) or ``"host"``,
            pinned on CUDA, as :class:`~lightning_commstrats.strategies.onebit_sgd.OneBitSGDStrategy`'s;
            the results are bit for bit those of ``"device"``.
        bucket_cap_mb, backend, timeout, start_method: as :class:`AllReduceStrategy`.
        **kwargs: as :class:`AllReduceStrategy`.

    Example::

        strategy = lightning_commstrats.ZeroOneAdamStrategy(var_freeze_step=200, local_step_scaler=50)
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy)
    """

    strategy_name = "zero_one_adam"
    supports_shard = False

    def __init__(
        self,
        var_freeze_step: int = 400,
        var_update_scaler: int = 16,
        local_step_scaler: int = 100,
        local_step_clipper: int = 16,
        num_quantization_bits: int = 1,
        bias_correction: bool = True,
        variance_floor: float = 0.1,
        compress_after_preconditioner: bool = True,
        floor_warning: float | None = 0.01,
        settling_warning: float | None = 0.03,
        settling_window: int = 10,
        small_tensor_numel: int = 1024,
        half_dtype: str = "float16",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        backend: str = "auto",
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        residuals: str = "device",
        **kwargs: Any,
    ) -> None:
        adam = ZeroOneAdam(
            var_freeze_step,
            var_update_scaler,
            local_step_scaler,
            local_step_clipper,
            bias_correction,
            variance_floor,
            compress_after_preconditioner,
            floor_warning,
        )
        first = adam.first_compressed_step()
        setting = "var_update_scaler" if first <= adam.var_freeze_step else "var_freeze_step"
        settling = VarianceSettling(
            first - 1, settling_warning, settling_window, scheme="zero_one_adam", setting=setting
        )
        compression = GradientCompression(
            num_quantization_bits, 0, "steps", small_tensor_numel, half_dtype, residuals=residuals
        )
        super().__init__(
            bucket_cap_mb=bucket_cap_mb,
            backend=backend,
            timeout=timeout,
            start_method=start_method,
            residuals=residuals,  # the slow hop's (the reducer's, connected at setup)
            **kwargs,
        )
        self.adam = adam
        self.settling = settling
        self.compression = compression

    @property
    def var_freeze_step(self) -> int:
        return self.adam.var_freeze_step

    @property
    def num_quantization_bits(self) -> int:
        return self.compression.bits

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"zero_one_adam steps one Adam (its schedules count that optimizer's steps); configure_optimizers"
                f" returned {len(self.optimizers)} optimizers"
            )
        FrozenVarianceAdam.check_optimizer(self.optimizers[0], "zero_one_adam")
        refuse_grad_scaler(self, "zero_one_adam")

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # under Fabric no Trainer knows the run's length (the module's trainer shim raises): no warning
        total = getattr(self.trainer, "estimated_stepping_batches", None) if self.trainer is not None else None
        if isinstance(total, (int, float)) and math.isfinite(total) and total <= self.var_freeze_step:
            rank_zero_warn(
                f"zero_one_adam: this fit has {int(total)} optimizer steps and var_freeze_step={self.var_freeze_step}:"
                " it never takes a local step (its rounds are all fp32 or 1-bit). Pass a var_freeze_step of about"
                " 15-25% of the run, or where the learning rate's warm-up ends."
            )

    def _names(self, params: Sequence[torch.nn.Parameter]) -> list[str]:
        return [self.param_name(p) for p in params]

    def _own_weights(self) -> list[torch.nn.Parameter]:
        return trainable_params(self.optimizers[0])

    @override
    def after_backward(self, optimizer: Optimizer) -> None:
        t = self.optimizer_steps + 1
        params = trainable_params(optimizer)
        names = self._names(params)
        if t - 1 < self.settling.freeze_at:
            self.settling.observe(t - 1, optimizer, params)
        elif t - 1 == self.settling.freeze_at and self.settling.active:  # the first compressed step
            self.settling.decide(t - 1, optimizer, params)
        if self.adam.updates_variance(t):
            super().after_backward(optimizer)  # fp32 average
            clip_like_the_trainer(self, params)  # the step is taken here, before Lightning would clip
            if not self._nonfinite_names:
                self.adam.variance_step(optimizer, params, names, t)
            return
        if t > self.var_freeze_step and self.reducer.holds("grad"):
            self.reducer.release("grad")  # no fp32 round is left
        if t == self.var_freeze_step + 1:  # the variance is final: how much of it had settled
            self.adam.report_floor(optimizer, params, names, "zero_one_adam")
        clip_like_the_trainer(self, params)
        if not self.adam.prepare(optimizer, params, names, t):
            return  # a local step, taken
        if self.world_size > 1:
            self.exchange_compressed(self.compression, params)  # u, averaged in place
        if self._nonfinite_names:  # the nonfinite policy raises, or skips the step: without the interval
            self.adam.abandon(optimizer, params, names)
        else:
            self.adam.synchronize(optimizer, params, names, t)

    @override
    def on_train_end(self) -> None:
        # Fit ends inside an interval of local steps: one more synchronisation, so that every rank
        # ends with the same model (after the callbacks' on_train_end, which Lightning calls first).
        if self.adam.open:
            optimizer = self.optimizers[0]
            params = trainable_params(optimizer)
            names = self._names(params)
            self.adam.load_accumulated(params, names)
            self._nonfinite_names = []
            if self.world_size > 1:
                self.exchange_compressed(self.compression, params)
            # the sync's residuals kept only with a sync that counts, as at a step's vote (unsharded:
            # every rank holds the same averages, so every rank decides alike)
            self.reducer.discard() if self._nonfinite_names else self.reducer.commit()
            if self._nonfinite_names:
                self.adam.abandon(optimizer, params, names)
                rank_zero_warn(
                    "zero_one_adam: the last synchronisation of fit was not finite; every rank ends at the"
                    " weights of the one before (the last interval's local steps are dropped)"
                )
            else:
                self.adam.synchronize(optimizer, params, names, self.optimizer_steps)
            self.comm_stats.extend_last_step()  # the end-of-fit sync belongs to the last step
        super().on_train_end()

    @override
    def scheme_tensors(self) -> list[Tensor]:
        # the quantized exchange's (AllReduceStrategy), x', u_i and the cached preconditioner
        held = [self.adam.anchor, self.adam.accum, [denom for _, denom in self.adam._denoms.values()]]
        return super().scheme_tensors() + tensors_in(held)

    # ------------------------------------------------------------------ checkpointed state
    # Inside an interval of local steps each rank's weights and momentum are its own: they travel
    # in its rank state with u_i (the checkpoint's model and optimizer are rank 0's).

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "zero_one_adam": self.adam.state_dict(), "settling": self.settling.state_dict()}

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        own = self.adam.rank_state_dict()
        if self.adam.open:
            own["weights"] = {self.param_name(p): p.detach() for p in self._own_weights()}
            own["optimizers"] = [opt.state_dict() for opt in self.optimizers]
        return {"compression": self.compression.state_dict(), "zero_one_adam": own}

    @override
    def resharded_rank_state(
        self, state: dict[str, Any], rank_state: dict[str, Any] | None, saved_world_size: int
    ) -> dict[str, Any]:
        if (state.get("zero_one_adam") or {}).get("open"):
            raise ValueError(
                "it was saved inside an interval of local steps, where each rank's weights and momentum are its"
                f" own: it resumes on its {saved_world_size} ranks only (or from a checkpoint at a synchronisation)"
            )
        return super().resharded_rank_state(state, rank_state, saved_world_size)

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        residuals = rank_state.get("compression") or {}
        self.check_compression_state(self.compression, residuals)
        own = rank_state.get("zero_one_adam") or {}
        saved = state.get("zero_one_adam", {})
        if saved.get("open"):  # checked before anything changes
            names = set(self._names(self._own_weights()))
            if set(own.get("weights", {})) != names or set(saved.get("anchor", {})) - names:
                raise ValueError(
                    "it was saved inside an interval of local steps and does not hold this rank's own weights of"
                    " this model's trainable tensors"
                )
        super().load_state_dict(state, rank_state)
        self.adam.load_state_dict(saved, own, self.root_device)
        self.settling.load_state_dict(state.get("settling", {}), self.root_device)
        self.bind_compression(self.compression).load_state_dict(residuals)
        if self.adam.open:
            with torch.no_grad():
                for p in self._own_weights():
                    p.copy_(own["weights"][self.param_name(p)])
            for optimizer, opt_state in zip(self.optimizers, own["optimizers"], strict=True):
                for per_param in opt_state["state"].values():  # torch keeps step counts on the host
                    if "step" in per_param and not optimizer.defaults.get("fused"):
                        per_param["step"] = per_param["step"].cpu()
                optimizer.load_state_dict(opt_state)

    @override
    def reset_state(self) -> None:
        if self.compression.exchange is not None:
            self.compression.exchange.reset()
        self.adam.reset()
