"""``bmuf``: block-wise model-update filtering with block momentum (Chen & Huo 2016; CNTK's BlockMomentumSGD)."""

from __future__ import annotations

import logging
import math
from typing import Any

from torch import Tensor
from typing_extensions import override

from lightning_commstrats.block_momentum import (
    BlockMomentumFilter,
    block_momentum_from_time_constant,
    time_constant_from_block_momentum,
)
from lightning_commstrats.strategies.periodic import PeriodicSyncStrategy

log = logging.getLogger(__name__)


class BMUFStrategy(PeriodicSyncStrategy):
    """Block momentum: local training in blocks, block averages filtered by momentum into a global model.

    Stores the global model ``w_global``, the block momentum buffer ``delta`` and the block
    counters (all checkpointed, together with every rank's local weights and optimizer state, so
    a run resumed mid-block continues exactly).

    The algorithm (see :mod:`lightning_commstrats.block_momentum`):

    1. every rank trains with its local optimizer for one block of ``sync_period`` samples per
       worker (or optimizer steps), starting from ``w_start``;
    2. the weights are averaged over ranks (one fp32 all-reduce of the model per block);
    3. the block gradient ``G = w_avg - w_start`` is filtered:
       ``delta = block_momentum * delta + block_learning_rate * G``, ``w_global += delta``;
    4. the next block starts from ``w_global + block_momentum * delta`` (Nesterov, default) or from
       ``w_global``; the local optimizer's momentum is zeroed (``reset_sgd_momentum``).

    Hyperparameters:

    - ``sync_period``: samples per worker between synchronisations (CNTK's unit and default,
      120,000) or optimizer steps (``sync_period_unit="steps"``). Bytes per step are the model's
      ring all-reduce divided by the period; longer blocks send less but let workers drift apart.
    - ``block_momentum``: default ``1 - 1/N`` for ``N`` workers (CNTK's rule): averaging ``N``
      models shrinks each block's progress by about ``N``, and momentum ``1 - 1/N`` restores it.
      ``0`` (with ``block_learning_rate=1`` and no Nesterov) is plain model averaging. Too high
      diverges; lower it (or the block learning rate) if the loss oscillates across blocks.
      Alternatively ``block_momentum_as_time_constant`` (``-sync_period / ln(block_momentum)``, in
      the unit of ``sync_period``), which stays meaningful when the period changes.
    - ``block_learning_rate``: scales the block gradient (default 1.0).
    - ``use_nesterov_momentum``: start blocks from the look-ahead point (default True; the paper's
      better variant).
    - ``reset_sgd_momentum``: zero SGD's ``momentum_buffer`` (Adam's first moment ``exp_avg``;
      its second moment and step count are kept) after every synchronisation (default True, as
      CNTK): the block momentum already carries the history.
    - ``parallelization_start``: fully synchronous data parallelism before this many units.

    CNTK's rule of thumb: the training set should hold at least ``time_constant * N`` samples; a
    warning says when it does not (checked for ``sync_period_unit="samples"``).

    Reference: K. Chen and Q. Huo, "Scalable training of deep learning machines by incremental
    block training with intra-block parallel optimization and blockwise model-update filtering",
    ICASSP 2016.

    Args:
        sync_period: block length in ``sync_period_unit``.
        sync_period_unit: ``"samples"`` (per worker) or ``"steps"``.
        block_momentum: in [0, 1); default ``1 - 1/N``.
        block_momentum_as_time_constant: > 0, mutually exclusive with ``block_momentum``.
        block_learning_rate: > 0.
        use_nesterov_momentum: Nesterov-style block starts.
        reset_sgd_momentum: zero local first-moment buffers after each sync.
        parallelization_start: warm start length in ``sync_period_unit``.
        **kwargs: :class:`~lightning_commstrats.strategies.base.CommStrategy` arguments (``backend``...).

    Example::

        trainer = L.Trainer(devices=4, strategy=BMUFStrategy(sync_period=8, sync_period_unit="steps"))
    """

    strategy_name = "bmuf"

    def __init__(
        self,
        sync_period: int = 120_000,
        sync_period_unit: str = "samples",
        block_momentum: float | None = None,
        block_momentum_as_time_constant: float | None = None,
        block_learning_rate: float = 1.0,
        use_nesterov_momentum: bool = True,
        reset_sgd_momentum: bool = True,
        parallelization_start: int = 0,
        **kwargs: Any,
    ) -> None:
        if block_momentum is not None and block_momentum_as_time_constant is not None:
            raise ValueError(
                "give block_momentum or block_momentum_as_time_constant, not both"
                f" (got {block_momentum} and {block_momentum_as_time_constant})"
            )
        if block_momentum is not None and not 0.0 <= block_momentum < 1.0:
            raise ValueError(f"block_momentum must be in [0, 1), got {block_momentum}")
        if block_momentum_as_time_constant is not None and not block_momentum_as_time_constant > 0:
            raise ValueError(f"block_momentum_as_time_constant must be > 0, got {block_momentum_as_time_constant}")
        if not block_learning_rate > 0:
            raise ValueError(f"block_learning_rate must be > 0, got {block_learning_rate}")
        super().__init__(
            sync_period=sync_period,
            sync_period_unit=sync_period_unit,
            parallelization_start=parallelization_start,
            reset_sgd_momentum=reset_sgd_momentum,
            **kwargs,
        )
        self._block_momentum = block_momentum
        self._time_constant = block_momentum_as_time_constant
        self.block_learning_rate = block_learning_rate
        self.use_nesterov_momentum = use_nesterov_momentum
        self._filter: BlockMomentumFilter | None = None

    @property
    def block_momentum(self) -> float:
        """The block momentum in force (``1 - 1/N`` unless given)."""
        if self._block_momentum is not None:
            return self._block_momentum
        if self._time_constant is not None:
            return block_momentum_from_time_constant(self._time_constant, self.sync_period)
        return 1.0 - 1.0 / self.world_size

    @property
    def time_constant(self) -> float:
        """``-sync_period / ln(block_momentum)``, in the unit of ``sync_period``."""
        return time_constant_from_block_momentum(self.block_momentum, self.sync_period)

    @property
    def filter(self) -> BlockMomentumFilter:
        if self._filter is None:
            self._filter = BlockMomentumFilter(
                self.block_momentum, self.block_learning_rate, self.use_nesterov_momentum
            )
        return self._filter

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        log.info(
            "BMUF: block momentum %.4f (time constant %.0f %s), block learning rate %g, Nesterov %s",
            self.block_momentum,
            self.time_constant,
            self.sync_period_unit,
            self.block_learning_rate,
            self.use_nesterov_momentum,
        )
        self._warn_short_training_set()

    def _warn_short_training_set(self) -> None:
        if self.sync_period_unit != "samples" or not self.block_momentum:
            return
        trainer = self.lightning_module.trainer
        loader = trainer.train_dataloader
        dataset = getattr(loader, "dataset", None)
        try:
            n_samples = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            return
        needed = self.time_constant * self.world_size
        if math.isfinite(needed) and n_samples < needed:
            log.warning(
                "BMUF: the training set has %d samples, fewer than CNTK's rule of thumb time_constant x workers"
                " = %.0f x %d = %.0f; consider a smaller block_momentum or sync_period",
                n_samples,
                self.time_constant,
                self.world_size,
                needed,
            )

    @override
    def begin(self, weights: Tensor) -> None:
        self.filter.start(weights)

    @override
    def combine(self, averaged: Tensor) -> Tensor:
        return self.filter.update(averaged)

    @override
    def global_weights(self) -> Tensor | None:
        return None if self._filter is None else self._filter.w_global

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["filter"] = None if self._filter is None or self._filter.w_global is None else self._filter.state_dict()
        return state

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        saved = state.get("filter")
        if saved is not None and saved["w_global"].numel() != sum(p.numel() for p in self.params):
            raise ValueError(
                f"its global model has {saved['w_global'].numel()} weights, this model has a different size"
            )
        super().load_state_dict(state, rank_state)
        if saved is not None:
            self.filter.load_state_dict(
                {k: v.to(self.root_device) if isinstance(v, Tensor) else v for k, v in saved.items()}
            )

    @override
    def reset_state(self) -> None:
        super().reset_state()
        self._filter = None
