"""``bmuf``: block-wise model-update filtering with block momentum (Chen & Huo 2016), in the paper's form or CNTK's
``BlockMomentumSGD``'s."""

from __future__ import annotations

import logging
import math
from typing import Any

from typing_extensions import override

from lightning_commstrats._logging import log_rank_zero
from lightning_commstrats.outer import (
    BlockMomentum,
    CNTKBlockMomentum,
    OuterFactory,
    block_momentum_from_time_constant,
    time_constant_from_block_momentum,
)
from lightning_commstrats.strategies.periodic import PeriodicSyncStrategy, refuse_outer_arguments

log = logging.getLogger(__name__)

VARIANTS = ("paper", "cntk")


class BMUFStrategy(PeriodicSyncStrategy):
    """Block momentum: local training in blocks, block averages filtered by momentum into a global model.

    Stores the global model ``w_global``, the block momentum buffer ``delta`` and the block
    counters (all checkpointed, together with every rank's local weights and optimizer state, so
    a run resumed mid-block continues exactly).

    It is the periodic scheme whose outer optimizer is the block-momentum filter, in one of two
    forms (``variant``). The paper's (``"paper"``, the default;
    :class:`~lightning_commstrats.outer.BlockMomentum`):

    1. every rank trains with its local optimizer for one block of ``sync_period`` samples per
       worker (or optimizer steps), starting from ``w_start``;
    2. the pseudo-gradient ``G = w_start - w_local`` is averaged over ranks (one fp32 all-reduce of
       the model per block, or ``pseudo_grad_bits`` per value with error feedback);
    3. the block update is filtered: ``delta = block_momentum * delta - block_learning_rate * G``
       (the paper's ``eta * delta + zeta * (w_avg - w_start)``), ``w_global += delta``;
    4. the next block starts from ``w_global + block_momentum * delta`` (Nesterov, default) or from
       ``w_global``; the local optimizer's momentum is zeroed (``reset_sgd_momentum``). Validation
       and saved checkpoints see ``w_global``, never the look-ahead point.

    CNTK's (``"cntk"``, CNTK's ``BlockMomentumSGD`` step for step;
    :class:`~lightning_commstrats.outer.CNTKBlockMomentum`) sums the block gradients over the ``N``
    workers and keeps no separate global model: ``sg = bm * sg + (1 - bm) * blr * N * G``, the next
    block starts from ``w_start - sg`` or, with Nesterov, ``w_start - (1 + bm) * sg``, and that
    start point is the model validation and checkpoints see. The two forms:

    - without Nesterov, CNTK's block learning rate ``blr`` is the paper form's
      ``block_learning_rate = N * (1 - bm) * blr`` (with CNTK's defaults, ``bm = 1 - 1/N`` and
      ``blr = 1``, that is 1, this form's default);
    - with Nesterov they differ from the second block on, whatever the learning rates: CNTK's
      look-ahead stays in its model and the next update lands on top of it, the paper's is re-added
      to ``w_global`` at each block start. Workers that each move one unit per block, at ``N = 4``
      with the defaults, start their blocks at 1.75, 4.06, 6.80 in the paper's form and at 1.75,
      4.81, 8.86 in CNTK's.

    Hyperparameters:

    - ``sync_period``: samples per worker between synchronisations (CNTK's ``blockSizePerWorker``
      and its default, 120,000; CNTK's ``blockSize`` counts over all workers, ``N`` times this) or
      optimizer steps (``sync_period_unit="steps"``). Bytes per step are the model's ring
      all-reduce divided by the period; longer blocks send less but let workers drift apart.
    - ``block_momentum``: default ``1 - 1/N`` for ``N`` workers (CNTK's rule): averaging ``N``
      models shrinks each block's progress by about ``N``, and momentum ``1 - 1/N`` restores it.
      ``0`` (with ``block_learning_rate=1`` and no Nesterov) is plain model averaging. Too high
      diverges; lower it (or the block learning rate) if the loss oscillates across blocks.
    - ``block_momentum_as_time_constant``: the block momentum as the time constant ``T`` of the
      filter, which stays meaningful when the period changes. Its unit depends on ``variant``:
      ``"paper"``: the unit of ``sync_period`` per worker, ``block_momentum = exp(-sync_period / T)``;
      ``"cntk"``: CNTK's ``blockMomentumAsTimeConstant``, counted over all workers (samples, or
      optimizer steps, summed over the ``N`` workers), ``block_momentum = exp(-N * sync_period / T)``.
      A per-worker ``T`` is ``N`` times smaller than CNTK's for the same momentum.
    - ``block_learning_rate``: the paper's ``zeta`` (``"paper"``) or CNTK's ``blockLearningRate``
      (``"cntk"``), default 1.0 in both; see the conversion above.
    - ``use_nesterov_momentum``: start blocks from the look-ahead point (default True; the paper's
      better variant, CNTK's default).
    - ``reset_sgd_momentum``: zero SGD's ``momentum_buffer`` (Adam's first moment ``exp_avg``;
      its second moment and step count are kept) after every synchronisation (default True, as
      CNTK): the block momentum already carries the history.
    - ``parallelization_start``: fully synchronous data parallelism before this many units.
    - ``pseudo_grad_bits``: 32 (default) or 16, 8, 4, 2 bits per value of ``G`` on the wire.

    CNTK's rule of thumb: the training set should hold at least the time constant over all workers
    (``N`` times the per-worker one) in samples; a warning says when it does not (checked for
    ``sync_period_unit="samples"``).

    Reference: K. Chen and Q. Huo, "Scalable training of deep learning machines by incremental
    block training with intra-block parallel optimization and blockwise model-update filtering",
    ICASSP 2016.

    Args:
        sync_period: block length in ``sync_period_unit``, per worker.
        sync_period_unit: ``"samples"`` (per worker) or ``"steps"``.
        block_momentum: in [0, 1); default ``1 - 1/N``.
        block_momentum_as_time_constant: > 0, mutually exclusive with ``block_momentum``; per worker
            (``"paper"``) or over all workers (``"cntk"``).
        block_learning_rate: > 0.
        use_nesterov_momentum: Nesterov-style block starts.
        reset_sgd_momentum: zero local first-moment buffers after each sync.
        parallelization_start: warm start length in ``sync_period_unit``.
        pseudo_grad_bits: 32, 16, 8, 4 or 2.
        variant: ``"paper"`` (default) or ``"cntk"``; ``"cntk"`` does not take ``fault_tolerance``
            (it sums over a fixed number of workers, and the replicas of a quorum change).
        **kwargs: :class:`~lightning_commstrats.strategies.base.CommStrategy` arguments (``backend``...).

    Example::

        trainer = L.Trainer(devices=4, strategy=BMUFStrategy(sync_period=8, sync_period_unit="steps"))
        # CNTK's BlockMomentumSGD with blockSizePerWorker=8000 and blockMomentumAsTimeConstant=64000
        cntk = BMUFStrategy(sync_period=8000, variant="cntk", block_momentum_as_time_constant=64000)
        trainer = L.Trainer(devices=4, strategy=cntk)  # block momentum exp(-4 x 8000 / 64000) = 0.61
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
        variant: str = "paper",
        **kwargs: Any,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r} is not supported; choose one of {VARIANTS}")
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
        if variant == "cntk" and self.fault_tolerance is not None:
            raise ValueError(
                "variant='cntk' cannot be honoured with fault_tolerance: CNTK sums the block gradients of a fixed"
                " number of workers, and the replicas of a quorum change from sync to sync; use variant='paper'"
            )
        self.variant = variant
        self._block_momentum = block_momentum
        self._time_constant = block_momentum_as_time_constant
        self.block_learning_rate = block_learning_rate
        self.use_nesterov_momentum = use_nesterov_momentum

    @property
    def _period_of_time_constant(self) -> int:
        """The block length in the time constant's unit: per worker (paper), over all workers (CNTK)."""
        return self.sync_period * (self.world_size if self.variant == "cntk" else 1)

    @property
    def block_momentum(self) -> float:
        """The block momentum in force (``1 - 1/N`` unless given)."""
        if self._block_momentum is not None:
            return self._block_momentum
        if self._time_constant is not None:
            return block_momentum_from_time_constant(self._time_constant, self._period_of_time_constant)
        return 1.0 - 1.0 / self.num_models

    @property
    def time_constant(self) -> float:
        """``-period / ln(block_momentum)`` in the unit of ``sync_period``, with ``period`` the block
        length per worker (``"paper"``) or over all workers (``"cntk"``, CNTK's
        ``blockMomentumAsTimeConstant``)."""
        return time_constant_from_block_momentum(self.block_momentum, self._period_of_time_constant)

    @override
    def outer_factory(self) -> OuterFactory:
        momentum, lr, nesterov = self.block_momentum, self.block_learning_rate, self.use_nesterov_momentum
        if self.variant == "cntk":
            workers = self.num_models
            return lambda params: CNTKBlockMomentum(
                params, lr=lr, momentum=momentum, nesterov=nesterov, workers=workers
            )
        return lambda params: BlockMomentum(params, lr=lr, momentum=momentum, nesterov=nesterov)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "variant": self.variant}

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        saved = state.get("variant", "paper")
        if saved != self.variant:
            # the two filters keep different state (the paper's delta beside w_global, CNTK's smoothed
            # gradient beside the start point): one cannot continue the other
            raise ValueError(f"it was saved with variant={saved!r} and this run has variant={self.variant!r}")
        super().load_state_dict(state, rank_state)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        log_rank_zero(
            log,
            logging.INFO,
            "BMUF (%s form): block momentum %.4f (time constant %.0f %s %s), block learning rate %g, Nesterov %s",
            self.variant,
            self.block_momentum,
            self.time_constant,
            self.sync_period_unit,
            "over all workers" if self.variant == "cntk" else "per worker",
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
        # the time constant over all workers (the paper form's is per worker)
        needed = self.time_constant * (1 if self.variant == "cntk" else self.world_size)
        if math.isfinite(needed) and n_samples < needed:
            log_rank_zero(
                log,
                logging.WARNING,
                "BMUF: the training set has %d samples, fewer than CNTK's rule of thumb: the block momentum's time"
                " constant over all %d workers, %.0f samples; consider a smaller block_momentum or sync_period",
                n_samples,
                self.world_size,
                needed,
            )
