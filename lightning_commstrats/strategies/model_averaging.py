"""Model averaging (CNTK's ``ModelAveragingSGD``): the periodic scheme whose outer step is the mean."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats.sharding import local
from lightning_commstrats.strategies.allreduce import trainable_params
from lightning_commstrats.strategies.periodic import PeriodicSyncStrategy, refuse_outer_arguments
from lightning_commstrats.strategies.reducer import STATE

WEIGHTINGS = ("uniform", "samples")  # how model averaging weighs the ranks' models


class ModelAveragingStrategy(PeriodicSyncStrategy):
    """Model averaging (CNTK's ``ModelAveragingSGD``): every ``sync_period``, every rank's
    parameters are replaced by their average over ranks.

    Stores the global model of the last synchronisation (for validation and checkpoints) and the
    block counters (and, with ``weighting="samples"``, each rank's count of samples since then).

    It is the periodic scheme whose outer optimizer is SGD with learning rate 1 and no momentum:
    ``w = w_start - G = mean(w_local)``. Each rank runs its optimizer alone on its shard of the
    data; every ``sync_period`` samples per worker (CNTK's unit; CNTK's default is 40,000) or
    optimizer steps, the pseudo-gradient is averaged (fp32 all-reduce; ``pseudo_grad_bits`` < 32
    sends it quantized with error feedback), which costs ``2 (N-1)/N`` of the model per rank once
    per period at 32 bits. CNTK reports that it converges worse than BMUF at the same period: the
    average of models that drifted apart is a step of only ``1/N`` of the combined progress.
    Shorter periods track synchronous SGD more closely and send more; with period 1 and plain SGD
    (no momentum) it equals gradient all-reduce.

    The average: CNTK weights each rank's model by the samples it trained on since the last
    average, ``w = sum_r (n_r / sum n) w_r`` (``weighting="samples"``); the default is the plain
    mean (``weighting="uniform"``). The two are the same whenever every rank trains on as many
    samples per period, which Lightning's distributed sampler gives (it pads the ranks' shards to
    one length); they differ with uneven batches (an ``IterableDataset``, a custom sampler), where
    ``"samples"`` counts every sample once and ``"uniform"`` gives a rank that saw fewer samples as
    much say as the others. The default stays the plain mean because ``"samples"`` costs one more
    (8-byte) all-reduce per average and needs a blocking exchange of the whole model (one
    fragment, no ``fragment_sync_delay``) without ``fault_tolerance``.

    Args:
        sync_period: samples per worker (default 40,000, as CNTK) or steps between averages.
        sync_period_unit: ``"samples"`` or ``"steps"``.
        average_optimizer_state: average the optimizers' float state (momentum, Adam moments) too,
            so that local optimizers restart in agreement (costs as much again per moment buffer).
        parallelization_start: fully synchronous training before this many units (warm start).
        reset_sgd_momentum: zero momentum buffers after each average (default False).
        pseudo_grad_bits: 32 (default), 16, 8, 4 or 2 (see :class:`PeriodicSyncStrategy`).
        weighting: ``"uniform"`` (default: the plain mean over ranks) or ``"samples"`` (CNTK's: each
            rank's model weighted by its own samples, in optimizer steps that ran, since the last
            average; a schedule in samples is still decided on the ranks' agreed count).
        **kwargs: :class:`PeriodicSyncStrategy` / :class:`~lightning_commstrats.strategies.base.CommStrategy`
            arguments (``backend``...).

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
        pseudo_grad_bits: int = 32,
        weighting: str = "uniform",
        **kwargs: Any,
    ) -> None:
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting={weighting!r} is not supported; choose one of {WEIGHTINGS}")
        if weighting == "samples" and kwargs.get("shard") is not None:
            raise ValueError(
                "weighting='samples' is not supported with shard='fsdp' (the ranks of a group hold one model between"
                " them and would weigh its shards by their own counts); use weighting='uniform'"
            )
        refuse_outer_arguments(kwargs, "ModelAveragingStrategy", "nothing: its outer step is the average")
        super().__init__(
            sync_period=sync_period,
            sync_period_unit=sync_period_unit,
            parallelization_start=parallelization_start,
            reset_sgd_momentum=reset_sgd_momentum,
            outer_optimizer="torch.optim.SGD",
            outer_lr=1.0,
            outer_momentum=0.0,
            pseudo_grad_bits=pseudo_grad_bits,
            **kwargs,
        )
        if average_optimizer_state and self.fault_tolerance is not None:
            raise ValueError(
                "average_optimizer_state=True cannot be honoured with fault_tolerance: the optimizer state is"
                " averaged inside a replica only (where it is already the same), never across replicas"
            )
        if weighting == "samples" and (
            self.fault_tolerance is not None or self.num_fragments > 1 or self.fragment_sync_delay
        ):
            raise ValueError(
                "weighting='samples' needs a blocking exchange of the whole model on the job's ranks (num_fragments=1,"
                " fragment_sync_delay=0, no fault_tolerance); use weighting='uniform'"
            )
        self.average_optimizer_state = average_optimizer_state
        self.weighting = weighting
        self._block_samples = 0  # this rank's samples in the steps that ran since the last average
        self._step_samples = 0  # this rank's samples of the optimizer step under way

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.weighting == "samples":
            self._step_samples += extract_batch_size(batch)

    @override
    def on_step_counted(self, optimizer: Optimizer) -> None:
        if self.started:  # the step that ends a warm start is not part of the first block
            self._block_samples += self._step_samples
        self._step_samples = 0
        super().on_step_counted(optimizer)  # may average, with this step's samples counted

    @override
    def end_step(self, optimizer: Optimizer, runs: bool) -> None:
        super().end_step(optimizer, runs)
        self._step_samples = 0  # a skipped step's samples moved no weight

    @override
    def average_pseudo_gradient(self, named: dict[str, Tensor]) -> list[str]:
        self.weigh_by_samples(named)
        return super().average_pseudo_gradient(named)

    def weigh_by_samples(self, named: dict[str, Tensor]) -> None:
        """With ``weighting="samples"``: scale this rank's pseudo-gradient, in place, by
        ``N n_r / sum n`` (``n_r`` its samples since the last average, summed over ranks in one
        all-reduce), so that the mean over ranks is CNTK's ``sum_r (n_r / sum n) (w_start - w_r)``
        and the outer step gives ``sum_r (n_r / sum n) w_r``. No samples on any rank: the plain
        mean, as CNTK. Nothing for ``"uniform"``."""
        mine, self._block_samples = self._block_samples, 0
        if self.weighting != "samples" or self.world_size == 1:
            return
        count = torch.tensor([float(mine)], dtype=torch.float64, device=self.root_device)
        total = float(self.comm.all_reduce(count, tag="control").item())
        scale = self.world_size * mine / total if total > 0 else 1.0
        if scale != 1.0:
            for t in named.values():
                t.mul_(scale)

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return {**super().rank_state_dict(), "block_samples": self._block_samples}

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        super().load_state_dict(state, rank_state)
        # absent from a resharded rank state: its local weights restart at the block's start
        self._block_samples = int(rank_state.get("block_samples", 0))

    @override
    def reset_state(self) -> None:
        super().reset_state()
        self._block_samples = 0

    @override
    def after_sync(self, fragment: int) -> None:
        if self.average_optimizer_state and self.world_size > 1:
            self.average_optimizer_states()

    def average_optimizer_states(self) -> None:
        """Average every optimizer's floating-point state tensors over ranks (tag ``"optimizer_state"``)."""
        for optimizer in self.optimizers:
            named = [
                (f"{self.param_name(p)}.{key}", local(s[key]))
                for p in trainable_params(optimizer)
                if (s := optimizer.state.get(p)) is not None
                for key in sorted(s)
                if isinstance(s[key], Tensor) and s[key].is_floating_point() and s[key].dim() > 0
            ]
            if named:
                self.all_reduce_fused(
                    [t for _, t in named], tag="optimizer_state", names=[n for n, _ in named], route=STATE
                )
        self.reducer.release("optimizer_state")  # once per period and as large as the optimizer state: no standing copy
