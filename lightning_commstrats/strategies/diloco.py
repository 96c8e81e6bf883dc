"""``diloco``: local inner steps, an outer Nesterov step on the averaged pseudo-gradient (Douillard et al. 2023)."""

from __future__ import annotations

from typing import Any

from lightning_commstrats.strategies.periodic import PeriodicSyncStrategy
from lightning_commstrats.strategies.periodic_settings import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM


class DiLoCoStrategy(PeriodicSyncStrategy):
    """DiLoCo: every ``sync_period`` inner steps, an outer optimizer steps the global model with the
    averaged pseudo-gradient, sent compressed if asked.

    Stores the global model and the outer optimizer's state (Nesterov momentum), the block
    counters and, per rank, the local weights, the inner optimizer's state and the quantization
    residuals of the pseudo-gradient (all checkpointed; a run resumed mid-block continues exactly).

    The algorithm:

    1. every rank trains alone with the optimizer its LightningModule configures (the inner
       optimizer: AdamW in the paper and in the recipes) for ``sync_period`` steps (or samples per
       worker), starting from the global model ``w``;
    2. the pseudo-gradient ``G = w - w_local`` is averaged over ranks: fp32, or ``pseudo_grad_bits``
       per value on scales per row (``pseudo_grad_codec``) with error feedback (what quantization
       lost is added to the next sync's ``G``), through an all-to-all of packed stripes and an
       all-gather;
    3. the outer optimizer takes one step on ``w`` with ``G`` as its gradient (Nesterov SGD,
       ``lr=0.7``, ``momentum=0.5`` by default; the paper's momentum is 0.9, see below), and every
       rank restarts from the new ``w``.

    Bytes per step and rank are about ``2 (N-1)/N`` of the model times ``pseudo_grad_bits / 8``,
    divided by ``sync_period``: ``32 H / b`` times fewer than fp32 DDP (plus the per-row scales).

    Hyperparameters:

    - ``sync_period`` (``H``): the paper uses 500 steps for 150M-400M parameter models; small
      models and short runs want smaller ``H`` (tens of steps): a block must be long enough to
      amortise the exchange, short enough that the workers' models stay close. Too large: the
      averaged pseudo-gradient points nowhere useful and quality drops; too small: bytes wasted.
    - ``outer_lr`` and ``outer_momentum`` (0.7 and 0.5, Nesterov): on pseudo-gradients that keep
      their direction from one sync to the next, the outer step moves the model by
      ``outer_lr / (1 - outer_momentum)`` times their average in steady state: 1.4x by default. The
      paper's 0.7 and 0.9 make that 7x: right for its long runs from a pretrained start, where
      successive pseudo-gradients of 500 steps point apart, but on a Transformer LM trained from
      scratch (the recipe's ``transformer_small``, 2 ranks, 480 steps at ``sync_period=16``) they
      ended 49% behind DDP at equal samples, worse still at ``sync_period=4``; 0.7 and 0.5 end +4.0%,
      plain averaging (``outer_lr=1, outer_momentum=0``, 1x) +9.4%: averaging the replicas' separately
      normalised AdamW steps loses part of their length, which a gain a little above 1 gives back
      (``benchmarks/results/diloco_defaults/``). For the paper's setting pass ``outer_momentum=0.9``.
      If quality oscillates across syncs, lower ``outer_lr`` first.
    - ``outer_optimizer``: any ``torch.optim.Optimizer`` (class, class path, or callable
      ``params -> Optimizer``); the paper found Nesterov best, Adam as the outer one unstable.
    - ``pseudo_grad_bits``: 32 (the paper), 16, 8 (INTELLECT-1's int8 all-reduce: comparable
      quality at a quarter of the bytes), 4 (Streaming DiLoCo's width) or 2 (with error feedback, as
      MuLoCo/SparseLoCo); fewer bits add noise to the outer step that error feedback repays later.
    - ``pseudo_grad_codec``: how 2, 4 and 8 bits are spent. ``"uniform"`` (default): ``2^bits``
      evenly spaced levels between two float32 scales per row, ``lo`` and ``hi`` = the row's
      ``mean +- k std`` (``k`` = 2, 2.7, 4 at 2, 4, 8 bits) clipped to its ``[min, max]``; this is
      not a paper's codec. ``"e3m0"`` (4 bits only): Streaming DiLoCo's 4-bit float, 1 sign and 3
      exponent bits, ``+-scale * 2^e`` for ``e`` in -6..0 and zero, on one float32 scale per row
      (the row's largest magnitude). See ``benchmarks/results/codec_quality/`` for both measured.
      ``"statistical"`` (2, 4, 8 bits): SparseLoCo's quantizer sent dense, every value of a tensor
      on ``2^bits`` bins over 6 standard deviations around the tensor's mean, each bin decoded as the
      mean of its values (a lookup of ``2^bits`` float32 per tensor), all-gathered; with
      ``error_feedback_decay=0.95``, ``outer_lr=1`` and ``outer_momentum=0`` the decayed error
      feedback takes the place of outer momentum, as in SparseLoCo
      (:mod:`lightning_commstrats.compression.density`; measured in
      ``benchmarks/results/sparseloco/``).
    - ``parallelization_start``: fully synchronous steps (gradients all-reduced) before the first
      block: a warm start, useful when the very first steps move the weights far.
    - ``reset_sgd_momentum``: zero the inner optimizer's first moment after each sync (default
      False: DiLoCo keeps the inner AdamW state across syncs).

    References: A. Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
    Models", 2023; S. Jaghouar et al., "INTELLECT-1 Technical Report", 2024.

    Args:
        sync_period: inner steps (or samples per worker) between syncs (default 500).
        sync_period_unit: ``"steps"`` (default) or ``"samples"``.
        outer_optimizer: ``None`` (Nesterov SGD), class path, ``Optimizer`` subclass or callable.
        outer_lr: outer learning rate (default 0.7).
        outer_momentum: outer momentum (default 0.5; Nesterov with SGD; the paper's 0.9).
        outer_optimizer_kwargs: further outer optimizer arguments.
        pseudo_grad_bits: 32 (default), 16, 8, 4 or 2.
        pseudo_grad_codec: ``"uniform"`` (default), ``"e3m0"`` (with ``pseudo_grad_bits=4``) or
            ``"statistical"`` (with ``pseudo_grad_bits`` 2, 4 or 8; ``error_feedback_decay`` applies).
        parallelization_start: warm start, in ``sync_period_unit``.
        reset_sgd_momentum: zero the inner first moment after each sync.
        **kwargs: :class:`PeriodicSyncStrategy` / :class:`~lightning_commstrats.strategies.base.CommStrategy`
            arguments (``small_tensor_numel``, ``half_dtype``, ``backend``...).

    Example::

        strategy = lightning_commstrats.DiLoCoStrategy(sync_period=50, pseudo_grad_bits=8)
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy)
    """

    strategy_name = "diloco"

    def __init__(
        self,
        sync_period: int = 500,
        sync_period_unit: str = "steps",
        outer_optimizer: Any = None,
        outer_lr: float = DILOCO_OUTER_LR,
        outer_momentum: float = DILOCO_OUTER_MOMENTUM,
        outer_optimizer_kwargs: dict[str, Any] | None = None,
        pseudo_grad_bits: int = 32,
        pseudo_grad_codec: str = "uniform",
        parallelization_start: int = 0,
        reset_sgd_momentum: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            sync_period=sync_period,
            sync_period_unit=sync_period_unit,
            parallelization_start=parallelization_start,
            reset_sgd_momentum=reset_sgd_momentum,
            outer_optimizer=outer_optimizer,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            outer_optimizer_kwargs=outer_optimizer_kwargs,
            pseudo_grad_bits=pseudo_grad_bits,
            pseudo_grad_codec=pseudo_grad_codec,
            **kwargs,
        )
