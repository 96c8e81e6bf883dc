"""``allreduce``: fp32 gradients averaged every step by ring all-reduce, the honest baseline.

What DDP does, without the DDP wrapper: after backward (and after gradient accumulation), the
gradients of the parameters of the optimizer that is about to step are fused into buckets and each
bucket is all-reduced and divided by the world size; clipping and ``optimizer.step`` then see the
averaged gradients. Because the exchange sits in the optimizer step rather than in autograd hooks,
it cannot overlap with backward (DDP's advantage on fast networks), but it composes with any
optimizer setup, including several optimizers under manual optimization, and its bytes are the
textbook ``2 (N-1)/N`` of the gradient per rank and step.

Gradient schemes that change how a bucket travels (1-bit, sampled rows) subclass
:class:`AllReduceStrategy` and override :meth:`AllReduceStrategy.exchange`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats.buckets import DEFAULT_BUCKET_CAP_MB, BucketKey
from lightning_commstrats.compression.exchange import GradientCompression, TensorExchange
from lightning_commstrats.sharding import local, tensors_in
from lightning_commstrats.strategies.base import DEFAULT_TIMEOUT, CommStrategy


class AllReduceStrategy(CommStrategy):
    """Data parallelism with gradients averaged by all-reduce every optimizer step.

    The reference every other scheme is measured against: exact synchronous SGD, sending
    ``2 (N-1)/N`` times the gradient bytes per rank and step (see :mod:`lightning_commstrats.comm.wire`).

    A parameter that has no gradient on a rank (unused in its forward) contributes zeros, so after
    the exchange every trainable parameter of the stepping optimizer has the same gradient on every
    rank. Sparse gradients are not supported.

    Args:
        bucket_cap_mb: largest fused buffer per collective, in MiB (default 25, as DDP). Bigger
            buckets mean fewer collectives (less latency); the buckets are kept from step to step,
            one copy of the gradients whatever their size, as DDP's are.
        backend: ``"auto"``, ``"gloo"``, ``"nccl"`` or ``"mpi"`` (see :class:`CommStrategy`).
        timeout: torch.distributed timeout.
        start_method: how Lightning starts ranks (``"popen"`` like ``ddp``, or a multiprocessing method).
        **kwargs: passed to :class:`~lightning_commstrats.strategies.base.CommStrategy`.

    Example::

        import lightning as L
        import lightning_commstrats  # registers "allreduce"

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="allreduce")
        trainer.fit(model)
        print(trainer.strategy.comm_stats)
    """

    strategy_name = "allreduce"
    supports_shard = True

    def __init__(
        self,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        backend: str = "auto",
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            backend=backend, timeout=timeout, start_method=start_method, bucket_cap_mb=bucket_cap_mb, **kwargs
        )

    @override
    def after_backward(self, optimizer: Optimizer) -> None:
        if self.world_size == 1:
            return
        params = trainable_params(optimizer)
        if self.sharding is not None and self.num_models == 1:
            # FSDP2 reduced the gradients inside the one group and nothing crosses groups: no bucket
            # (it would hold a copy of this rank's gradient shards), only the check of non-finite ones
            self.report_nonfinite(nonfinite_names([self.param_name(p) for p in params], [p.grad for p in params]))
            return
        self.allreduce_gradients(params)

    def allreduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Average the gradients of ``params`` over ranks in fused buckets, through :meth:`exchange`."""
        grads = [local(dense_grad(p)) for p in params]
        self.all_reduce_fused(
            grads,
            tag="grad",
            exchange=lambda flat, idx: self.exchange(flat, [params[i] for i in idx]),
            names=[self.param_name(p) for p in params],
        )

    def exchange(self, flat_grad: Tensor, params: Sequence[torch.nn.Parameter]) -> Tensor:
        """Return the average over ranks of one bucket of gradients (``params`` are its owners).

        Override in gradient-compression schemes. Every rank must return the same tensor.
        """
        return self.average_flat(flat_grad, "grad", BucketKey("grad", tuple(self.param_name(p) for p in params)))

    def exchange_compressed(self, compression: GradientCompression, params: Sequence[torch.nn.Parameter]) -> None:
        """Average the gradients of ``params`` through ``compression``: quantized matrices (after its
        warm start) and fp32 small tensors. The new error-feedback residuals wait for the step's vote
        (:meth:`~lightning_commstrats.strategies.reducer.Reducer.hold`): this rank's averages can be
        finite while another rank's, of another shard, are not, and then every rank skips the step."""
        exchange = self.bind_compression(compression)
        bad = compression.average(
            {self.param_name(p): local(dense_grad(p)) for p in params},
            samples_seen=self._samples_at_step * self.world_size,
            steps=self.optimizer_steps,
            commit=False,
        )
        self.reducer.hold(exchange)
        self.report_nonfinite(bad)

    @override
    def resharded_rank_state(
        self, state: dict[str, Any], rank_state: dict[str, Any] | None, saved_world_size: int
    ) -> dict[str, Any]:
        # Gradient schemes keep only error-feedback residuals per rank, cut in stripes that depend
        # on the number of ranks: they restart at zero (the counters and the model are shared).
        return {key: {} for key in self.rank_state_dict()}

    @override
    def schedule_counts_samples(self) -> bool:
        # a compressed exchange whose full-precision warm start ends after a number of samples
        compression: GradientCompression | None = getattr(self, "compression", None)
        if compression is None or compression.bits == 32 or compression.distributed_after_unit != "samples":
            return False
        return not compression.quantizing(self.samples_per_worker * self.world_size, self.optimizer_steps)

    @override
    def scheme_tensors(self) -> list[Tensor]:
        # a compressed exchange (onebit_sgd, onebit_adam, sampled_vocab, expert_parallel): its buckets and residuals
        compression: GradientCompression | None = getattr(self, "compression", None)
        exchange = None if compression is None else compression.exchange
        held = [] if exchange is None else [exchange.fused, exchange.state_dict()]
        settling = getattr(self, "settling", None)  # the Adam schemes' copy of sqrt(v) before the freeze
        if settling is not None:
            held.append(settling.tensors())
        return super().scheme_tensors() + tensors_in(held)

    def check_compression_state(self, compression: GradientCompression, rank_state: dict[str, Any]) -> None:
        """Raise ``ValueError`` when a checkpoint's residuals do not fit this model and world."""
        shapes = {n: local(p).shape for n, p in self.lightning_module.named_parameters()}
        self.bind_compression(compression).check_state(rank_state, shapes)

    def bind_compression(self, compression: GradientCompression) -> TensorExchange:
        """``compression``'s exchange over this strategy's replicas, its fp32 buckets through the
        two-level all-reduce or slow hop where there is one. The one place it is bound: the exchange
        is made at the first call, so a restore that bound it otherwise before the first step would
        have sent every later step's fp32 buckets past the hop."""
        return compression.bind(self.replica_comm, self.bucket_cap_mb, average=self.two_level)


def dense_grad(p: torch.nn.Parameter) -> Tensor:
    """``p.grad``, created as zeros when ``p`` got no gradient on this rank; sparse gradients are refused."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    elif p.grad.is_sparse:
        raise ValueError("lightning_commstrats strategies do not support sparse gradients")
    return p.grad


def nonfinite_names(names: Sequence[str], tensors: Sequence[Tensor | None]) -> list[str]:
    """The ``names`` whose tensor (this rank's part) holds an inf or a NaN: one fused max-norm over all
    of them, one read on the host."""
    held = [(n, local(t)) for n, t in zip(names, tensors, strict=True) if t is not None and local(t).numel()]
    if not held:
        return []
    norms = torch._foreach_norm([t for _, t in held], float("inf"), dtype=torch.float32)
    finite = torch.stack(norms).isfinite().tolist()
    return [n for (n, _), ok in zip(held, finite, strict=True) if not ok]


def trainable_params(optimizer: Optimizer) -> list[torch.nn.Parameter]:
    """The optimizer's parameters that require gradients, in param-group order (the same on every rank)."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
