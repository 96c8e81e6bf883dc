"""What the periodic schemes do to the Trainer around a sync: its step counters, schedulers,
samplers and optimizers' momentum, and the callback that makes a stop wait for the replicas'
agreement."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer

# First-moment buffers of the common optimizers: SGD's momentum and Adam's exp_avg.
MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")


def step_schedulers_once(trainer: Any) -> None:
    """Step the Trainer's per-step learning-rate schedulers once (as its loop does after a step)."""
    if trainer is None:
        return
    for cfg in trainer.lr_scheduler_configs:
        if cfg.interval == "step":
            cfg.scheduler.step()


def set_trainer_steps(trainer: Any, steps: int) -> None:
    """Make the Trainer count ``steps`` optimizer steps done (its ``global_step``), so that a replica
    that healed from a peer stops at the same ``max_steps`` as the run."""
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = (
        epoch_loop.automatic_optimization.optim_progress.optimizer.step
        if trainer.lightning_module.automatic_optimization
        else epoch_loop.manual_optimization.optim_step_progress
    )
    # Inside an optimizer step (a sync applied there) Lightning has counted the step as ready and
    # counts it completed, and the batch as stepped, only after: leave that one to it.
    inside = int(progress.total.ready > progress.total.completed)
    progress.total.ready = steps
    progress.total.completed = steps - inside
    epoch_loop._batches_that_stepped = steps - inside


class AgreedStop(Callback):
    """Fault tolerance: a stop asked by a callback or a time limit (``trainer.should_stop``) waits for the
    next sync, where the replicas agree on it, so that every replica's fit ends at the same step.
    Installed last by the periodic strategy (after ``EarlyStopping`` and ``Timer`` decided)."""

    def __init__(self, strategy: Any) -> None:  # the PeriodicSyncStrategy that installed it
        self.strategy = strategy

    def _defer(self, trainer: Any) -> None:
        strategy = self.strategy
        if trainer.should_stop and strategy.optimizer_steps < strategy._run_end:
            strategy._stop_requested = True
            trainer.should_stop = False

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self._defer(trainer)

    def on_validation_end(self, trainer: Any, *args: Any) -> None:
        self._defer(trainer)

    def on_train_epoch_end(self, trainer: Any, *args: Any) -> None:
        self._defer(trainer)


def reseed_samplers(trainer: Any, seed: int) -> None:
    """Give the training dataloaders' distributed samplers (the ones Lightning put in) ``seed``."""
    from torch.utils.data import DistributedSampler

    combined = trainer.fit_loop._combined_loader
    for loader in [] if combined is None else combined.flattened:
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.seed = seed
        batch_sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if isinstance(batch_sampler, DistributedSampler):
            batch_sampler.seed = seed


def reset_momentum(optimizer: Optimizer, param_ids: set[int] | None = None) -> None:
    """Zero the first-moment buffers (``momentum_buffer``, ``exp_avg``) of ``optimizer``, of the
    parameters whose ``id`` is in ``param_ids`` (all for ``None``)."""
    for p, state in optimizer.state.items():
        if param_ids is not None and id(p) not in param_ids:
            continue
        for key in MOMENTUM_KEYS:
            buf = state.get(key)
            if isinstance(buf, Tensor):
                buf.zero_()
