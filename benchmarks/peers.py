"""What users would pick instead of this package, as Lightning strategies that run on CPU too.

Lightning's ``DDPStrategy`` registers DDP communication hooks only on CUDA; on CPU it silently
trains with plain all-reduce. :class:`HookedDDPStrategy` registers the hook on any device, so the
comparison really runs torch's hooks:

- ``FP16CompressDDP``: ``fp16_compress_hook`` (gradients all-reduced in float16);
- ``PowerSGDDDP``: ``powerSGD_hook`` with rank ``matrix_approximation_rank``. One DDP bucket for
  the whole model (``bucket_cap_mb`` large): on gloo, PowerSGD's chained all-reduces would
  otherwise run in different orders on different ranks and the job aborts;
- ``PostLocalSGDDDP``: ``post_localSGD_hook`` + ``PeriodicModelAverager``: synchronous for
  ``start_iter`` steps, then local steps with the model averaged every ``period`` steps;
- ``DiLoCoDDP``: DiLoCo written in plain torch, the way the OpenDiLoCo reference script does it
  (:class:`DiLoCoOuter`): local inner steps with no gradient all-reduce, and every ``sync_period``
  steps the averaged pseudo-gradient stepped by an outer Nesterov SGD on a global fp32 copy. Nothing
  of ``lightning_commstrats`` is imported here, so it is an independent reference.

Use them by class path, e.g. ``--trainer.strategy=peers.PowerSGDDDP`` with ``benchmarks`` on
``PYTHONPATH``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as post_local
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as power_sgd
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
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


def local_gradient_hook(state, bucket):  # unannotated: DDP rejects the string annotations of this module
    """A DDP communication hook that communicates nothing: every rank keeps its own gradient
    (what ``post_localSGD_hook`` does after its start)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class DiLoCoOuter:
    """The outer step of DiLoCo (Douillard et al. 2023) as the OpenDiLoCo reference script writes it.

    Keeps the global copy of the parameters on the CPU in fp32 and an outer
    ``torch.optim.SGD(lr, momentum, nesterov=True)`` over it. :meth:`step`:

    1. pseudo-gradient ``g = global - local`` for every parameter (a descent direction);
    2. ``g`` averaged over the ranks by ``all_reduce_mean`` (one flat buffer, one collective);
    3. the outer optimizer steps the global copy with ``g`` as its gradient;
    4. every local parameter is overwritten with the new global copy.

    Args:
        params: the model's parameters at the start (identical on every rank).
        lr: outer learning rate (paper: 0.7).
        momentum: outer Nesterov momentum (paper: 0.9).
        nesterov: Nesterov momentum (paper: True).
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> None:
        self.global_params = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
        self.optimizer = torch.optim.SGD(self.global_params, lr=lr, momentum=momentum, nesterov=nesterov)
        self.syncs = 0

    @torch.no_grad()
    def step(self, local_params: Iterable[Tensor], all_reduce_mean: Callable[[Tensor], Tensor]) -> None:
        """One outer step; ``all_reduce_mean`` returns the mean over ranks of a flat fp32 CPU tensor."""
        local = list(local_params)
        if len(local) != len(self.global_params):
            raise ValueError(f"expected {len(self.global_params)} parameters, got {len(local)}")
        flat = torch.cat(
            [(g - p.detach().cpu().float()).reshape(-1) for g, p in zip(self.global_params, local, strict=True)]
        )
        flat = all_reduce_mean(flat)
        offset = 0
        for g in self.global_params:
            g.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for g, p in zip(self.global_params, local, strict=True):
            p.copy_(g.to(p.device, p.dtype))
        self.syncs += 1


def _all_reduce_mean(t: Tensor) -> Tensor:
    dist.all_reduce(t)  # gloo has no AVG
    return t.div_(dist.get_world_size())


class DiLoCoDDP(HookedDDPStrategy):
    """DiLoCo in plain torch: the model's own optimizer steps locally on every rank (no gradient
    all-reduce: :func:`local_gradient_hook`), and every ``sync_period`` optimizer steps
    :class:`DiLoCoOuter` averages the pseudo-gradients with ``torch.distributed.all_reduce`` (fp32)
    and applies the outer Nesterov SGD.

    Args:
        sync_period: inner steps between outer steps, ``H`` (paper: 500).
        outer_lr: outer learning rate (paper: 0.7).
        outer_momentum: outer Nesterov momentum (paper: 0.9).

    Validation sees the global copy (the model of the last outer step; the start before the first),
    as this package's periodic strategies do, and training resumes from the local weights after it.
    ``comm_seconds`` (seconds inside the outer all-reduce, waiting included) and ``syncs`` are read
    by ``probe.BenchProbe``.
    """

    def __init__(self, sync_period: int = 500, outer_lr: float = 0.7, outer_momentum: float = 0.9) -> None:
        if sync_period < 1:
            raise ValueError(f"sync_period must be >= 1 step, got {sync_period}")
        super().__init__(ddp_comm_hook=local_gradient_hook)
        self.sync_period = sync_period
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.outer: DiLoCoOuter | None = None
        self.comm_seconds = 0.0
        self._inner_steps = 0
        self._stash: list[Tensor] | None = None

    def _params(self) -> list[Tensor]:
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # wrapping in DDP broadcast rank 0's weights: every rank starts equal
        if trainer.state.fn == TrainerFn.FITTING:
            self.outer = DiLoCoOuter(self._params(), self.outer_lr, self.outer_momentum)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._inner_steps += 1
        if self.outer is not None and self._inner_steps % self.sync_period == 0:
            self.outer.step(self._params(), self._timed_all_reduce_mean)
        return out

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.outer is not None:
            params = self._params()
            self._stash = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, g in zip(params, self.outer.global_params, strict=True):
                    p.copy_(g.to(p.device, p.dtype))

    @override
    def on_validation_end(self) -> None:
        if self._stash is not None:
            with torch.no_grad():
                for p, local in zip(self._params(), self._stash, strict=True):
                    p.copy_(local)
            self._stash = None
        super().on_validation_end()

    def _timed_all_reduce_mean(self, t: Tensor) -> Tensor:
        start = time.perf_counter()
        out = _all_reduce_mean(t)
        self.comm_seconds += time.perf_counter() - start
        return out

    @property
    def syncs(self) -> int:
        return 0 if self.outer is None else self.outer.syncs
