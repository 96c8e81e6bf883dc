"""CNTK's AutoAdjust: at the start of an epoch, pick the largest batch that does not hurt convergence.

CNTK (``Source/SGDLib/SGD.cpp``, ``AdaptiveMinibatchSizing`` and ``SearchForBestMinibatchSize``)
combines 1-bit SGD with this search because a larger minibatch means fewer model updates and so
fewer exchanges; it implements Seide et al., "On Parallelizability of Stochastic Gradient Descent
for Speech DNNs" (ICASSP 2014). Here it is a Lightning callback that works with every strategy of
the package whose state can be rolled back (see :class:`AutoAdjust`).
"""

from __future__ import annotations

import copy
import logging
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_commstrats._logging import log_rank_zero
from lightning_commstrats.batching import resize
from lightning_commstrats.batching.resize import LR_SCALINGS, lr_scale

log = logging.getLogger(__name__)

CNTK_SEARCH_BATCHES = 500  # CNTK's numMiniBatch4LRSearch: the search trains on this many batches' samples


def _positive_int(value: Any, name: str, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"AutoAdjust({name}={value!r}): {name} must be an int >= 1")
    return value


@dataclass
class Trial:
    """One candidate of a search: its per-rank batch size and the average training loss of its
    mini-epoch over every rank's samples."""

    batch_size: int
    loss: float


class AutoAdjust(Callback):
    """CNTK's automatic minibatch sizing (``AutoAdjust = [autoAdjustMinibatch = true]``).

    Stores the size chosen last (``chosen``), the search history and the learning-rate factor it
    applied; all three are checkpointed.

    At the start of a searching epoch (below), on every rank:

    1. Candidates: from a minimum up to a maximum, each ``sqrt(2)`` times the last (a float, as
       CNTK's), rounded to the nearest multiple of ``round_to``. The minimum is the starting batch
       size (the DataLoader's, CNTK's scheduled size), raised by ``1 / sqrt(lr decay)`` when the
       learning rate has decayed since fit started (CNTK: a smaller rate tolerates a larger batch),
       and at least half the previous choice; the maximum is ``max_batch_size``, and at most twice
       the previous choice. CNTK ignores the previous choice in the first two epochs (it may come
       from another run); so does this.
    2. Each candidate trains a mini-epoch on this rank's next ``search_samples`` samples (the ones
       the epoch is about to train on), cut into batches of the candidate's size, from the model as
       it is, at the learning rate the candidate would have under ``lr_scaling``; the average
       training loss over all ranks' samples is recorded. Then everything is put back as it was:
       parameters, buffers, gradients, every optimizer's state, the LR schedulers, the precision
       plugin (loss scaler), the strategy's own state (its
       :meth:`~lightning_commstrats.CommStrategy.take_snapshot`: ``state_dict`` /
       ``rank_state_dict``, 1-bit residuals, the periodic schemes' global model, outer optimizer,
       schedule, counters; an exchange a trial left in flight is waited for before it is put back,
       else its landing would overwrite the error feedback), the random number generators and the
       model's torchmetrics states. The
       training data's position does not move: the trials read the samples from the dataset.
    3. The first candidate's loss is the base; the search goes on while a candidate's loss is
       within ``error_margin`` percent of it, and picks the last such candidate. Every rank sees
       the same all-reduced losses, so every rank picks the same size (rank 0's is broadcast too).
    4. The epoch trains at the chosen size (:func:`~lightning_commstrats.batching.set_batch_size`),
       the learning rate scaled by ``lr_scaling`` from the size before.

    Searching epochs (CNTK's rule, epochs counted from 1): the first ``tuning_frequency`` epochs,
    then every epoch that is a multiple of ``tuning_frequency``. The other epochs keep the size.

    Differs from CNTK: sizes are per rank (CNTK's minibatch counts all workers: multiply by the
    world size to compare); a candidate above the number of search samples ends the search (its
    trial would be the search samples in one batch again); a trial whose loss is not finite counts
    as beyond the margin (CNTK keeps growing past a NaN); rounding never gives 0 (CNTK rounds
    sizes below 32 to 0); duplicate sizes after rounding are tried once; a size rounded up past
    ``max_batch_size`` is not tried.

    Not rolled back: the trials' communication, which is real and counted by the strategy's
    statistics (it is what the search costs: each search's bytes are in :attr:`history`; the
    ``[comm]`` summary's step count includes the trials' steps); a ``LightningModule``'s Python
    attributes other than its parameters, buffers and torchmetrics states; what another callback's
    hooks kept from a trial (:func:`~lightning_commstrats.batching.in_trial` tells them). Their
    ``self.log`` calls during a trial are dropped. On one device with ``shuffle=True`` (a
    ``RandomSampler`` drawing from the global generator) the epoch's order is drawn when the
    search reads it, so the run shuffles differently from one without the callback; on several
    ranks the ``DistributedSampler``'s order is fixed by its seed and the epoch.

    An epoch that searches trains at the chosen size from its first batch (with ``num_workers=w``,
    after the batches the workers already hold in the first epoch); it has fewer batches when the
    size grew, and its samples are the same.

    Args:
        tuning_frequency: search every this many epochs (CNTK's ``minibatchSizeTuningFrequency``,
            default 1: every epoch). Each search trains ``search_samples`` samples once per
            candidate (about 2 to 6 candidates after the first epochs).
        max_batch_size: the largest per-rank batch the search may choose (CNTK's
            ``minibatchSizeTuningMax``, default 1,048,576 samples).
        error_margin: how much worse than the first candidate's a larger batch's trial loss may
            be, in percent (CNTK's ``minibatchSearchCriterionErrorMargin``, default 1). 0: no
            worse at all; a large margin grows the batch every search, up to twice a time.
        search_samples: samples per rank each trial trains on (default: 500 batches of the
            starting size, CNTK's ``numMiniBatch4LRSearch``), at most one epoch's. More samples
            tell sizes apart more reliably and cost more.
        lr_scaling: the learning rate of a batch of another size: ``"linear"`` (default: the rate
            per sample stays, as CNTK's ``learningRatesPerSample`` on a loss averaged over the
            batch), ``"sqrt"`` or ``"none"`` (the rate per step stays).
        round_to: candidates are multiples of this (CNTK: 64). Smaller for small batches.
        min_batch_size: the smallest size searched (default: the DataLoader's batch size).

    Raises:
        ValueError: at construction, naming the setting: ``error_margin < 0``, a frequency, a
            maximum, a count or a rounding below 1, ``max_batch_size`` below ``min_batch_size``;
            at ``setup``: a strategy whose state cannot be rolled back (the asynchronous
            ``parameter_server``, fault-tolerant replicas, ``shard="fsdp"``, Lightning's other
            strategies), manual optimization, ``accumulate_grad_batches > 1``; when training
            starts: ``max_batch_size`` below the DataLoader's batch size.

    Example::

        trainer = L.Trainer(devices=2, strategy="onebit_sgd", callbacks=[AutoAdjust(tuning_frequency=3)])
    """

    def __init__(
        self,
        tuning_frequency: int = 1,
        max_batch_size: int = 1_048_576,
        error_margin: float = 1.0,
        search_samples: int | None = None,
        lr_scaling: str = "linear",
        round_to: int = 64,
        min_batch_size: int | None = None,
    ) -> None:
        self.tuning_frequency = _positive_int(tuning_frequency, "tuning_frequency")
        self.max_batch_size = _positive_int(max_batch_size, "max_batch_size")
        if isinstance(error_margin, bool) or not isinstance(error_margin, (int, float)) or not error_margin >= 0:
            raise ValueError(f"AutoAdjust(error_margin={error_margin!r}): error_margin must be >= 0 (percent)")
        self.error_margin = float(error_margin)
        self.search_samples = _positive_int(search_samples, "search_samples", allow_none=True)
        if lr_scaling not in LR_SCALINGS:
            raise ValueError(f"AutoAdjust(lr_scaling={lr_scaling!r}): lr_scaling must be one of {LR_SCALINGS}")
        self.lr_scaling = lr_scaling
        self.round_to = _positive_int(round_to, "round_to")
        self.min_batch_size = _positive_int(min_batch_size, "min_batch_size", allow_none=True)
        if self.min_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError(
                f"AutoAdjust(max_batch_size={max_batch_size}) is below min_batch_size={min_batch_size}:"
                " the search could never try a size"
            )
        self.chosen: int | None = None
        self.history: list[dict[str, Any]] = []
        self._start_size: int | None = None
        self._start_lr: float | None = None
        self._restored: dict[str, Any] | None = None
        self._trainer: pl.Trainer | None = None

    # ------------------------------------------------------------------ checks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        check_rollback(trainer.strategy)
        if getattr(trainer.strategy, "sync_period_unit", None) == "steps":
            log_rank_zero(
                log,
                logging.WARNING,
                "%s counts sync_period in optimizer steps: once AutoAdjust grows the batch, a period holds more"
                " samples; sync_period_unit='samples' keeps it a number of samples (CNTK's unit)",
                type(trainer.strategy).__name__,
            )
        if not pl_module.automatic_optimization:
            raise ValueError(
                "AutoAdjust trains its trials with Lightning's automatic optimization; this module is manual"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"AutoAdjust with accumulate_grad_batches={trainer.accumulate_grad_batches}: the batch it sizes is"
                " the one of an optimizer step; leave accumulation at 1"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sampler = resize.make_resizable(trainer)
        if self._restored is not None:
            saved, self._restored = self._restored, None
            self._start_size, self._start_lr = saved["start_size"], saved["start_lr"]
            resize._state(trainer).lr_factor = saved["lr_factor"]  # the optimizer's rate came with the checkpoint
            sampler.size = saved["batch_size"]
            resize.refresh_lengths(trainer)
        else:
            self._start_size = self.min_batch_size or sampler.size
            self._start_lr = _first_lr(trainer)
        if self.max_batch_size < sampler.size:
            raise ValueError(
                f"AutoAdjust(max_batch_size={self.max_batch_size}) is below the batch size in use ({sampler.size})"
            )

    # ------------------------------------------------------------------ the search

    def searches(self, epoch: int) -> bool:
        """Whether the epoch ``epoch`` (0-based) searches: CNTK's rule."""
        if self._previous(epoch) is None:
            return True
        n = epoch + 1
        return n <= self.tuning_frequency or n % self.tuning_frequency == 0

    def _previous(self, epoch: int) -> int | None:
        return None if epoch < 2 else self.chosen

    def candidate_range(self, trainer: pl.Trainer) -> tuple[int, int]:
        """The smallest and largest sizes of this epoch's search (before rounding)."""
        assert self._start_size is not None and self._start_lr is not None
        low = self._start_size
        decay = (_first_lr(trainer) / resize.lr_factor(trainer)) / self._start_lr if self._start_lr > 0 else 1.0
        change = math.sqrt(decay)
        if change < 1.0:
            low = int(low / change)
        high = self.max_batch_size
        previous = self._previous(trainer.current_epoch)
        if previous is not None:
            low = max(low, previous // 2)
            high = min(high, previous * 2)
        return low, high

    def within_margin(self, loss: float, base: float) -> bool:
        """Whether a trial's ``loss`` is within ``error_margin`` percent of the ``base`` (False when
        either is not finite)."""
        return math.isfinite(loss) and math.isfinite(base) and loss <= base * (1.0 + self.error_margin / 100.0)

    def rounded(self, size: float) -> int:
        """``size`` to the nearest multiple of ``round_to`` (halves up; in float32, as CNTK), never below it."""
        half, step = np.float32(self.round_to // 2), np.float32(self.round_to)
        return max(self.round_to, self.round_to * int((np.float32(size) + half) / step))

    def candidates(self, low: int, high: int) -> Iterator[int]:
        """CNTK's candidate sizes from ``low`` while the unrounded size is at most ``high``: a float32
        grown by ``sqrtf(2)`` each time (so ``8 * sqrt(2)^4`` is 31.999996, within a maximum of 32),
        rounded; a size equal to the one before is skipped."""
        size, factor, last = np.float32(low), np.float32(math.sqrt(2.0)), None
        while size <= high:
            rounded = self.rounded(float(size))
            if rounded != last:
                yield rounded
            last = rounded
            size = np.float32(size * factor)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sampler = resize.make_resizable(trainer)
        epoch = trainer.current_epoch
        if not self.searches(epoch):
            return
        assert self._start_size is not None
        low, high = self.candidate_range(trainer)
        if low > high:  # CNTK: "may happen for automatically reduced learning rates"
            self._choose(trainer, high, epoch, [], 0)
            return
        wanted = self.search_samples or CNTK_SEARCH_BATCHES * self._start_size
        indices = sampler.upcoming(wanted, consumed=0)  # DataLoader workers may hold the first batches
        count = _agree_min(trainer, len(indices))  # every rank trains the same number of steps
        indices = indices[:count]
        if count == 0:
            return
        stats = getattr(trainer.strategy, "comm_stats", None)
        before = stats.bytes_sent if stats is not None else 0
        trials: list[Trial] = []
        choice = 0
        snapshot = Snapshot.take(trainer)
        try:
            resize.set_trial(trainer, True)
            for size in self.candidates(low, high):
                if trials and size > self.max_batch_size:  # rounded up past the maximum
                    break
                if trials and size > count:  # one batch of the same samples again: nothing new to learn
                    break
                trials.append(Trial(size, self._trial(trainer, pl_module, snapshot, indices, size)))
                if len(trials) > 1 and not self.within_margin(trials[-1].loss, trials[0].loss):
                    break
                choice = size
        finally:
            resize.set_trial(trainer, False)
            snapshot.restore(trainer)
        choice = int(trainer.strategy.broadcast(choice, 0))
        spent = (stats.bytes_sent if stats is not None else 0) - before
        self._choose(trainer, choice, epoch, trials, spent)

    def _choose(self, trainer: pl.Trainer, size: int, epoch: int, trials: list[Trial], spent: int) -> None:
        size = min(size, self.max_batch_size)
        old = resize.set_batch_size(trainer, size, self.lr_scaling)
        self.chosen = size
        self.history.append(
            {
                "epoch": epoch,
                "trials": [(t.batch_size, t.loss) for t in trials],
                "chosen": size,
                "previous": old,
                "search_bytes": spent,
            }
        )
        log_rank_zero(
            log,
            logging.INFO,
            "AutoAdjust epoch %d: tried %s; batch size %d -> %d per rank",
            epoch,
            ", ".join(f"{t.batch_size}: {t.loss:.6g}" for t in trials) or "nothing",
            old,
            size,
        )

    def _trial(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot, indices: list[int], size: int
    ) -> float:
        """One mini-epoch at ``size`` from the saved state; the average loss over every rank's samples."""
        snapshot.restore(trainer)
        current = resize.current_batch_size(trainer)
        resize.scale_learning_rates(trainer, lr_scale(current, size, self.lr_scaling))
        resize._state(trainer).lr_factor = snapshot.lr_factor  # the trial's factor is rolled back with it
        loader = resize._train_loader(trainer)
        dataset, collate = loader.dataset, loader.collate_fn
        strategy = trainer.strategy
        optimizer = strategy._lightning_optimizers[0]
        epoch = trainer.current_epoch
        total = torch.zeros(2, dtype=torch.float64)
        with _quiet(pl_module):
            for k, start in enumerate(range(0, len(indices), size)):
                batch = collate([dataset[i] for i in indices[start : start + size]])
                batch = strategy.batch_to_device(batch)
                strategy.on_train_batch_start(batch, k)
                n = extract_batch_size(batch)
                seen: list[Tensor] = []

                def closure(batch: Any = batch, k: int = k, seen: list[Tensor] = seen) -> Tensor:
                    out = strategy.training_step(batch, k)
                    loss = out["loss"] if isinstance(out, dict) else out
                    if not isinstance(loss, Tensor):
                        raise ValueError("AutoAdjust needs training_step to return the loss (or a dict with 'loss')")
                    pl_module.optimizer_zero_grad(epoch, k, optimizer)
                    strategy.backward(loss, optimizer)
                    seen.append(loss.detach())
                    return loss

                pl_module.optimizer_step(epoch, k, optimizer, closure)
                total[0] += float(seen[-1].double()) * n
                total[1] += n
        total = _all_reduce_sum(trainer, total)
        return float(total[0] / total[1]) if total[1] > 0 else math.nan

    # ------------------------------------------------------------------ logging and checkpoints

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        resize.log_batch_size(pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        return {
            "chosen": self.chosen,
            "history": self.history,
            "start_size": self._start_size,
            "start_lr": self._start_lr,
            "batch_size": resize.current_batch_size(trainer) if trainer is not None else None,
            "lr_factor": resize.lr_factor(trainer) if trainer is not None else 1.0,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.chosen = state_dict["chosen"]
        self.history = list(state_dict["history"])
        if state_dict.get("batch_size") is not None:
            self._restored = dict(state_dict)


def check_rollback(strategy: Any) -> None:
    """Raise ``ValueError`` (naming the strategy and why) when its state cannot be rolled back."""
    from lightning_commstrats.strategies import CommStrategy, ParameterServerStrategy, PeriodicSyncStrategy

    name = type(strategy).__name__
    if isinstance(strategy, ParameterServerStrategy) and strategy.mode == "async":
        raise ValueError(
            f"AutoAdjust cannot roll back {name}(mode='async'): its servers take every worker's pushes when they"
            " come, and no rank can undo another's trial push or know when it has arrived; use mode='sync'"
        )
    if isinstance(strategy, PeriodicSyncStrategy) and strategy.fault_tolerance is not None:
        raise ValueError(
            f"AutoAdjust cannot roll back {name} with fault_tolerance: the trials' syncs are committed steps of the"
            " torchft quorum, which the other replica groups have seen"
        )
    if isinstance(strategy, CommStrategy):
        if strategy.shard is not None:
            raise ValueError(
                f"AutoAdjust cannot roll back {name}(shard={strategy.shard!r}): putting sharded parameters and"
                " optimizer state back is not supported"
            )
        return
    if type(strategy) in (SingleDeviceStrategy, DDPStrategy):
        return
    raise ValueError(
        f"AutoAdjust cannot roll back {name}: it knows how to put back the state of the package's strategies and"
        " of Lightning's single-device and ddp strategies only"
    )


def _first_lr(trainer: pl.Trainer) -> float:
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    return float(lr)


def _agree_min(trainer: pl.Trainer, value: int) -> int:
    if trainer.world_size == 1:
        return value
    mine = torch.tensor([value], dtype=torch.int64, device=trainer.strategy.root_device)
    return int(trainer.strategy.all_gather(mine).min())


def _all_reduce_sum(trainer: pl.Trainer, total: Tensor) -> Tensor:
    if trainer.world_size == 1:
        return total
    gathered = trainer.strategy.all_gather(total.to(trainer.strategy.root_device))
    return gathered.reshape(-1, total.numel()).sum(0).cpu()


@contextmanager
def _quiet(pl_module: pl.LightningModule) -> Iterator[None]:
    """The trials' ``self.log`` calls (the module's and the callbacks' hooks) are dropped: they
    would otherwise join the epoch's aggregated metrics."""

    def drop(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.log, pl_module.log_dict = drop, drop  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict


class Snapshot:
    """Everything a trial mini-epoch changes, saved once before the search and put back after
    every trial (see :class:`AutoAdjust`, step 2)."""

    def __init__(self) -> None:
        self.tensors: list[tuple[Tensor, Tensor]] = []
        self.grads: list[tuple[Tensor, Tensor | None]] = []
        self.optimizers: list[dict[str, Any]] = []
        self.schedulers: list[dict[str, Any]] = []
        self.precision: dict[str, Any] = {}
        self.strategy: dict[str, Any] | None = None
        self.rng: dict[str, Any] = {}
        self.metrics: list[tuple[Metric, dict[str, Any]]] = []
        self.lr_factor = 1.0

    @classmethod
    def take(cls, trainer: pl.Trainer) -> Snapshot:
        from lightning_commstrats.strategies import CommStrategy

        s = cls()
        strategy = trainer.strategy
        if isinstance(strategy, CommStrategy):  # first: it lets the exchange in flight land
            s.strategy = strategy.take_snapshot()
        module = trainer.lightning_module
        with torch.no_grad():
            s.tensors = [(t, t.detach().clone()) for t in [*module.parameters(), *module.buffers()]]
            s.grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in module.parameters()]
        s.optimizers = [copy.deepcopy(opt.state_dict()) for opt in trainer.optimizers]
        s.schedulers = [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
        s.precision = copy.deepcopy(trainer.precision_plugin.state_dict())
        s.rng = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            s.rng["cuda"] = torch.cuda.get_rng_state_all()
        s.metrics = [(m, _metric_state(m)) for m in module.modules() if isinstance(m, Metric)]
        s.lr_factor = resize.lr_factor(trainer)
        return s

    def restore(self, trainer: pl.Trainer) -> None:
        if self.strategy is not None:  # first: it waits for the exchange a trial left in flight
            trainer.strategy.restore_snapshot(self.strategy)
        with torch.no_grad():
            for t, saved in self.tensors:
                t.copy_(saved)
            for p, grad in self.grads:
                if grad is None:
                    p.grad = None
                elif p.grad is None:
                    p.grad = grad.clone()
                else:
                    p.grad.copy_(grad)
        for opt, saved in zip(trainer.optimizers, self.optimizers, strict=True):
            opt.load_state_dict(copy.deepcopy(saved))
        for config, saved in zip(trainer.lr_scheduler_configs, self.schedulers, strict=True):
            config.scheduler.load_state_dict(copy.deepcopy(saved))
        trainer.precision_plugin.load_state_dict(copy.deepcopy(self.precision))
        torch.set_rng_state(self.rng["torch"])
        random.setstate(self.rng["python"])
        np.random.set_state(self.rng["numpy"])
        if "cuda" in self.rng:
            torch.cuda.set_rng_state_all(self.rng["cuda"])
        for metric, saved in self.metrics:
            for key, value in saved.items():
                setattr(metric, key, copy.deepcopy(value))
        resize._state(trainer).lr_factor = self.lr_factor


def _metric_state(metric: Metric) -> dict[str, Any]:
    state = {key: copy.deepcopy(getattr(metric, key)) for key in metric._defaults}
    state["_update_count"] = metric._update_count
    state["_computed"] = copy.deepcopy(metric._computed)
    return state
