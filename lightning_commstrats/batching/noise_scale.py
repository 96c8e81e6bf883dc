"""The gradient noise scale measured on the fly from data parallelism, and a batch-size warm-up driven by it.

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training", Appendix A): the gradient of
a batch of ``B`` samples drawn independently has ``E |G_B|^2 = |G|^2 + tr(Sigma) / B``, where ``G`` is
the true gradient and ``Sigma`` the covariance of one sample's gradient. Two batch sizes give two
equations; solved for the unknowns, they are unbiased estimates::

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

and the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (the batch size past which a larger batch
stops buying proportionally fewer steps) is the ratio of their moving averages, each averaged on its
own first, since a ratio of noisy estimates is biased. Data parallelism hands out both batch sizes
for free: each rank's own gradient (``B_small``, the per-rank batch) and their average
(``B_big = world_size x B_small``).

Merrill et al. (2025, "Critical Batch Size Revisited") find the critical batch size near zero at
initialisation, rising, then flat, and warm the batch size up accordingly;
:class:`GradientNoiseScale` can do the same, growing the batch as the measured noise scale grows.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats.batching.resize import (
    LR_SCALINGS,
    current_batch_size,
    in_trial,
    log_batch_size,
    make_resizable,
    set_batch_size,
)

log = logging.getLogger(__name__)

MEASURES = ("auto", "exact", "sketch")
SKETCH_CHUNK = 1 << 20  # values hashed at a time by count_sketch: its workspace is 12 bytes each


def unbiased_estimates(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """One step's unbiased estimates ``(|G|^2, tr(Sigma))`` from the squared norms of two batch gradients.

    Args:
        small_sq: ``|G_small|^2``, the squared norm of a gradient averaged over ``b_small`` samples
            (the mean over ranks of each rank's own, which has the same expectation and less noise).
        big_sq: ``|G_big|^2``, the squared norm of a gradient averaged over ``b_big`` samples.
        b_small, b_big: the two batch sizes, in samples, ``b_small < b_big``.
    """
    if not 0 < b_small < b_big:
        raise ValueError(f"the batch sizes must satisfy 0 < b_small < b_big, got {b_small} and {b_big}")
    gradient_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return gradient_sq, trace


class NoiseScaleEstimator:
    """Moving averages of the two unbiased estimates, and ``B_simple`` as their ratio.

    Stores the two exponential moving averages and the number of steps measured. The averages start
    at zero; both carry the same start-up bias ``1 - beta^t``, which cancels in the ratio, and
    :attr:`gradient_sq` and :attr:`trace` divide it out.

    Args:
        beta: the weight of the past in each moving average, in ``[0, 1)``. The average spans about
            ``1 / (1 - beta)`` steps. One step's estimates are very noisy (``|G|^2`` is often
            negative early on); too small a ``beta`` makes ``B_simple`` jump, too large lags behind a
            noise scale that grows during training. 0.95 to 0.99 suits runs of hundreds to thousands
            of steps.
    """

    def __init__(self, beta: float = 0.99) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"beta must be a number in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self.steps = 0
        self._gradient_sq = 0.0
        self._trace = 0.0

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> float:
        """Fold one step's squared norms in (see :func:`unbiased_estimates`); return :attr:`noise_scale`."""
        gradient_sq, trace = unbiased_estimates(small_sq, big_sq, b_small, b_big)
        self._gradient_sq = self.beta * self._gradient_sq + (1 - self.beta) * gradient_sq
        self._trace = self.beta * self._trace + (1 - self.beta) * trace
        self.steps += 1
        return self.noise_scale

    @property
    def _debias(self) -> float:
        return 1 - self.beta**self.steps if self.steps else 1.0

    @property
    def gradient_sq(self) -> float:
        """The moving average of ``|G|^2``."""
        return self._gradient_sq / self._debias

    @property
    def trace(self) -> float:
        """The moving average of ``tr(Sigma)``, per sample."""
        return self._trace / self._debias

    @property
    def noise_scale(self) -> float:
        """``B_simple = tr(Sigma) / |G|^2``, in samples; NaN while the average of ``|G|^2`` is not positive
        (nothing measured yet, or noise still dominates the estimate)."""
        return self._trace / self._gradient_sq if self._gradient_sq > 0 else math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "gradient_sq": self._gradient_sq, "trace": self._trace}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self._gradient_sq = float(state["gradient_sq"])
        self._trace = float(state["trace"])


def next_batch_size(
    size: int, world_size: int, noise_scale: float, growth_factor: float, max_batch_size: int, scale: float = 1.0
) -> int:
    """The per-rank batch after a warm-up check: ``size`` grown by ``growth_factor`` (at least by one
    sample, at most to ``max_batch_size``) when the grown global batch is at most ``scale x
    noise_scale``; else ``size`` (also while the noise scale is unknown, NaN). Never smaller."""
    if size >= max_batch_size or math.isnan(noise_scale):
        return size
    grown = min(max_batch_size, max(size + 1, round(size * growth_factor)))
    return grown if grown * world_size <= scale * noise_scale else size


def count_sketch(tensors: list[Tensor], size: int, generator: torch.Generator) -> Tensor:
    """A count sketch of the concatenation of ``tensors``: ``size`` float64 buckets.

    Every value goes to a random bucket with a random sign, drawn from ``generator``. The sketch is
    linear (the sketch of an average is the average of the sketches, so an all-reduce of sketches
    sketches the averaged gradient), and for hashes drawn afresh ``E |sketch(x)|^2 = |x|^2`` exactly,
    with a relative standard deviation of at most ``sqrt(2 / size)``. Ranks that draw with generators
    seeded alike hash alike.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    # A draw ``d`` in [0, 2 size) puts the value in bucket d // 2 with the sign of d even: added to
    # slot d of 2 size slots, bucket b is slot 2b less slot 2b+1, and no sign or bucket is computed
    # per value. The draws fill a workspace of at most SKETCH_CHUNK values (int32, as the values
    # drawn below 2^32 are the same in either type), reused chunk after chunk: on the host the
    # generator draws one value after the other, so the chunks draw what one call for every value
    # would (on CUDA each call of the generator starts a new offset: other draws, alike on every rank).
    slots = torch.zeros(2 * size, dtype=torch.float64, device=device)
    longest = min(max((t.numel() for t in tensors), default=0), SKETCH_CHUNK)
    drawn = torch.empty(longest, dtype=torch.int32, device=device)
    values = torch.empty(longest, dtype=torch.float64, device=device)
    for t in tensors:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), SKETCH_CHUNK):
            part = flat[start : start + SKETCH_CHUNK]
            n = part.numel()
            drawn[:n].random_(0, 2 * size, generator=generator)
            values[:n].copy_(part)
            slots.index_add_(0, drawn[:n], values[:n])
    return slots[0::2] - slots[1::2]


def _squared_norm(tensors: list[Tensor]) -> Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([t.detach().double().square().sum() for t in tensors]).sum()


class GradientNoiseScale(Callback):
    """Logs the gradient noise scale ``B_simple`` every optimizer step, measured from what the ranks hold.

    Stores a :class:`NoiseScaleEstimator` (two moving averages; saved in checkpoints).

    Each optimizer step:

    1. before the exchange, each rank takes the squared norm of its own gradient ``|g_r|^2``, over
       ``b`` samples (its batch, times gradient accumulation);
    2. one all-reduce of ``[b, b^2, |g_r|^2]`` (24 bytes; with ``measure="sketch"`` a count sketch of
       ``g_r`` rides along) gives every rank the mean ``|G_small|^2`` and tells whether every rank had
       the same ``b`` (a step where they differ, an uneven last batch, is not measured);
    3. ``|G_big|^2`` at ``B_big = world_size x b``: the squared norm of the averaged gradient that the
       exchange left on every rank (``measure="exact"``), or of the averaged sketch (``"sketch"``);
    4. the unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` update their moving averages and
       ``B_simple`` is their ratio; every rank computes the same numbers.

    Logged every step (subject to the Trainer's ``log_every_n_steps``): ``train/noise_scale``
    (``B_simple`` in samples over all ranks; not logged while the average of ``|G|^2`` is not yet
    positive, where it is not defined), ``train/batch_size`` (per rank, the size of the next batch,
    as :func:`~lightning_commstrats.batching.log_batch_size` logs it), ``train/gradient_sq`` and
    ``train/gradient_trace`` (the two moving averages, once a step was measured).

    Batch-size warm-up (with ``max_batch_size``): every ``check_every_n_steps`` optimizer steps, if
    ``growth_factor`` times the global batch (``world_size`` x the per-rank batch) is still at most
    ``scale`` times the measured noise scale, the per-rank batch grows by ``growth_factor`` (up to
    ``max_batch_size``) through :func:`~lightning_commstrats.batching.set_batch_size`: every rank
    takes the same size (every rank computes the same noise scale; rank 0's, broadcast at each
    check, decides, and ``set_batch_size`` checks the sizes agree), from the next batch on, and no
    sample of the epoch is dropped or repeated (an epoch whose batches grow has fewer of them; see
    :mod:`lightning_commstrats.batching.resize`). The batch never shrinks. McCandlish et al. find
    that training near ``B_simple`` balances steps against samples; Merrill et al. (2025) grow the
    batch as the critical batch size rises early in training. Steps of AutoAdjust's trial
    mini-epochs (:func:`~lightning_commstrats.batching.in_trial`) are not measured.

    What each scheme lets it measure:

    - ``allreduce`` (and ``onebit_sgd`` at 32 bits, without a quantized slow hop): exact, as above.
    - ``onebit_sgd``, ``sampled_vocab``: what they average is quantized or has rows
      left out (and carries error feedback from earlier steps), so its norm is not ``|G_big|^2``; each
      rank sends instead a count sketch of its own gradient (``sketch_size`` floats), whose average
      gives an unbiased estimate of the exact average's squared norm. It adds ``8 x sketch_size``
      bytes a step and some noise (at most ``sqrt(2 / sketch_size)`` relative to ``|G_big|^2``).
    - ``onebit_adam``, ``zero_one_adam``: measured by sketch too, every step. They average Adam's
      momentum (or 0/1 Adam's accumulated update), not the gradient, take Adam's step at the
      exchange and clear the gradients there: the averaged gradient is never held, and recovering it
      from the averaged momentum would divide the 1-bit error by ``1 - beta1``. Each rank's own
      gradient, observed before the exchange, is all the sketch needs. 0/1 Adam's local steps send
      nothing of their own; measured, each carries the noise scale's all-reduce (``24 + 8 x
      sketch_size`` bytes), a synchronisation of the ranks these steps otherwise skip.
    - The periodic schemes (``model_averaging``, ``bmuf``, ``local_sgd``, ``diloco``,
      ``streaming_diloco``, ``sparseloco``) and the asynchronous ``parameter_server`` never average
      gradients per step: measuring would add a collective every step, the very synchronisation
      they exist to avoid. Refused.
    - ``expert_parallel``: the experts' gradients live on different ranks and are averaged within
      groups, so no rank's squared norm is a ``B_small`` one. Refused. So are sharded runs
      (``shard="fsdp"``: a rank holds a slice of the gradient) and strategies outside this package
      (Lightning's ``ddp`` averages inside backward: no rank ever sees its own gradient), and a
      single rank (one batch size only).

    Batch sizes are counted in samples as Lightning's ``extract_batch_size`` counts them (sequences,
    for the LM recipe: the noise scale is then in sequences). The estimate assumes the samples of a
    batch are drawn independently; a finite dataset shuffled without replacement lowers ``tr(Sigma)``
    by ``(n - B) / (n - 1)``, negligible for ``n`` much larger than the global batch.

    Args:
        beta: moving-average weight of the past (see :class:`NoiseScaleEstimator`; default 0.99).
        measure: ``"auto"`` (exact where the exchange averages fp32 gradients, else a sketch),
            ``"exact"`` (refused where the exchange is lossy) or ``"sketch"``.
        sketch_size: buckets of the count sketch (default 256: 2 KiB a step, at most 9% relative
            noise on ``|G_big|^2``, which the moving average then smooths). Once the noise scale is
            several times the global batch, 256 buckets read it up to 45% low on the notebook's run
            (``notebooks/noise_scale.ipynb``), 1,024 up to about 20%: raise it where the bytes allow.
        seed: seeds the sketch's hashes, drawn afresh every step alike on every rank.
        max_batch_size: the largest per-rank batch, in samples; ``None`` (the default): measure and
            log only, never change the batch.
        min_batch_size: the per-rank batch to start from, in samples (``None``: the DataLoader's);
            the configured learning rate is taken to be the DataLoader's batch's and scaled to this
            one by ``lr_scaling``.
        growth_factor: the factor by which the batch grows at a check (> 1; default 2). Smaller
            factors follow the noise scale more closely, with more changes.
        check_every_n_steps: optimizer steps between two checks (default 50); the first check
            waits as long, for the moving averages to settle. About ``1 / (1 - beta)`` or more.
        scale: grow while the grown global batch stays at most ``scale x B_simple`` (default 1).
        lr_scaling: how the learning rate follows the batch: ``"none"`` (default), ``"linear"``
            (the rate per sample stays) or ``"sqrt"`` (see :func:`~lightning_commstrats.batching.lr_scale`).

    Reference: S. McCandlish, J. Kaplan, D. Amodei and the OpenAI Dota Team, "An Empirical Model of
    Large-Batch Training", arXiv:1812.06162, 2018, Appendix A.

    Example::

        import lightning as L
        import lightning_commstrats

        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy="allreduce",
            callbacks=[lightning_commstrats.GradientNoiseScale(beta=0.95)],
        )
    """

    def __init__(
        self,
        beta: float = 0.99,
        measure: str = "auto",
        sketch_size: int = 256,
        seed: int = 0,
        max_batch_size: int | None = None,
        min_batch_size: int | None = None,
        growth_factor: float = 2.0,
        check_every_n_steps: int = 50,
        scale: float = 1.0,
        lr_scaling: str = "none",
    ) -> None:
        if measure not in MEASURES:
            raise ValueError(f"measure={measure!r} is not supported; choose one of {MEASURES}")
        if isinstance(sketch_size, bool) or not isinstance(sketch_size, int) or sketch_size < 1:
            raise ValueError(f"sketch_size must be a positive int (buckets), got {sketch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        for name, value in (("max_batch_size", max_batch_size), ("min_batch_size", min_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 (samples per rank) or None, got {value!r}")
        if max_batch_size is not None and min_batch_size is not None and max_batch_size < min_batch_size:
            raise ValueError(f"max_batch_size={max_batch_size} is below min_batch_size={min_batch_size}")
        if min_batch_size is not None and max_batch_size is None:
            raise ValueError("min_batch_size is given without max_batch_size: pass max_batch_size to grow the batch")
        if isinstance(growth_factor, bool) or not isinstance(growth_factor, (int, float)) or not growth_factor > 1:
            raise ValueError(f"growth_factor must be a number > 1, got {growth_factor!r}")
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) or check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be an int >= 1 (optimizer steps), got {check_every_n_steps!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"scale must be a number > 0, got {scale!r}")
        if lr_scaling not in LR_SCALINGS:
            raise ValueError(f"lr_scaling={lr_scaling!r} is not supported; choose one of {LR_SCALINGS}")
        self.estimator = NoiseScaleEstimator(beta)
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.growth_factor = float(growth_factor)
        self.check_every_n_steps = check_every_n_steps
        self.scale = float(scale)
        self.lr_scaling = lr_scaling
        self.history: list[tuple[int, int]] = []  # (optimizer step, per-rank batch) at every change
        self._resumed_size: int | None = None  # the per-rank batch a checkpoint had grown to
        self._checked_at = 0
        self.measure = measure
        self.sketch_size = sketch_size
        self.seed = seed
        self.mode: str | None = None  # "exact" or "sketch", decided at setup from the strategy
        self._strategy: Any = None
        self._samples = 0  # this rank's samples since the last optimizer step
        self._local: Tensor | None = None  # [b, b^2, |g_r|^2, sketch...] of the step in progress

    # ------------------------------------------------------------------ which schemes

    def _mode_for(self, strategy: Any, world_size: int) -> str:
        from lightning_commstrats.strategies import (
            AllReduceStrategy,
            CommStrategy,
            ExpertParallelStrategy,
            ParameterServerStrategy,
            PeriodicSyncStrategy,
        )

        name = type(strategy).__name__
        if not isinstance(strategy, CommStrategy):
            raise ValueError(
                f"GradientNoiseScale needs one of lightning_commstrats' strategies, got {name}: it reads each"
                " rank's own gradient before the exchange, and Lightning's strategies (ddp...) average inside"
                " backward, so no rank ever holds its own. Use strategy='allreduce' for the same training."
            )
        if world_size < 2:
            raise ValueError(
                "GradientNoiseScale needs at least 2 ranks: it compares each rank's gradient (B_small) with"
                " their average (B_big); a single rank has one batch size only"
            )
        if isinstance(strategy, (PeriodicSyncStrategy, ParameterServerStrategy)):
            raise ValueError(
                f"GradientNoiseScale cannot measure under {name}: the scheme never averages gradients per step"
                " (it exchanges weights every few steps), and measuring would add a collective every step,"
                " the synchronisation it exists to avoid"
            )
        if isinstance(strategy, ExpertParallelStrategy):
            raise ValueError(
                f"GradientNoiseScale cannot measure under {name}: the experts' gradients live on different"
                " ranks, so no rank's gradient norm is that of a per-rank batch"
            )
        if strategy.sharding is not None:
            raise ValueError(
                f"GradientNoiseScale cannot measure under {name}(shard={strategy.shard!r}): a rank holds a"
                " slice of the gradient, not its own whole gradient"
            )
        if not isinstance(strategy, AllReduceStrategy):
            raise ValueError(f"GradientNoiseScale does not know how {name} exchanges gradients")
        from lightning_commstrats.strategies import OneBitSGDStrategy

        averages_fp32 = (
            type(strategy).after_backward is AllReduceStrategy.after_backward
            and type(strategy).exchange is AllReduceStrategy.exchange
        ) or (isinstance(strategy, OneBitSGDStrategy) and strategy.num_quantization_bits == 32)
        plain = averages_fp32 and strategy.slow_hop_bits == 32
        if self.measure == "exact" and not plain:
            raise ValueError(
                f"GradientNoiseScale(measure='exact') cannot measure under {name}: what it averages is"
                " compressed, so its norm is not that of the averaged gradient; use measure='sketch' or 'auto'"
            )
        if self.measure == "auto":
            return "exact" if plain else "sketch"
        return self.measure

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.mode = self._mode_for(trainer.strategy, trainer.world_size)
        self._strategy = trainer.strategy
        if self._observe not in trainer.strategy.gradient_observers:
            trainer.strategy.gradient_observers.append(self._observe)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        observers = getattr(trainer.strategy, "gradient_observers", [])
        if self._observe in observers:
            observers.remove(self._observe)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"GradientNoiseScale measures the gradient of one optimizer; this module has {len(trainer.optimizers)}"
            )
        self._checked_at = trainer.global_step
        if self.max_batch_size is None:
            return
        make_resizable(trainer)
        start = self._resumed_size or self.min_batch_size or current_batch_size(trainer)
        if start > self.max_batch_size:
            raise ValueError(
                f"GradientNoiseScale: max_batch_size={self.max_batch_size} is below the batch size in use,"
                f" {start} samples per rank"
            )
        if start != current_batch_size(trainer):
            # the configured rate is the DataLoader's batch's; a resumed run's optimizer holds its own
            set_batch_size(trainer, start, lr_scaling="none" if self._resumed_size else self.lr_scaling)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.max_batch_size is not None:
            make_resizable(trainer)  # a reloaded DataLoader is a new one

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if in_trial(trainer):
            return
        step = trainer.global_step
        if self.max_batch_size is not None and step - self._checked_at >= self.check_every_n_steps:
            self._checked_at = step
            self.grow(trainer)
        log_batch_size(pl_module)

    def grow(self, trainer: pl.Trainer) -> int:
        """Collective (every rank calls it at the same step). Grow the per-rank batch by
        ``growth_factor`` if the grown global batch stays within ``scale x B_simple`` and
        ``max_batch_size``; returns the per-rank batch from the next batch on."""
        assert self.max_batch_size is not None
        size = current_batch_size(trainer)
        # every rank computes the same number; rank 0's decides, so that a rank that differed could
        # never leave the others waiting in set_batch_size's collective (a few bytes a check)
        noise_scale = float(trainer.strategy.broadcast(self.estimator.noise_scale, src=0))
        grown = next_batch_size(
            size, trainer.world_size, noise_scale, self.growth_factor, self.max_batch_size, self.scale
        )
        if grown == size:
            return size
        set_batch_size(trainer, grown, lr_scaling=self.lr_scaling)
        self.history.append((trainer.global_step, grown))
        log.info("noise scale %.1f: batch %d -> %d samples per rank", noise_scale, size, grown)
        return grown

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._samples += extract_batch_size(batch)

    def _observe(self, optimizer: Optimizer) -> None:
        """Before the exchange: this rank's own gradient, complete and unscaled."""
        if in_trial(self._strategy.lightning_module.trainer):
            return  # AutoAdjust's trial steps are rolled back: not training to measure
        grads = _grads(optimizer)
        b = float(self._samples)
        device = grads[0].device if grads else torch.device("cpu")
        parts = [torch.tensor([b, b * b], dtype=torch.float64, device=device), _squared_norm(grads).reshape(1)]
        if self.mode == "sketch":
            # hashes drawn afresh every step, alike on every rank (the step count is the same on all)
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed * 1_000_003 + int(self._strategy.optimizer_steps))
            parts.append(count_sketch(grads, self.sketch_size, generator))
        self._local = torch.cat(parts)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        local, self._local = self._local, None
        samples, self._samples = self._samples, 0
        strategy = trainer.strategy
        # A step skipped on every rank alike: an overflow (not observed), non-finite averages. Not
        # "no gradient left": onebit_adam and zero_one_adam take Adam's step at the exchange and clear
        # the gradients there, and the sketch of each rank's own, observed before, is all it needs.
        if local is None or strategy._nonfinite_names:
            return
        world = strategy.world_size
        mean = strategy.comm.all_reduce(local.clone(), "avg", tag="noise_scale")
        b, b_sq, small_sq = (float(v) for v in mean[:3].cpu())
        if b_sq != b * b or b < 1:  # the ranks' batches differ in size: no pair of batch sizes to compare
            log.debug("noise scale: step with uneven batches (per-rank %d samples here) not measured", samples)
            noise_scale = self.estimator.noise_scale
        else:
            if self.mode == "sketch":
                big_sq = float(mean[3:].square().sum())
            else:
                big_sq = float(_squared_norm(_grads(optimizer)))
            noise_scale = self.estimator.update(small_sq, big_sq, b, b * world)
        # a NaN in a chart reads as divergence: what is not defined yet is not logged
        if not math.isnan(noise_scale):
            pl_module.log("train/noise_scale", noise_scale, on_step=True, on_epoch=False)
        if self.estimator.steps:
            pl_module.log("train/gradient_sq", self.estimator.gradient_sq, on_step=True, on_epoch=False)
            pl_module.log("train/gradient_trace", self.estimator.trace, on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        size = self.history[-1][1] if self.history else self._resumed_size
        return {"estimator": self.estimator.state_dict(), "batch_size": size, "history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.estimator.load_state_dict(state_dict["estimator"])
        self._resumed_size = state_dict.get("batch_size")
        self.history = [tuple(h) for h in state_dict.get("history", [])]


def _grads(optimizer: Optimizer) -> list[Tensor]:
    """The gradients of the optimizer's trainable parameters in param-group order (the same on every
    rank, as the exchange takes them), zeros for a parameter that got none on this rank."""
    return [
        p.grad if p.grad is not None else torch.zeros_like(p)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad
    ]
