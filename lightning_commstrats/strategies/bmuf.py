"""``bmuf``: block-wise model-update filtering with block momentum (Chen & Huo 2016; CNTK's BlockMomentumSGD)."""

from __future__ import annotations

import logging
import math
from typing import Any

from typing_extensions import override

from lightning_commstrats._logging import log_rank_zero
from lightning_commstrats.outer import (
    BlockMomentum,
    OuterFactory,
    block_momentum_from_time_constant,
    time_constant_from_block_momentum,
)
from lightning_commstrats.strategies.periodic import PeriodicSyncStrategy, refuse_outer_arguments

log = logging.getLogger(__name__)


class BMUFStrategy(PeriodicSyncStrategy):
    """Block momentum: local training in blocks, block averages filtered by momentum into a global model.

    Stores the global model ``w_global``, the block momentum buffer ``delta`` and the block
    counters (all checkpointed, together with every rank's local weights and optimizer state, so
    a run resumed mid-block continues exactly).

    It is the periodic scheme whose outer optimizer is the block-momentum filter
    (:class:`~lightning_commstrats.outer.BlockMomentum`):

    1. every rank trains with its local optimizer for one block of ``sync_period`` samples per
       worker (or optimizer steps), starting from ``w_start``;
    2. the pseudo-gradient ``G = w_start - w_local`` is averaged over ranks (one fp32 all-reduce of
       the model per block, or ``pseudo_grad_bits`` per value with error feedback);
    3. the block update is filtered: ``delta = block_momentum * delta - block_learning_rate * G``
       (the paper's ``eta * delta + zeta * (w_avg - w_start)``), ``w_global += delta``;
    4. the next block starts from ``w_global + block_momentum * delta`` (Nesterov, default) or from
       ``w_global``; the local optimizer's momentum is zeroed (``reset_sgd_momentum``). Validation
       and saved checkpoints see ``w_global``, never the look-ahead point.

    Where this differs from CNTK: CNTK's ``BlockMomentumSGD`` scales the averaged block gradient by
    ``(1 - block_momentum)``: ``delta = bm * delta + (1 - bm) * block_lr * (w_avg - w_start)``, a
    filter of unit gain (a constant block gradient adds up to ``block_lr`` times itself per block).
    This package keeps the paper's form, whose gain is ``block_learning_rate / (1 - bm)``: a CNTK
    setting ``block_lr`` is this package's ``block_learning_rate = (1 - bm) * block_lr``.

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
    - ``pseudo_grad_bits``: 32 (default) or 16, 8, 4, 2 bits per value of ``G`` on the wire.

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
        pseudo_grad_bits: 32, 16, 8, 4 or 2.
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
        pseudo_grad_bits: int = 32,
        **kwargs: Any,
    ) -> None:
        refuse_outer_arguments(kwargs, "BMUFStrategy", "block_momentum, block_learning_rate and use_nesterov_momentum")
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
            pseudo_grad_bits=pseudo_grad_bits,
            **kwargs,
        )
        self._block_momentum = block_momentum
        self._time_constant = block_momentum_as_time_constant
        self.block_learning_rate = block_learning_rate
        self.use_nesterov_momentum = use_nesterov_momentum

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

    @override
    def outer_factory(self) -> OuterFactory:
        momentum, lr, nesterov = self.block_momentum, self.block_learning_rate, self.use_nesterov_momentum
        return lambda params: BlockMomentum(params, lr=lr, momentum=momentum, nesterov=nesterov)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        log_rank_zero(
            log,
            logging.INFO,
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
        trainer = self.trainer
        loader = trainer.train_dataloader if trainer is not None else None
        dataset = getattr(loader, "dataset", None)
        try:
            n_samples = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            return
        needed = self.time_constant * self.world_size
        if math.isfinite(needed) and n_samples < needed:
            log_rank_zero(
                log,
                logging.WARNING,
                "BMUF: the training set has %d samples, fewer than CNTK's rule of thumb time_constant x workers"
                " = %.0f x %d = %.0f; consider a smaller block_momentum or sync_period",
                n_samples,
                self.time_constant,
                self.world_size,
                needed,
            )
