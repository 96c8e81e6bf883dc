"""Changing the per-rank batch size in the middle of ``fit``, without dropping or repeating a sample.

How to use it, from a callback (every rank must make the same calls with the same values)::

    from lightning_commstrats.batching import make_resizable, set_batch_size, log_batch_size

    class GrowTheBatch(L.Callback):
        def on_train_start(self, trainer, pl_module):
            make_resizable(trainer)  # once the train DataLoader exists; idempotent

        def on_train_epoch_start(self, trainer, pl_module):
            make_resizable(trainer)  # again: a reloaded DataLoader is a new one

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 100:
                set_batch_size(trainer, 64, lr_scaling="sqrt")
            log_batch_size(pl_module)  # ``train/batch_size``, once per batch whoever calls it

What it does:

- :func:`make_resizable` replaces the training DataLoader's batch sampler by a
  :class:`ResizableBatchSampler` over the same sampler (Lightning's ``DistributedSampler`` on
  several ranks), with the same ``batch_size`` and ``drop_last``; the other DataLoader arguments
  are kept (Lightning re-creates the DataLoader the way it does to insert its sampler). It must run
  before the epoch's first batch is drawn: ``on_train_start`` or ``on_train_epoch_start``. A
  DataLoader built with ``batch_sampler=ResizableBatchSampler(...)`` is used as it is (Lightning
  puts its distributed sampler inside it).
- :func:`set_batch_size` sets the size of the batches not yet drawn, and updates Lightning's count
  of this epoch's batches (``num_training_batches``, and ``val_check_batch`` when
  ``val_check_interval`` is a fraction of the epoch) so the epoch ends after its last sample. It is
  a collective (8 bytes per rank: the ranks check they agree; a disagreement raises on every rank).
  With ``lr_scaling`` it also multiplies every optimizer's learning rate (and the schedulers' base
  rates) by ``new / old`` (``"linear"``), ``sqrt(new / old)`` (``"sqrt"``) or not at all (``"none"``,
  the default). :func:`lr_factor` is the product of those factors since fit started.

When a change takes effect: at the next batch the DataLoader draws. With ``num_workers=0`` that is
the next batch of the training loop (Lightning draws nothing ahead from a DataLoader that has a
length); with ``num_workers=w`` the workers already hold up to ``w * prefetch_factor`` batches
of the old size, which come first. A change made in ``on_train_epoch_start`` applies from the
epoch's first batch, except in the first epoch with workers (Lightning starts them before the hook).

The data: every rank walks its own order of the epoch (its sampler's), cut into consecutive
batches of whatever size is current when each is drawn, so each sample of the epoch is used once,
whatever the changes. An epoch whose batches grow has fewer batches (its last one is shorter, or
dropped with ``drop_last=True``, as any epoch); ``trainer.num_training_batches`` is kept right, and
so is the total of Lightning's tqdm progress bar (another bar's total is not redrawn). The size
carries over to the next epochs. Periods counted in samples (``sync_period_unit="samples"``,
``distributed_after``) keep their meaning; periods in optimizer steps hold more samples once the
batch grows.

Not supported (a clear error from :func:`make_resizable`): several training DataLoaders, an
``IterableDataset``, a DataLoader without a plain ``BatchSampler`` (``batch_size=None``, a custom
batch sampler), ``limit_train_batches`` other than 1.0 (it counts batches whose size changes).

While AutoAdjust trains its trial mini-epochs, :func:`in_trial` is true: the trials call the usual
hooks (``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``); a callback that
measures training should skip them then.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

BATCH_SIZE_KEY = "train/batch_size"
LR_SCALINGS = ("linear", "sqrt", "none")


class ResizableBatchSampler(BatchSampler):
    """Batches of ``sampler``'s indices whose size may change between two batches.

    Each epoch it draws ``sampler``'s order once and hands out consecutive slices of it, each of
    the size current when it is drawn; :attr:`position` counts the samples of the epoch handed out.
    :meth:`upcoming` tells the next samples without taking them.

    Args:
        sampler: the order of sample indices (``SequentialSampler``, ``RandomSampler``,
            ``DistributedSampler``...).
        batch_size: samples per batch, per rank, at the start.
        drop_last: drop an epoch's last batch when it is shorter than the size current then.
    """

    def __init__(self, sampler: Sampler[int] | Any, batch_size: int, drop_last: bool = False) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self._order: list[int] = []
        self._key: Any = None  # the sampler's epoch when the order was drawn
        self._ready = False  # an order drawn ahead (by upcoming) for the epoch about to start
        self._running = False  # an epoch's batches are being handed out
        self.position = 0
        self.batches = 0  # batches handed out this epoch
        self._sizes: list[int] = []  # their sizes

    @property
    def size(self) -> int:
        """Samples per batch from the next batch on."""
        return self.batch_size

    @size.setter
    def size(self, value: int) -> None:
        self.batch_size = check_batch_size(value, "batch_size")

    def _draw(self) -> None:
        self._order = [int(i) for i in self.sampler]
        self._key = getattr(self.sampler, "epoch", None)
        self.position = 0
        self.batches = 0
        self._sizes = []

    def _exhausted(self) -> bool:
        left = len(self._order) - self.position
        return left <= 0 or (self.drop_last and left < self.batch_size)

    def upcoming(self, n: int, consumed: int | None = None) -> list[int]:
        """The next ``n`` (or fewer, at the epoch's end) indices this rank will train on: after the
        first ``consumed`` batches of the epoch (those the training loop has taken; DataLoader
        workers may hold more), or after all the batches handed out (``None``). Between two epochs
        (or before the first), the first ones of the next epoch: call it after the sampler's
        ``set_epoch`` (in ``on_train_epoch_start`` or later)."""
        epoch = getattr(self.sampler, "epoch", None)
        if self._running and not self._exhausted():
            if self.position == 0 and self._key != epoch:  # made before set_epoch: the order it will use
                self._draw()
        elif not (self._ready and self._key == epoch):
            self._draw()
            self._ready, self._running = True, False
        start = self.position if consumed is None else sum(self._sizes[:consumed])
        return self._order[start : start + n]

    def __iter__(self) -> Iterator[list[int]]:
        # The epoch begins when its iterator is made (as a DataLoader iterator is made), so that
        # ``len()`` counts the new epoch at once; an order drawn ahead is used if the sampler's
        # epoch is still the one it was drawn for.
        if not (self._ready and self._key == getattr(self.sampler, "epoch", None)):
            self._draw()
        self._ready, self._running = False, True
        return self._batches()

    def _batches(self) -> Iterator[list[int]]:
        first = True
        while True:
            if first and self.position == 0 and self._key != getattr(self.sampler, "epoch", None):
                self._draw()  # set_epoch came after the iterator was made (a resumed run)
            first = False
            if self._exhausted():
                return
            batch = self._order[self.position : self.position + self.batch_size]
            self.position += len(batch)
            self.batches += 1
            self._sizes.append(len(batch))
            yield batch

    def __len__(self) -> int:
        """Batches of the epoch under way (those handed out and those left at the current size), or
        of a whole epoch between two."""
        if self._running or self._ready:
            return self.batches + _batches_in(len(self._order) - self.position, self.batch_size, self.drop_last)
        return _batches_in(len(self.sampler), self.batch_size, self.drop_last)  # type: ignore[arg-type]


def _batches_in(samples: int, size: int, drop_last: bool) -> int:
    if samples <= 0:
        return 0
    return samples // size if drop_last else -(-samples // size)


def check_batch_size(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def lr_scale(old: int, new: int, rule: str) -> float:
    """The factor by which ``rule`` multiplies the learning rate when the batch goes from ``old`` to
    ``new`` samples: ``new / old`` (``"linear"``: the rate per sample stays, CNTK's convention),
    ``sqrt(new / old)`` (``"sqrt"``) or 1 (``"none"``)."""
    if rule not in LR_SCALINGS:
        raise ValueError(f"lr_scaling must be one of {LR_SCALINGS}, got {rule!r}")
    if rule == "linear":
        return new / old
    if rule == "sqrt":
        return math.sqrt(new / old)
    return 1.0


@dataclass
class _Resizing:
    """What this module keeps on a Trainer between calls."""

    sampler: ResizableBatchSampler | None = None
    loader: DataLoader | None = None
    lr_factor: float = 1.0
    trial: bool = False
    logged_at: tuple[int, int] = (-1, -1)


_ATTR = "_commstrats_resizing"


def _state(trainer: pl.Trainer) -> _Resizing:
    state = trainer.__dict__.get(_ATTR)
    if state is None:
        state = _Resizing()
        trainer.__dict__[_ATTR] = state
    return state


def _train_loader(trainer: pl.Trainer) -> DataLoader:
    combined = trainer.fit_loop._combined_loader
    if combined is None:
        raise RuntimeError(
            "the training DataLoader is not set up yet: call make_resizable from on_train_start or later"
        )
    loaders = combined.flattened
    if len(loaders) != 1:
        raise ValueError(f"a batch size that changes needs one training DataLoader, this fit has {len(loaders)}")
    return loaders[0]


def make_resizable(trainer: pl.Trainer) -> ResizableBatchSampler:
    """Make the training DataLoader's batches resizable (see the module's notes); returns its
    :class:`ResizableBatchSampler`. Idempotent; call it in ``on_train_start`` and again in
    ``on_train_epoch_start`` (a DataLoader reloaded by ``reload_dataloaders_every_n_epochs`` is new:
    it gets the size in use)."""
    state = _state(trainer)
    loader = _train_loader(trainer)
    if trainer.limit_train_batches != 1.0:
        raise ValueError(
            f"limit_train_batches={trainer.limit_train_batches!r} counts batches, whose size changes here;"
            " leave it at 1.0 (use max_steps to shorten a run)"
        )
    if isinstance(loader.batch_sampler, ResizableBatchSampler):
        if state.sampler is not None and loader.batch_sampler is not state.sampler:
            loader.batch_sampler.size = state.sampler.size  # a DataLoader of the user's, reloaded
        state.sampler, state.loader = loader.batch_sampler, loader
        refresh_lengths(trainer)
        return loader.batch_sampler
    if state.loader is loader and state.sampler is not None:
        return state.sampler
    _check_resizable(loader)
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None and fetcher.fetched > 0 and not fetcher.done:
        raise RuntimeError(
            "make_resizable must run before the epoch's first batch (on_train_start or on_train_epoch_start):"
            " the batches already drawn cannot be re-cut"
        )
    old = loader.batch_sampler
    assert isinstance(old, BatchSampler)
    size = state.sampler.size if state.sampler is not None else old.batch_size
    sampler = ResizableBatchSampler(old.sampler, size, old.drop_last)
    args, kwargs = _get_dataloader_init_args_and_kwargs(loader, old.sampler)
    kwargs.update(sampler=None, shuffle=False, batch_sampler=sampler, batch_size=1, drop_last=False)
    new = _reinstantiate_wrapped_cls(loader, *args, **kwargs)
    _shutdown_workers_and_reset_iterator(loader)
    combined = trainer.fit_loop._combined_loader
    assert combined is not None
    combined.flattened = [new]
    if fetcher is not None:
        # the loop's iterator over the new DataLoader (nothing was drawn from the old one); making
        # it draws a worker seed from the global generator, which the old iterator did already: put
        # the generator back so the run's random numbers are those of a run without this
        rng = torch.get_rng_state()
        iter(fetcher)
        torch.set_rng_state(rng)
    state.sampler, state.loader = sampler, new
    refresh_lengths(trainer)
    return sampler


def _check_resizable(loader: Any) -> None:
    if not isinstance(loader, DataLoader):
        raise TypeError(f"a batch size that changes needs a torch DataLoader for training, got {type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset) or not isinstance(loader.dataset, Sized):
        raise ValueError(
            "a batch size that changes needs a map-style dataset (indexable, with a length), not an iterable one"
        )
    if type(loader.batch_sampler) is not BatchSampler:
        raise ValueError(
            "a batch size that changes needs a DataLoader built with batch_size=... (a plain BatchSampler);"
            f" this one has batch_sampler={type(loader.batch_sampler).__name__}. Build it with"
            " batch_sampler=lightning_commstrats.batching.ResizableBatchSampler(sampler, batch_size, drop_last)"
        )


def refresh_lengths(trainer: pl.Trainer) -> None:
    """Tell Lightning's training loop how many batches this epoch has now (after a size change)."""
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    state = _state(trainer)
    if combined is None or state.sampler is None:
        return
    n = len(state.sampler)
    combined.limits = [n]
    if combined._iterator is not None:
        combined._iterator.limits = [n]
    fit_loop.max_batches = n
    fetcher = fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = n
        fetcher.done = fetcher.fetched >= n
    interval = trainer.val_check_interval
    if (
        getattr(trainer, "_val_check_time_interval", None) is None
        and isinstance(interval, float)
        and trainer.val_check_batch is not None
    ):
        trainer.val_check_batch = max(1, int(n * interval))
    _redraw_bar_total(trainer)


def _redraw_bar_total(trainer: pl.Trainer) -> None:
    """Lightning's tqdm bar takes the epoch's count of batches when the epoch starts; after a change
    its total (and so its time left) follows the new count, as Lightning would count it."""
    bar = trainer.progress_bar_callback
    if not isinstance(bar, TQDMProgressBar) or not bar.is_enabled or bar._train_progress_bar is None:
        return
    bar._train_progress_bar.total = convert_inf(bar.total_train_batches)
    bar._train_progress_bar.refresh()


def current_batch_size(trainer: pl.Trainer) -> int:
    """The per-rank size of the next batch: the resizable sampler's, else the DataLoader's."""
    state = _state(trainer)
    if state.sampler is not None:
        return state.sampler.size
    loader = _train_loader(trainer)
    size = getattr(loader.batch_sampler, "batch_size", None) or loader.batch_size
    if size is None:
        raise ValueError("the training DataLoader has no batch size (batch_size=None)")
    return int(size)


def lr_factor(trainer: pl.Trainer) -> float:
    """The product of the learning-rate factors :func:`set_batch_size` applied since fit started."""
    return _state(trainer).lr_factor


def scale_learning_rates(trainer: pl.Trainer, factor: float) -> None:
    """Multiply every optimizer's learning rate by ``factor``, and the LR schedulers' base rates (and
    a param group's ``initial_lr``) with it, so a scheduler's next value is scaled alike."""
    if factor == 1.0:
        return
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in group:
                    value = group[key]
                    group[key] = value * factor if not isinstance(value, torch.Tensor) else value.mul_(factor)
    for config in trainer.lr_scheduler_configs:
        base = getattr(config.scheduler, "base_lrs", None)
        if base is not None:
            config.scheduler.base_lrs = [b * factor for b in base]
    _state(trainer).lr_factor *= factor


def set_batch_size(trainer: pl.Trainer, size: int, lr_scaling: str = "none") -> int:
    """Collective. From the next batch drawn on, ``size`` samples per batch on every rank; returns
    the size before. ``lr_scaling``: ``"linear"``, ``"sqrt"`` or ``"none"`` (see :func:`lr_scale`)."""
    size = check_batch_size(size, "size")
    lr_scale(1, 1, lr_scaling)  # a bad rule fails before anything changes
    sampler = make_resizable(trainer)
    strategy = trainer.strategy
    if trainer.world_size > 1:
        mine = torch.tensor([size], dtype=torch.int64, device=strategy.root_device)
        every = strategy.all_gather(mine).reshape(-1).tolist()
        if len(set(every)) != 1:
            raise ValueError(f"set_batch_size: the ranks asked for different sizes {every}; every rank must agree")
    old = sampler.size
    if size != old:
        scale_learning_rates(trainer, lr_scale(old, size, lr_scaling))
        sampler.size = size
        refresh_lengths(trainer)
    return old


def in_trial(trainer: pl.Trainer | None) -> bool:
    """Whether AutoAdjust is training a trial mini-epoch now (its steps are rolled back after)."""
    return trainer is not None and _state(trainer).trial


def set_trial(trainer: pl.Trainer, trial: bool) -> None:
    """Mark the trial mini-epochs (AutoAdjust's search) as under way or over."""
    _state(trainer).trial = trial


def log_batch_size(pl_module: pl.LightningModule) -> None:
    """Log ``train/batch_size`` (per rank, the size of the next batch) once per training batch,
    whichever callbacks call it. From a training hook (``on_train_batch_start``/``end``)."""
    trainer = pl_module.trainer
    state = _state(trainer)
    at = (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.total.ready)
    if state.logged_at == at:
        return
    state.logged_at = at
    pl_module.log(BATCH_SIZE_KEY, float(current_batch_size(trainer)), on_step=True, on_epoch=False)
