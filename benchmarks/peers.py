"""What users would pick instead of this package, as Lightning strategies that run on CPU too.

Lightning's ``DDPStrategy`` registers DDP communication hooks only on CUDA; on CPU it silently
trains with plain all-reduce. :class:`HookedDDPStrategy` registers the hook on any device, so the
comparison really runs torch's hooks:

- ``FP16CompressDDP``: ``fp16_compress_hook`` (gradients all-reduced in float16);
- ``PowerSGDDDP``: ``powerSGD_hook`` with rank ``matrix_approximation_rank``. One DDP bucket for
  the whole model (``bucket_cap_mb`` large): on gloo, PowerSGD's chained all-reduces would
  otherwise run in different orders on different ranks and the job aborts;
- ``PostLocalSGDDDP``: ``post_localSGD_hook`` + ``PeriodicModelAverager``: synchronous for
  ``start_iter`` steps, then local steps with the model averaged every ``period`` steps.

Use them by class path, e.g. ``--trainer.strategy=peers.PowerSGDDDP`` with ``benchmarks`` on
``PYTHONPATH``.
"""

from __future__ import annotations

import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as post_local
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as power_sgd
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override


class HookedDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with its communication hook registered on CPU as well."""

    @override
    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            _register_ddp_comm_hook(
                model=self.model,
                ddp_comm_state=self._ddp_comm_state,
                ddp_comm_hook=self._ddp_comm_hook,
                ddp_comm_wrapper=self._ddp_comm_wrapper,
            )


class FP16CompressDDP(HookedDDPStrategy):
    """DDP with gradients all-reduced in float16."""

    def __init__(self) -> None:
        super().__init__(ddp_comm_hook=default_hooks.fp16_compress_hook)


class PowerSGDDDP(HookedDDPStrategy):
    """DDP with PowerSGD low-rank gradient compression (error feedback, warm start)."""

    def __init__(self, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 10) -> None:
        state = power_sgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter,
        )
        super().__init__(ddp_comm_state=state, ddp_comm_hook=power_sgd.powerSGD_hook, bucket_cap_mb=100_000)


class PostLocalSGDDDP(HookedDDPStrategy):
    """Post-local SGD: synchronous DDP for ``start_iter`` steps, then model averaging every ``period`` steps."""

    def __init__(self, period: int = 8, start_iter: int = 10) -> None:
        # Every rank is its own node here: no gradient all-reduce after the start, only averaging.
        state = post_local.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=start_iter, post_local_gradient_allreduce=False
        )
        super().__init__(
            ddp_comm_state=state,
            ddp_comm_hook=post_local.post_localSGD_hook,
            model_averaging_period=period,
        )
