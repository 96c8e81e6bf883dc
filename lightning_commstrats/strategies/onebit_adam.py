"""``onebit_adam``: 1-bit Adam (Tang et al., ICML 2021): Adam's variance frozen after a warm-up,
then the momentum, not the gradient, exchanged in 1 bit with error feedback on both stages."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Adam, Optimizer
from typing_extensions import override

from lightning_commstrats.buckets import DEFAULT_BUCKET_CAP_MB
from lightning_commstrats.compression.exchange import GradientCompression
from lightning_commstrats.strategies.allreduce import AllReduceStrategy, dense_grad, trainable_params
from lightning_commstrats.strategies.base import DEFAULT_TIMEOUT
from lightning_commstrats.strategies.settling import VarianceSettling


class FrozenVarianceAdam:
    """The optimizer half of 1-bit Adam, on the user's own ``torch.optim.Adam``/``AdamW``: after
    ``freeze_step`` full-precision steps it takes over the step. No communication here: the
    strategy averages what :meth:`local_momentum` leaves in the gradients, then calls :meth:`step`.

    Per parameter group (its ``lr`` read at every step, so schedulers keep working; its ``betas``,
    ``eps``, ``weight_decay``), with ``t`` the optimizer's step count, ``T`` the step count at
    which the variance was frozen, and ``d`` the frozen preconditioner::

        r    = sqrt(v_T / (1 - b2^T))             (per value; sqrt(v_T) without bias correction)
        d    = max(r, variance_floor * sqrt(mean of r^2 over the tensor)) + eps
        g_i  = g_i + wd * x                       (Adam's L2 weight decay; not for AdamW)
        m_i  = b1 * m + (1 - b1) * g_i            (this rank's momentum; m is the last average)
        p    = average over ranks of m_i / d      (the strategy: 1-bit, error feedback)
        m    = p * d
        x    = x * (1 - lr * wd)                  (AdamW's decoupled weight decay)
        x    = x - lr / (1 - b1^t) * p

    that is torch's Adam step with the variance ``v_T`` of the freeze and without its update,
    except in two places, both for values whose variance had not settled at the freeze (measured
    on a Transformer LM whose vocabulary has rows no token of the warm-up used: they ended 25%
    worse than ``allreduce`` in loss, their rows moved by about 300 per step at lr 0.01):

    - **What is compressed.** The paper compresses the momentum ``m_i`` and divides the average by
      ``d``; the 1-bit code gives every value of a column (of the ``[shape[0], rest]`` view) one of
      the column's two means, so a value whose ``v_T`` is zero (an embedding row never used) or
      tiny receives a momentum of the column's scale ``c`` and steps by ``lr c / eps``: error
      feedback bounds the sum of the errors in ``m``, not their quotient by a tiny ``d``. Here
      each rank sends the preconditioned momentum ``m_i / d`` (``compress_after_preconditioner``):
      ``d`` is the same on every rank and fixed after the freeze, so the average is the paper's
      ``m / d`` in exact arithmetic (and at ``num_quantization_bits=32``), with error feedback on
      the quantity that moves the weights; a value's error is then at most its column's scale of
      Adam-normalised steps (order 1), not ``c / eps``. Bytes: the same tensors, the same code.
    - **The floor.** A value that gets its first gradient after the freeze (a token first seen
      later) has ``m / (sqrt(v_T) + eps)`` of order ``g / eps`` under the paper's update, at any
      number of bits. ``d`` is therefore at least ``variance_floor`` (0.1) times its tensor's
      RMS of ``r``: such a value steps as momentum SGD at the tensor's typical scale; with
      ``b1 = 0.9`` its first step, ``(1 - b1) g / (0.1 rms)``, is about ``lr`` for a gradient of
      the tensor's typical size, where Adam's own first step of a new value is ``lr (1 - b1) /
      sqrt(1 - b2)`` (``3.2 lr``). Values above the floor are untouched.

    ``variance_floor=0`` with ``compress_after_preconditioner=False`` is the paper's update.

    The paper's algorithm has no bias correction (``bias_correction=False`` follows it: ``lr * m /
    (sqrt(v_T) + eps)``); keeping torch's makes the first frozen step continue the warm-up's
    (at ``T = 100`` and ``b2 = 0.999`` the paper's form would step 3.2 times larger at once).

    State (:meth:`state_dict`): the step count at which each parameter's variance was frozen; the
    momentum and variance stay in the optimizer's own state (``exp_avg``, ``exp_avg_sq``).
    """

    def __init__(
        self,
        freeze_step: int,
        bias_correction: bool = True,
        variance_floor: float = 0.1,
        compress_after_preconditioner: bool = True,
        floor_warning: float | None = 0.01,
        scheme: str = "onebit_adam",
    ) -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(
                f"freeze_step must be an int >= 1 (the full-precision Adam steps before the variance is frozen:"
                f" the frozen variance must be positive), got {freeze_step!r}"
            )
        if not isinstance(bias_correction, bool):
            raise ValueError(f"bias_correction must be True or False, got {bias_correction!r}")
        self.bias_correction = bias_correction
        self.freeze_step = freeze_step
        self.variance_floor, self.compress_after_preconditioner, self.floor_warning = check_floor_args(
            variance_floor, compress_after_preconditioner, floor_warning
        )
        self.scheme = scheme
        self.frozen_at: dict[str, int] = {}  # parameter name -> optimizer step count at the freeze
        self._denoms: list[Tensor] = []  # d of the step in progress (from local_momentum to step)

    @staticmethod
    def check_optimizer(optimizer: Optimizer, scheme: str = "onebit_adam") -> None:
        """Raise ``ValueError`` unless ``optimizer`` is an Adam this class can continue."""
        if not isinstance(optimizer, Adam):
            raise ValueError(
                f"{scheme} needs torch.optim.Adam or torch.optim.AdamW from configure_optimizers,"
                f" got {type(optimizer).__name__} (for SGD-style optimizers use onebit_sgd)"
            )
        for i, group in enumerate(optimizer.param_groups):
            for key in ("amsgrad", "maximize", "differentiable", "capturable"):
                if group.get(key):
                    raise ValueError(
                        f"{scheme} continues Adam with its variance frozen, which has no {key}=True form:"
                        f" param group {i} of {type(optimizer).__name__} sets it"
                    )

    @torch.no_grad()
    def local_momentum(self, optimizer: Optimizer, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
        """Write this rank's momentum ``m_i`` (divided by ``d`` with ``compress_after_preconditioner``)
        into each parameter's gradient (in place)."""
        wanted = {id(p): n for p, n in zip(params, names, strict=True)}
        self._denoms = []
        unsettled, steps = [], 0
        for group in optimizer.param_groups:
            ps = [p for p in group["params"] if id(p) in wanted]
            if not ps:
                continue
            grads = [dense_grad(p) for p in ps]
            if group["weight_decay"] and not group.get("decoupled_weight_decay", False):
                torch._foreach_add_(grads, ps, alpha=group["weight_decay"])
            states = [self._state(optimizer, p) for p in ps]
            torch._foreach_lerp_(grads, [s["exp_avg"] for s in states], group["betas"][0])  # g + b1 (m - g)
            counts = [int(s["step"]) for s in states]
            frozen = [self.frozen_at.setdefault(wanted[id(p)], c) for p, c in zip(ps, counts, strict=True)]
            fresh = [wanted[id(p)] for p, c, f in zip(ps, counts, frozen, strict=True) if c == f]
            denom = self._preconditioner(group, states, frozen)
            if fresh:
                unsettled += self._report_floor(fresh, [wanted[id(p)] for p in ps], states, frozen, group)
                steps = max(steps, *frozen)
            if self.compress_after_preconditioner:
                torch._foreach_div_(grads, denom)
            self._denoms.append(denom)
        if unsettled and self.floor_warning is not None:
            warn_unsettled(self.scheme, unsettled, steps, self.variance_floor, self.floor_warning, "freeze_step")

    def _corrections(self, group: dict[str, Any], frozen: Sequence[int]) -> list[float]:
        b2 = group["betas"][1]
        return [1 / math.sqrt(1 - b2**f) if self.bias_correction else 1.0 for f in frozen]

    def _preconditioner(
        self, group: dict[str, Any], states: list[dict[str, Any]], frozen: Sequence[int]
    ) -> list[Tensor]:
        """``d = max(r, variance_floor * rms(r)) + eps`` per tensor, ``r`` the bias-corrected ``sqrt(v_T)``."""
        denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_mul_(denom, self._corrections(group, frozen))
        if self.variance_floor > 0:
            torch._foreach_maximum_(denom, floors(denom, self.variance_floor))
        torch._foreach_add_(denom, group["eps"])
        return denom

    def _report_floor(
        self,
        fresh: Sequence[str],
        names: Sequence[str],
        states: list[dict[str, Any]],
        frozen: Sequence[int],
        group: dict[str, Any],
    ) -> list[tuple[str, int, int, int]]:
        """At the freeze: per tensor frozen now, its values under the floor and those that never had a gradient."""
        if self.floor_warning is None:
            return []
        roots = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_mul_(roots, self._corrections(group, frozen))
        return [r for r in unsettled_rows(names, roots, self.variance_floor) if r[0] in fresh]

    @torch.no_grad()
    def step(self, optimizer: Optimizer, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
        """The update with the averaged momentum, which the gradients hold; the gradients are then
        dropped, so that ``optimizer.step()`` (which Lightning calls next) steps over nothing."""
        wanted = {id(p): n for p, n in zip(params, names, strict=True)}
        for group in optimizer.param_groups:
            ps = [p for p in group["params"] if id(p) in wanted]
            if not ps:
                continue
            lr, b1, wd = group["lr"], group["betas"][0], group["weight_decay"]
            lr = float(lr)  # a tensor lr (torch allows one) is read once per step
            states = [self._state(optimizer, p) for p in ps]
            averaged = [p.grad for p in ps]
            torch._foreach_copy_(moments := [s["exp_avg"] for s in states], averaged)
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            # the counts on the host: one transfer for the group when the optimizer keeps them on the
            # device (fused), none when on the host (torch's default)
            counts = torch.stack(steps).tolist() if steps[0].is_cuda else [float(t) for t in steps]
            sizes, frozen = [], []
            for p, c in zip(ps, counts, strict=True):
                t = int(c)
                frozen.append(self.frozen_at.setdefault(wanted[id(p)], t - 1))
                sizes.append(-lr / (1 - b1**t) if self.bias_correction else -lr)
            # d as local_momentum made it (the same values: v and the floor are frozen)
            denom = self._denoms.pop(0) if self._denoms else self._preconditioner(group, states, frozen)
            if wd and group.get("decoupled_weight_decay", False):
                torch._foreach_mul_(ps, 1 - lr * wd)
            if self.compress_after_preconditioner:  # the average is m / d: m = p d, x -= s p
                torch._foreach_mul_(moments, denom)
                torch._foreach_mul_(averaged, sizes)
                torch._foreach_add_(ps, averaged)
            else:
                torch._foreach_addcdiv_(ps, moments, denom, sizes)
            for p in ps:
                p.grad = None
        self._denoms = []

    @staticmethod
    def _state(optimizer: Optimizer, p: Tensor) -> dict[str, Any]:
        state = optimizer.state.get(p)
        if not state or "exp_avg_sq" not in state:
            raise RuntimeError(
                "onebit_adam: a parameter has no Adam state at the freeze (the optimizer never stepped it"
                " during the warm-up): its variance cannot be frozen"
            )
        return state

    def state_dict(self) -> dict[str, Any]:
        return {"frozen_at": dict(self.frozen_at)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.frozen_at = {str(k): int(v) for k, v in state.get("frozen_at", {}).items()}


def check_floor_args(
    variance_floor: float, compress_after_preconditioner: bool, floor_warning: float | None
) -> tuple[float, bool, float | None]:
    """Construction-time checks of the frozen preconditioner's settings (both Adam schemes)."""
    if isinstance(variance_floor, bool) or not isinstance(variance_floor, (int, float)) or not 0 <= variance_floor < 1:
        raise ValueError(
            f"variance_floor must be a number in [0, 1) (the least frozen sqrt(v) as a share of its tensor's RMS;"
            f" 0: no floor, the paper's), got {variance_floor!r}"
        )
    if not isinstance(compress_after_preconditioner, bool):
        raise ValueError(f"compress_after_preconditioner must be True or False, got {compress_after_preconditioner!r}")
    if floor_warning is not None and (
        isinstance(floor_warning, bool) or not isinstance(floor_warning, (int, float)) or not 0 <= floor_warning <= 1
    ):
        raise ValueError(
            f"floor_warning must be a share in [0, 1] of the values with no gradient at the freeze above which it"
            f" warns, or None (never), got {floor_warning!r}"
        )
    return float(variance_floor), compress_after_preconditioner, None if floor_warning is None else float(floor_warning)


def floors(roots: Sequence[Tensor], variance_floor: float) -> list[Tensor]:
    """Per tensor, ``variance_floor`` times the RMS of its ``r = sqrt(v)`` (0-d tensors: no transfer to the host)."""
    return [r.square().mean().sqrt() * variance_floor for r in roots]


def unsettled_rows(
    names: Sequence[str], roots: Sequence[Tensor], variance_floor: float
) -> list[tuple[str, int, int, int]]:
    """``(name, values under the floor, values with r == 0, values)`` per tensor (one transfer to the host)."""
    if not roots:
        return []
    below = [(r < f).sum() for r, f in zip(roots, floors(roots, variance_floor), strict=True)]
    zero = [(r == 0).sum() for r in roots]
    counts = torch.stack(below + zero).tolist()
    n = len(roots)
    return [(name, int(counts[k]), int(counts[n + k]), roots[k].numel()) for k, name in enumerate(names)]


def warn_unsettled(
    scheme: str, rows: Sequence[tuple[str, int, int, int]], steps: int, floor: float, threshold: float, setting: str
) -> None:
    """Warn (rank 0) when more than ``threshold`` of the values never had a gradient at the freeze.

    ``rows``: ``(tensor name, values under the floor, values that never had a gradient, values)``.
    Values merely under the floor are not counted: a tied vocabulary's rare words and the query/key
    parts of fused weights sit there at any freeze (31-76% of the values on the recipe's Transformer,
    including runs within 2% of ``allreduce``), so their share does not tell an early freeze from a good
    one; the settling figure (:mod:`~lightning_commstrats.strategies.settling`) does that."""
    total = sum(r[3] for r in rows)
    never = sum(r[2] for r in rows)
    if not total or never <= threshold * total:
        return
    below = sum(r[1] for r in rows)
    worst = sorted((r for r in rows if r[2]), key=lambda r: -r[2])[:3]
    listed = ", ".join(f"{n} {z / v:.1%}" for n, _, z, v in worst)
    rank_zero_warn(
        f"{scheme}: the variance froze after {steps} optimizer steps with {never / total:.1%} of the values"
        f" ({never} of {total}) that never had a gradient: {listed}; {below} values in all under the floor of"
        f" variance_floor={floor} times their tensor's RMS. Rows no token of the warm-up used (an untied"
        " vocabulary's unseen words) have no variance to freeze: they step with the floored preconditioner"
        f" (momentum SGD at their tensor's typical scale), not Adam's. A later {setting} lets more of them be"
        " seen; floor_warning=None silences this."
    )


def refuse_grad_scaler(strategy: Any, scheme: str) -> None:
    """Refuse a precision plugin with torch's ``GradScaler`` (``precision="16-mixed"``): a scheme that
    takes Adam's step at the exchange steps on gradients the scaler has not unscaled yet, and
    ``scaler.step`` then finds no gradient it checked."""
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        raise ValueError(
            f"{scheme} takes Adam's step itself at the exchange, which torch's GradScaler"
            f" ({type(strategy.precision_plugin).__name__}, precision='16-mixed') cannot follow: use"
            " precision='bf16-mixed' or '32-true', or lightning_commstrats.LayeredMixedPrecision"
        )


def clip_like_the_trainer(strategy: Any, params: Sequence[torch.nn.Parameter]) -> None:
    """The Trainer's gradient clipping, applied now to the gradients ``params`` hold (Lightning clips
    after the exchange, which is too late for a scheme that takes its step at the exchange)."""
    module = strategy.lightning_module
    trainer = getattr(module, "_trainer", None) if module is not None else None
    value = getattr(trainer, "gradient_clip_val", None)
    if not value:
        return
    for p in params:
        dense_grad(p)
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    if str(getattr(algorithm, "value", algorithm)) == "value":
        torch.nn.utils.clip_grad_value_(params, float(value))
    else:
        torch.nn.utils.clip_grad_norm_(params, float(value))


class OneBitAdamStrategy(AllReduceStrategy):
    """1-bit Adam: the user's Adam (or AdamW) in full precision for ``freeze_step`` optimizer steps,
    then its variance frozen and its momentum averaged in 1 bit with error feedback on each rank
    and on each stripe's owner (the package's two-stage 1-bit all-reduce, as ``onebit_sgd``).

    Why not ``onebit_sgd`` with Adam: error feedback compensates what quantization loses of a
    linear update, and Adam's variance is not linear in the gradient: quantization noise in the
    gradient inflates the variance and shrinks the step where it matters (``onebit_sgd`` with Adam
    is 18.5% worse in perplexity on the recipe's LSTM). Once Adam's variance has settled it can be
    frozen (the paper's observation); Adam is then a linear momentum SGD preconditioned by a fixed
    vector, and the momentum tolerates 1-bit exchange with error feedback.

    Each step after the freeze, per rank: its momentum ``m_i = b1 m + (1 - b1) g_i`` from its own
    gradient (``m``, the last average, is the same on every rank); ``m_i`` averaged over ranks
    through the two-stage quantized all-reduce (stage 1: ``m_i`` plus this rank's residual
    quantized, columns in stripes sent to their owners; stage 2: each owner sums the stripes, adds
    its residual, quantizes again and all-gathers), so every rank decodes the same bytes and holds
    the same ``m``; then ``x -= lr * m / (sqrt(v_frozen) + eps)`` as Adam would with ``v`` fixed
    (see :class:`FrozenVarianceAdam`). Tensors of at most ``small_tensor_numel`` values and 1-D
    ones (biases, norms) carry their momentum in fp32. Before the freeze the gradients are averaged
    in fp32 and the user's optimizer steps as it is.

    The optimizer (from ``configure_optimizers``) must be ``torch.optim.Adam`` or ``AdamW`` without
    ``amsgrad``, ``maximize`` or ``capturable``; its learning rate is read at every step (schedulers
    work), weight decay applies as its class applies it (L2 into the gradient for Adam, decoupled
    for AdamW).
    Gradient clipping set on the Trainer applies to each rank's own gradient after the freeze
    (before the momentum), to the averaged gradient before it.

    Per rank and step after the freeze it sends about ``2 (N-1)/N`` of the 1-bit momentum: 1/32 of
    ``allreduce``'s bytes plus two floats per column and stripe in each stage.

    Where it departs from the paper, for values whose variance had not settled at the freeze (an
    LM's vocabulary rows that no token of the warm-up used: the paper's update moves them by
    ``lr c / eps`` per step, ``c`` a column's 1-bit scale): the momentum is divided by the frozen
    preconditioner before it is compressed, and the preconditioner has a floor of ``variance_floor``
    times its tensor's RMS (see :class:`FrozenVarianceAdam`); the bytes are the paper's.

    Safe by default: at the freeze it measures how far each tensor's scale of ``sqrt(v)`` drifted
    over the last ``settling_window`` steps (:mod:`~lightning_commstrats.strategies.settling`) and
    warns when more than ``settling_warning`` (3%): a freeze too early for the variance to settle. With
    ``delay_freeze=N`` it moves the freeze ``settling_window`` steps later instead, while the figure
    is above the threshold, at most ``N`` steps in all (off by default: the freeze stays where the
    user put it and the bytes are the ones planned). It also warns (``floor_warning``) when more
    than 1% of the values never had a gradient at the freeze (an untied vocabulary's unseen rows):
    they step at the floor, as momentum SGD.

    Tuning: ``freeze_step`` as the paper: long enough for the variance to settle (they froze after
    15-25% of BERT pre-training; on this package's LSTM recipe 100-200 steps of 414 were within 1%
    of ``allreduce``, ``benchmarks/results/onebit_adam``); too early and the frozen variance
    misjudges the coordinates' scales (frozen after a single step, the variance of one gradient
    makes the next update explode: measured, ``benchmarks/results/gpu_check``). On a Transformer LM
    with a tied 10k-word vocabulary (100 steps, two seeds) 20% of the run was +29.5% in perplexity,
    60% +4.4%, 80% +1.6%, 4 bits frozen at 60% +1.1%: freeze once the variance has stopped moving
    (the settling warning says when it had not), not at a share of the run
    (``docs/benchmarks/quality.md``). ``num_quantization_bits`` 2-8 trades bytes for noise; 32 is
    "Adam with its variance frozen" in fp32 (a control).

    Reference: H. Tang, S. Gan, A. A. Awan, S. Rajbhandari, C. Li, X. Lian, J. Liu, C. Zhang, Y. He,
    "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed",
    ICML 2021.

    Args:
        freeze_step: full-precision Adam steps before the variance is frozen (>= 1).
        num_quantization_bits: bits per momentum value after the freeze (1, 2, 4, 8, 16 or 32).
        bias_correction: keep Adam's bias correction after the freeze (default; ``False`` is the
            paper's update).
        variance_floor: the least frozen ``sqrt(v)``, as a share of its tensor's RMS, in ``[0, 1)``
            (0.1; 0 is the paper's: see :class:`FrozenVarianceAdam`).
        compress_after_preconditioner: send the momentum divided by the frozen preconditioner (default;
            ``False`` sends the momentum, the paper's).
        floor_warning: warn at the freeze when more than this share of the values never had a
            gradient (0.01); ``None``: never.
        settling_warning: warn at the freeze when the tensors' scale of ``sqrt(v)`` drifted more than
            this share over the last ``settling_window`` steps (0.03); ``None``: no check.
        settling_window: the optimizer steps the settling figure spans (10).
        delay_freeze: move the freeze ``settling_window`` steps later while the figure is above
            ``settling_warning``, at most this many steps in all (0: never; the warning instead).
        small_tensor_numel: tensors this small (or 1-D) carry their momentum in fp32.
        half_dtype: the 16-bit format.
        residuals: where the error-feedback residuals (the compressed exchange's, both stages, and with
            ``slow_hop_bits`` the slow hop's) wait between steps: ``"device"`` (default) or ``"host"``,
            pinned on CUDA, as :class:`~lightning_commstrats.strategies.onebit_sgd.OneBitSGDStrategy`'s;
            the results are bit for bit those of ``"device"``.
        bucket_cap_mb, backend, timeout, start_method: as :class:`AllReduceStrategy`.
        **kwargs: as :class:`AllReduceStrategy`.

    Example::

        strategy = lightning_commstrats.OneBitAdamStrategy(freeze_step=400)
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy)
    """

    strategy_name = "onebit_adam"
    supports_shard = False

    def __init__(
        self,
        freeze_step: int = 400,
        num_quantization_bits: int = 1,
        bias_correction: bool = True,
        variance_floor: float = 0.1,
        compress_after_preconditioner: bool = True,
        floor_warning: float | None = 0.01,
        settling_warning: float | None = 0.03,
        settling_window: int = 10,
        delay_freeze: int = 0,
        small_tensor_numel: int = 1024,
        half_dtype: str = "float16",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        backend: str = "auto",
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        residuals: str = "device",
        **kwargs: Any,
    ) -> None:
        adam = FrozenVarianceAdam(
            freeze_step, bias_correction, variance_floor, compress_after_preconditioner, floor_warning
        )
        settling = VarianceSettling(freeze_step, settling_warning, settling_window, delay_freeze)
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
    def freeze_step(self) -> int:
        return self.adam.freeze_step

    def _frozen(self, optimizer: Optimizer) -> bool:
        """Whether this step (after ``optimizer_steps`` completed ones) is a frozen one: the settling
        check copies ``sqrt(v)`` on its way there and, at the step the freeze is due, may move it."""
        steps, settling = self.optimizer_steps, self.settling
        # every optimizer's tensors, whichever optimizer steps now: with several (manual optimization)
        # the copy and the figure at the freeze fall on steps of different optimizers
        optimizers = self.optimizers
        if steps < settling.freeze_at:
            if settling.due(steps):  # (the parameters listed on that step only)
                settling.observe(steps, optimizers, [p for o in optimizers for p in trainable_params(o)])
            return False
        if steps == settling.freeze_at and not self.adam.frozen_at:  # the step the freeze is due
            agree = (lambda flag: self.comm.broadcast_object(flag, 0)) if self.world_size > 1 else None
            params = [p for o in optimizers for p in trainable_params(o)]
            return settling.decide(steps, optimizers, params, agree)
        return True

    @property
    def num_quantization_bits(self) -> int:
        return self.compression.bits

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            self.adam.check_optimizer(optimizer)
        refuse_grad_scaler(self, "onebit_adam")

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # under Fabric no Trainer knows the run's length (the module's trainer shim raises): no warning
        total = getattr(self.trainer, "estimated_stepping_batches", None) if self.trainer is not None else None
        if isinstance(total, (int, float)) and math.isfinite(total) and total <= self.freeze_step:
            rank_zero_warn(
                f"onebit_adam: this fit has {int(total)} optimizer steps and the variance is frozen after"
                f" freeze_step={self.freeze_step}: it never compresses (it is allreduce with Adam). Pass a"
                " freeze_step of about 15-25% of the run (the paper's), after the variance has settled."
            )

    @override
    def after_backward(self, optimizer: Optimizer) -> None:
        if not self._frozen(optimizer):
            super().after_backward(optimizer)  # fp32 gradients; the user's Adam steps
            return
        params = trainable_params(optimizer)
        if self.reducer.holds("grad"):  # the warm-up buckets: unused now
            self.reducer.release("grad")
        clip_like_the_trainer(self, params)
        names = [self.param_name(p) for p in params]
        self.adam.local_momentum(optimizer, params, names)
        if self.world_size > 1:
            self.exchange_compressed(self.compression, params)  # the (preconditioned) momentum, averaged in place
        if not self._nonfinite_names:  # else the nonfinite policy decides (the step is not taken)
            self.adam.step(optimizer, params, names)

    # ------------------------------------------------------------------ checkpointed state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "onebit_adam": self.adam.state_dict(), "settling": self.settling.state_dict()}

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return self.compression.state_dict()

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        self.check_compression_state(self.compression, rank_state)
        super().load_state_dict(state, rank_state)
        self.adam.load_state_dict(state.get("onebit_adam", {}))
        self.settling.load_state_dict(state.get("settling", {}), self.root_device)
        self.bind_compression(self.compression).load_state_dict(rank_state)

    @override
    def reset_state(self) -> None:
        if self.compression.exchange is not None:
            self.compression.exchange.reset()
