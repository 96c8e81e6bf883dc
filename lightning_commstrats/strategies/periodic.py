"""Weight-exchange schemes: ranks train alone and average their weights every ``sync_period``.

:class:`PeriodicSyncStrategy` is the machinery shared by ``model_averaging``, ``bmuf`` and
``local_sgd``: counting the period (samples per worker, as CNTK, or optimizer steps), the warm
start, the averaging itself (fused fp32 all-reduce of every parameter, tag ``"weights"``), resetting
the local optimizer's momentum, a final synchronisation when fit ends, validation on the global
model, and checkpoints that restore a run mid-block (each rank's local weights and optimizer state
travel in the checkpoint; the checkpoint's ``state_dict`` holds the global model).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats.buckets import flatten, unflatten_into
from lightning_commstrats.strategies.allreduce import dense_grad, trainable_params
from lightning_commstrats.strategies.base import CommStrategy

log = logging.getLogger(__name__)

UNITS = ("samples", "steps")
# First-moment buffers of the common optimizers: SGD's momentum and Adam's exp_avg.
MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")


class PeriodicSyncStrategy(CommStrategy):
    """Local training with weights averaged every ``sync_period`` (base of the weight-exchange schemes).

    Args:
        sync_period: length of a block between synchronisations, in ``sync_period_unit``.
        sync_period_unit: ``"samples"`` (per worker, CNTK's unit) or ``"steps"`` (optimizer steps).
        parallelization_start: warm start, in ``sync_period_unit``: before it, gradients are
            averaged every step (fully synchronous data parallelism); the first block starts there.
        reset_sgd_momentum: zero the local optimizers' first-moment buffers after every
            synchronisation (SGD's ``momentum_buffer``, Adam's ``exp_avg``; Adam's second moment
            ``exp_avg_sq`` and step counts are kept).
        **kwargs: passed to :class:`~lightning_commstrats.strategies.base.CommStrategy`.
    """

    def __init__(
        self,
        sync_period: int,
        sync_period_unit: str = "samples",
        parallelization_start: int = 0,
        reset_sgd_momentum: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(sync_period, bool) or not isinstance(sync_period, int) or sync_period <= 0:
            raise ValueError(f"sync_period must be a positive int, got {sync_period!r}")
        if sync_period_unit not in UNITS:
            raise ValueError(f"sync_period_unit={sync_period_unit!r} is not supported; choose one of {UNITS}")
        if not isinstance(parallelization_start, int) or parallelization_start < 0:
            raise ValueError(f"parallelization_start must be an int >= 0, got {parallelization_start!r}")
        super().__init__(**kwargs)
        self.sync_period = sync_period
        self.sync_period_unit = sync_period_unit
        self.parallelization_start = parallelization_start
        self.reset_sgd_momentum = reset_sgd_momentum
        self.started = False  # past the warm start
        self._block_start = 0  # progress (samples or steps) when the current block began
        self._global: Tensor | None = None  # the global model (flat fp32), identical on every ranks
        self._stash: list[Tensor] | None = None  # local weights while validation uses the global model

    # ------------------------------------------------------------------ what subclasses define

    def combine(self, averaged: Tensor) -> Tensor:
        """The weights every rank continues from, given the average; sets ``self._global``."""
        self._global = averaged.clone()
        return averaged

    def begin(self, weights: Tensor) -> None:
        """The first block starts from ``weights`` (identical on every rank)."""
        self._global = weights.clone()

    def global_weights(self) -> Tensor | None:
        """The global model as a flat float32 vector (what validation and checkpoints see), once started."""
        return self._global

    # ------------------------------------------------------------------ parameters as one vector

    @property
    def params(self) -> list[torch.nn.Parameter]:
        assert self.lightning_module is not None
        return list(self.lightning_module.parameters())

    def flat_weights(self) -> Tensor:
        return flatten([p.detach().float() for p in self.params])

    def load_flat(self, flat: Tensor) -> None:
        with torch.no_grad():
            unflatten_into(flat, [p.data for p in self.params])

    # ------------------------------------------------------------------ the step

    def _progress(self) -> int:
        return self.samples_per_worker if self.sync_period_unit == "samples" else self.optimizer_steps

    @property
    def since_sync(self) -> int:
        """Samples or steps trained since the last synchronisation (0 before the first block)."""
        return self._progress() - self._block_start if self.started else 0

    def _start(self) -> None:
        self.started = True
        self._block_start = self._progress()
        self.begin(self.flat_weights())

    @override
    def after_backward(self, optimizer: Optimizer) -> None:
        if not self.started and self.world_size > 1:
            # warm start: fully synchronous data parallelism
            self.all_reduce_fused([dense_grad(p) for p in trainable_params(optimizer)], tag="grad")

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.last_step_skipped:
            return output
        if self.started:
            if self.since_sync >= self.sync_period:
                self.synchronize()
        elif self._progress() >= self.parallelization_start:
            self._start()
        return output

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # restores a checkpoint's state first
        if not self.started and self.parallelization_start == 0:
            self._start()

    def synchronize(self) -> None:
        """End the block: average the weights, combine, continue from the result."""
        self.load_flat(self.combine(self.averaged_weights()))
        self._block_start = self._progress()
        if self.reset_sgd_momentum:
            for optimizer in self.optimizers:
                reset_momentum(optimizer)

    def averaged_weights(self) -> Tensor:
        """The average over ranks of the flat weights (one fused fp32 all-reduce, tag ``"weights"``)."""
        flat = self.flat_weights()
        if self.world_size > 1:
            self.all_reduce_fused([flat], tag="weights")
        return flat

    @override
    def on_train_end(self) -> None:
        # the saved model is the global one, identical on every rank
        if self.started and self.since_sync > 0:
            self.synchronize()
        final = self.global_weights()
        if final is not None:
            self.load_flat(final)
        super().on_train_end()

    # ------------------------------------------------------------------ validation on the global model

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        global_weights = self.global_weights()
        if global_weights is not None and self.since_sync > 0:
            self._stash = [p.detach().clone() for p in self.params]
            self.load_flat(global_weights)

    @override
    def on_validation_end(self) -> None:
        if self._stash is not None:
            with torch.no_grad():
                for p, local in zip(self.params, self._stash, strict=True):
                    p.copy_(local)
            self._stash = None
        super().on_validation_end()

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        flat = self.global_weights()
        if flat is None or self.since_sync == 0:
            return state
        # the checkpoint's model is the global one; each rank's local weights go in its rank state
        slices, offset = {}, 0
        for p in self.params:
            slices[p.data_ptr()] = (flat[offset : offset + p.numel()].view_as(p).to(p.dtype), p.shape)
            offset += p.numel()
        for key, value in state.items():
            match = slices.get(value.data_ptr())
            if match is not None and match[1] == value.shape:  # every name of a tied parameter too
                state[key] = match[0].clone()
        return state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "block_start": self._block_start,
            "started": self.started,
            "global": self._global,
        }

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return {
            "weights": self.flat_weights(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
        }

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        n = sum(p.numel() for p in self.params)
        if rank_state["weights"].numel() != n:
            raise ValueError(f"it holds {rank_state['weights'].numel()} weights and this model has {n}")
        super().load_state_dict(state, rank_state)
        self._block_start = int(state["block_start"])
        self.started = bool(state["started"])
        self._global = None if state["global"] is None else state["global"].to(self.root_device, torch.float32)
        self.load_flat(rank_state["weights"].to(self.root_device))
        for optimizer, opt_state in zip(self.optimizers, rank_state["optimizers"], strict=True):
            optimizer.load_state_dict(opt_state)

    @override
    def reset_state(self) -> None:
        self.started = False
        self._global = None


def reset_momentum(optimizer: Optimizer) -> None:
    """Zero the first-moment buffers (``momentum_buffer``, ``exp_avg``) of ``optimizer``."""
    for state in optimizer.state.values():
        for key in MOMENTUM_KEYS:
            buf = state.get(key)
            if isinstance(buf, Tensor):
                buf.zero_()


class ModelAveragingStrategy(PeriodicSyncStrategy):
    """Model averaging (CNTK's ``ModelAveragingSGD``): every ``sync_period``, every rank's
    parameters are replaced by their average over ranks.

    Stores the global model of the last synchronisation (for validation and checkpoints) and the
    block counters.

    Each rank runs its optimizer alone on its shard of the data; every ``sync_period`` samples
    per worker (CNTK's unit; CNTK's default is 40,000) or optimizer steps, the fp32 weights are
    all-reduced and averaged, which costs ``2 (N-1)/N`` of the model per rank once per period.
    CNTK reports that it converges worse than BMUF at the same period: the average of models
    that drifted apart is a step of only ``1/N`` of the combined progress. Shorter periods track
    synchronous SGD more closely and send more; with period 1 and plain SGD (no momentum) it equals
    gradient all-reduce exactly.

    Args:
        sync_period: samples per worker (default 40,000, as CNTK) or steps between averages.
        sync_period_unit: ``"samples"`` or ``"steps"``.
        average_optimizer_state: average the optimizers' float state (momentum, Adam moments) too,
            so that local optimizers restart in agreement (costs as much again per moment buffer).
        parallelization_start: fully synchronous training before this many units (warm start).
        reset_sgd_momentum: zero momentum buffers after each average (default False).
        **kwargs: :class:`~lightning_commstrats.strategies.base.CommStrategy` arguments (``backend``...).

    Example::

        trainer = L.Trainer(devices=4, strategy=ModelAveragingStrategy(sync_period=16, sync_period_unit="steps"))
    """

    strategy_name = "model_averaging"

    def __init__(
        self,
        sync_period: int = 40_000,
        sync_period_unit: str = "samples",
        average_optimizer_state: bool = False,
        parallelization_start: int = 0,
        reset_sgd_momentum: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            sync_period=sync_period,
            sync_period_unit=sync_period_unit,
            parallelization_start=parallelization_start,
            reset_sgd_momentum=reset_sgd_momentum,
            **kwargs,
        )
        self.average_optimizer_state = average_optimizer_state

    @override
    def synchronize(self) -> None:
        super().synchronize()
        if self.average_optimizer_state and self.world_size > 1:
            self.average_optimizer_states()

    def average_optimizer_states(self) -> None:
        """Average every optimizer's floating-point state tensors over ranks (tag ``"optimizer_state"``)."""
        for optimizer in self.optimizers:
            states = [optimizer.state[p] for p in trainable_params(optimizer) if p in optimizer.state]
            buffers = [
                s[key]
                for s in states
                for key in sorted(s)
                if isinstance(s[key], Tensor) and s[key].is_floating_point() and s[key].dim() > 0
            ]
            if buffers:
                self.all_reduce_fused(buffers, tag="optimizer_state")
