"""``expert_parallel``: MoE experts sharded over ranks, tokens moved by all-to-all, in a dp x ep layout."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats._logging import log_rank_zero
from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.exchange import BucketedAllReduce, GradientCompression
from lightning_commstrats.moe.layer import MoELayer
from lightning_commstrats.moe.placement import clipped_by_the_strategy, squared_norm
from lightning_commstrats.sharding import local
from lightning_commstrats.strategies.allreduce import AllReduceStrategy, dense_grad, trainable_params
from lightning_commstrats.strategies.base import agreed_buffer_ids

log = logging.getLogger(__name__)

INNER = ("dp", "ep")


def layout_groups(world_size: int, dp: int, ep: int, inner: str) -> tuple[list[list[int]], list[list[int]]]:
    """The expert-parallel groups and the data-parallel groups of a ``dp x ep`` layout.

    ``inner`` is the dimension whose ranks are neighbours (consecutive ranks, e.g. one node or one
    supernode): ``"dp"`` puts the replicas of the same experts next to each other and spreads each
    expert-parallel group across them (the 2022 paper's hierarchical layout); ``"ep"`` keeps each
    expert-parallel group together (the symmetric layout).
    """
    if dp * ep != world_size:
        raise ValueError(f"dp_size x ep_size = {dp} x {ep} = {dp * ep} must equal the world size {world_size}")
    if inner not in INNER:
        raise ValueError(f"inner={inner!r} is not supported; choose one of {INNER}")
    if inner == "dp":
        rank = lambda e, d: e * dp + d  # noqa: E731
    else:
        rank = lambda e, d: d * ep + e  # noqa: E731
    ep_groups = [[rank(e, d) for e in range(ep)] for d in range(dp)]
    dp_groups = [[rank(e, d) for d in range(dp)] for e in range(ep)]
    return ep_groups, dp_groups


class ExpertParallelStrategy(AllReduceStrategy):
    """Expert parallelism for mixture-of-experts models, in a data x expert parallel layout.

    Stores the expert-parallel and data-parallel communicators; every rank's experts and optimizer
    state are saved per rank in checkpoints.

    The ``world = dp x ep`` ranks form ``dp`` expert-parallel groups of ``ep`` ranks; in each, rank
    ``i`` holds experts ``i * E/ep .. (i+1) * E/ep - 1`` of every MoE layer. Each step:

    1. each MoE layer routes its tokens (router replicated on every rank), sends every token to the
       rank of its expert and gets the result back (two all-to-alls with uneven splits, tag
       ``"tokens"``, transposed in backward);
    2. dense gradients (attention, embeddings, routers...) are averaged over all ranks, by fp32
       all-reduce or by any quantization of ``onebit_sgd`` (``num_quantization_bits``);
    3. expert gradients are summed only over the ``dp`` replicas of those experts (tag
       ``"grad_experts"``, fused into buckets of at most ``bucket_cap_mb`` as the dense ones) and
       divided by the world size: each owner's gradient already holds its expert-parallel group's
       tokens, so the result is the data-parallel average.

    Layout: ``inner="dp"`` (default) puts an expert's replicas on neighbouring ranks and spreads the
    all-to-all across them: the hierarchical choice of the 2022 paper on 174-trillion-parameter
    MoE training (data parallel inside a supernode, expert parallel across supernodes, 1.6x faster
    than the symmetric layout on its pruned fat-tree). ``inner="ep"`` keeps each expert-parallel
    group on neighbouring ranks. Which is faster depends on how many tokens cross the slow links
    against how many expert weights do: ``benchmarks/moe_layout.py`` measures both.

    With ``shard="fsdp"`` (ZeRO inside the hierarchy): the dense parameters, their gradients and
    optimizer state are sharded by FSDP2 over the layout's inner dimension, the ranks on the fast
    links (the ``dp`` replicas of the same experts with ``inner="dp"``, an expert-parallel group with
    ``inner="ep"``; ``group_size`` is that size, and another one is refused). FSDP2 leaves the
    experts whole (``ignored_params``): each rank keeps its own experts and their optimizer state as
    unsharded. FSDP2 reduce-scatters the dense gradients inside the group; the strategy's exchange
    (fp32 or quantized) averages the shards across the groups, rank ``i`` of every group with rank
    ``i``; expert gradients travel over their replicas as unsharded. The clip by norm counts the
    dense shards of a group once and every expert once.

    Checkpoints: each rank's experts go into the checkpoint per rank; loading onto another world
    size or ``ep_size`` is an error (no re-sharding). The expert bias of ``balance="bias"`` is the
    same on every rank (updated from the load summed over all ranks), saved with the model and left
    out of the buffer averaging.

    Args:
        ep_size: ranks per expert-parallel group (default: the world size, i.e. ``dp = 1``).
        dp_size: replicas of each expert (default: world size / ``ep_size``).
        inner: ``"dp"`` or ``"ep"``: which dimension is on neighbouring ranks.
        num_quantization_bits: dense-gradient exchange: 32 (fp32 all-reduce) or 1, 2, 4, 8, 16.
        distributed_after, distributed_after_unit, small_tensor_numel, half_dtype: the warm start
            and codec of the dense exchange, as in :class:`OneBitSGDStrategy`.
        **kwargs: :class:`AllReduceStrategy` / :class:`CommStrategy` arguments.
    """

    strategy_name = "expert_parallel"
    supports_shard = True

    def __init__(
        self,
        ep_size: int | None = None,
        dp_size: int | None = None,
        inner: str = "dp",
        num_quantization_bits: int = 32,
        distributed_after: int = 0,
        distributed_after_unit: str = "samples",
        small_tensor_numel: int = 1024,
        half_dtype: str = "float16",
        **kwargs: Any,
    ) -> None:
        for name, value in (("ep_size", ep_size), ("dp_size", dp_size)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if inner not in INNER:
            raise ValueError(f"inner={inner!r} is not supported; choose one of {INNER}")
        gradient_compression = GradientCompression(
            num_quantization_bits,
            distributed_after,
            distributed_after_unit,
            small_tensor_numel,
            half_dtype,
            residuals=kwargs.get("residuals", "device"),  # the compressed exchange's, as the slow hop's
        )
        super().__init__(**kwargs)
        self.compression = gradient_compression
        self._ep_size = ep_size
        self._dp_size = dp_size
        self.inner = inner
        self.ep_comm: Communicator | None = None
        self.dp_comm: Communicator | None = None
        self._expert_buckets: BucketedAllReduce | None = None

    @property
    def ep_size(self) -> int:
        if self._ep_size is not None:
            return self._ep_size
        return self.world_size // self._dp_size if self._dp_size else self.world_size

    @property
    def dp_size(self) -> int:
        return self._dp_size if self._dp_size is not None else self.world_size // self.ep_size

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        if not self.num_nodes * self.num_processes:
            return
        inner = self._inner_size(self.world_size)
        if self.sharding is not None:  # FSDP2 over the inner dimension: the ranks on the fast links
            self.group_size = self.sharding.group_size = inner

    @override
    def site_size(self) -> int | None:
        # the inner dimension's consecutive ranks sit on fast links: the tokens' all-to-all stays
        # inside them with inner="ep", the expert gradients' all-reduce with inner="dp"
        inner = self._inner_size(self.world_size)
        return inner if 1 < inner < self.world_size else None

    @override
    def check_layout(self, world_size: int) -> None:
        """The expert layout fits ``world_size`` ranks (checked before they start)."""
        self._inner_size(world_size)
        if self.sharding is None:
            super().check_layout(world_size)

    def _inner_size(self, world_size: int) -> int:
        """The ranks of the layout's inner dimension on ``world_size`` ranks; ``ValueError`` naming the
        setting where the layout does not fit them."""
        if self._ep_size is not None:
            ep_size = self._ep_size
        else:
            ep_size = world_size // self._dp_size if self._dp_size else world_size
        if not ep_size or world_size % ep_size:
            given = f"ep_size={ep_size}" if self._ep_size is not None else f"dp_size={self._dp_size}"
            raise ValueError(f"{given} must divide the world size {world_size} (devices x num_nodes)")
        dp_size = self._dp_size if self._dp_size is not None else world_size // ep_size
        if dp_size * ep_size != world_size:
            raise ValueError(
                f"dp_size x ep_size = {dp_size} x {ep_size} must equal the world size {world_size}"
                " (devices x num_nodes)"
            )
        inner = dp_size if self.inner == "dp" else ep_size
        if self.sharding is not None and self.group_size is not None and self.group_size != inner:
            raise ValueError(
                f"expert_parallel with shard='fsdp' shards the dense part over the layout's inner dimension"
                f" (inner={self.inner!r}: {inner} ranks); group_size={self.group_size!r} disagrees: leave it out"
                f" or pass {inner}"
            )
        return inner

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints hold sharded experts: load them into the model once it is sharded."""
        return True

    # ------------------------------------------------------------------ sharding

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.lightning_module.modules() if isinstance(m, MoELayer)]

    def expert_params(self) -> list[torch.nn.Parameter]:
        return [p for layer in self.moe_layers() for p in layer.experts.parameters()]

    @override
    def params_kept_whole(self) -> set[torch.nn.Parameter]:
        return set(self.expert_params())

    @override
    def kept_whole_index(self) -> int:
        # built empty, the experts are drawn by the expert-parallel rank, not by the FSDP2 group's
        # index (the data-parallel one with inner="dp": every expert-parallel rank would draw the same)
        assert self.ep_comm is not None
        return self.ep_comm.rank

    @override
    def is_expert_param(self, name: str, p: torch.nn.Parameter) -> bool:
        return any(p is q for layer in self.moe_layers() for q in layer.experts.parameters())

    @override
    def configure_model_parallel(self) -> None:
        layers = self.moe_layers()
        if not layers:
            raise ValueError("expert_parallel needs a model with MoE layers (lightning_commstrats.moe.MoELayer)")
        for layer in layers:
            if layer.num_experts % self.ep_size:
                raise ValueError(f"num_experts={layer.num_experts} is not divisible by ep_size={self.ep_size}")
        ep_groups, dp_groups = layout_groups(self.world_size, self.dp_size, self.ep_size, self.inner)
        self.ep_comm = self.comm.new_subgroups(ep_groups)
        self.dp_comm = self.comm.new_subgroups(dp_groups)
        # the expert gradients travel over the replicas only, fused as the dense ones are
        self._expert_buckets = BucketedAllReduce(self.dp_comm, int(self.bucket_cap_mb * 2**20))
        for layer in layers:
            layer.shard(self.ep_comm)
        log.info(
            "expert_parallel: rank %d holds experts %d.. of %d per layer; dp=%d x ep=%d, %s inner",
            self.global_rank,
            layers[0].experts.first,
            layers[0].num_experts,
            self.dp_size,
            self.ep_size,
            self.inner,
        )
        super().configure_model_parallel()  # a model built on the meta device: its experts materialised here

    @override
    def synchronize_initial_weights(self) -> None:
        experts = {id(p) for p in self.expert_params()}
        with torch.no_grad():
            for p in self.lightning_module.parameters():
                if id(p) in experts:
                    self.dp_comm.broadcast(p.data, 0, tag="setup")  # replicas of the same experts agree
                elif local(p).numel():  # sharded: rank i of every group takes group 0's rank i's shard
                    self.replica_comm.broadcast(local(p).data, 0, tag="setup")
            for b in self.lightning_module.buffers():
                self.comm.broadcast(b.data, 0, tag="setup")

    @override
    def resharded_rank_state(
        self, state: dict[str, Any], rank_state: dict[str, Any] | None, saved_world_size: int
    ) -> dict[str, Any]:
        raise ValueError("expert_parallel does not re-shard experts over another number of ranks")

    @override
    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        experts = {id(p) for p in self.expert_params()}  # each rank holds other experts
        return {n: local(p).detach() for n, p in self.lightning_module.named_parameters() if id(p) not in experts}

    @override
    def buffers_to_sync(self) -> list[torch.Tensor]:
        # buffers of expert modules differ by design (each rank holds other experts); agreed ones
        # (the expert bias of bias balancing) are the same everywhere already
        experts = {id(p) for p in self.expert_params()}
        agreed = agreed_buffer_ids(self.lightning_module)
        shared = []
        for module in self.lightning_module.modules():
            own = list(module.parameters(recurse=False))
            if own and all(id(p) in experts for p in own):
                continue
            shared.extend(b for b in module.buffers(recurse=False) if id(b) not in agreed)
        return shared

    # ------------------------------------------------------------------ gradients

    @override
    def setup_scheme(self) -> None:
        super().setup_scheme()
        if self.world_size > 1:
            # The clip by norm is this strategy's (over the whole model, see _clip_by_global_norm);
            # Lightning's, run after it on each rank's own gradients, would scale each rank by its
            # own factor (slightly below 1 when a rank's norm is within 1e-6 of the clipped
            # global one) and the replicated dense gradients would drift apart. Value clipping
            # (element-wise, the same on every replica) stays Lightning's.
            plugin = self.precision_plugin
            plugin.clip_grad_by_norm = clipped_by_the_strategy  # type: ignore[method-assign]

    @override
    def after_backward(self, optimizer: Optimizer) -> None:
        if self.world_size == 1:
            return
        params = trainable_params(optimizer)
        experts = {id(p) for p in self.expert_params()}
        dense = [p for p in params if id(p) not in experts]
        self.exchange_compressed(self.compression, dense)
        # An owner's expert gradient already sums the contributions of its whole expert-parallel
        # group (backward brought them through the all-to-all); summing over the replicas and
        # dividing by the world size gives the data-parallel average, as for dense parameters.
        expert_grads = [dense_grad(p) for p in params if id(p) in experts]
        flags: list[torch.Tensor] = []
        if self.dp_size > 1:
            self._expert_buckets(expert_grads, tag="grad_experts", exchange=self._sum_replicas, finite_flags=flags)
        elif expert_grads:
            torch._foreach_div_(expert_grads, self.world_size)
            flags = [torch.isfinite(torch.stack(torch._foreach_norm(expert_grads))).all()]
        self._check_experts(flags)
        self._clip_by_global_norm([dense_grad(p) for p in dense], expert_grads)

    def _check_experts(self, flags: list[torch.Tensor]) -> None:
        """Ranks hold different experts: whether every expert's gradient is finite is agreed over
        all ranks (one int per rank gathered, tag ``"control"``, one host synchronisation), and the
        ranks whose experts are not are reported on every rank, for the ``nonfinite`` policy."""
        ok = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=self.root_device)
        every = self.comm.all_gather((~ok).to(torch.int32).reshape(1), tag="control").reshape(-1)
        bad = [r for r, b in enumerate(every.tolist()) if b]
        if bad:
            self.report_nonfinite([f"the experts of rank {r}" for r in bad])

    def _sum_replicas(self, flat: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """One bucket of expert gradients: summed over the experts' replicas, divided by the world size."""
        return self.dp_comm.all_reduce(flat, "sum", tag="grad_experts").div_(self.world_size)

    def _clip_by_global_norm(self, dense: list[torch.Tensor], experts: list[torch.Tensor]) -> None:
        """Clip by the norm over the whole model, the same factor on every rank.

        Lightning clips by the norm of the gradients a rank holds. Ranks hold different experts, so
        that norm, and the factor it would apply to the replicated dense gradients, differs between
        ranks and the replicas drift apart. Here the norm counts the dense gradients once and every
        expert once (the squared norms of an expert-parallel group's shards summed, 4 bytes, tag
        ``"control"``), exactly as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. It is
        the only clip by norm: Lightning's, which would follow on each rank's own gradients, is
        switched off for this strategy (see :meth:`setup_scheme`).
        """
        trainer = self.trainer
        max_norm = trainer.gradient_clip_val if trainer is not None else None
        if not max_norm or (trainer.gradient_clip_algorithm or "norm") != "norm":
            return
        dense_square = squared_norm([local(g) for g in dense], self.root_device)
        expert_square = squared_norm(experts, self.root_device)
        if self.sharding is None:
            expert_square = self.ep_comm.all_reduce(expert_square.reshape(1), "sum", tag="control")[0]
        elif self.inner == "ep":  # the dense shards and the experts both spread over the ep group
            total_square = self.ep_comm.all_reduce((dense_square + expert_square).reshape(1), "sum", tag="control")
            dense_square, expert_square = total_square[0], torch.zeros_like(total_square[0])
        else:  # the dense shards over the dp group (this rank's), the experts over the ep group
            dense_square = self.dp_comm.all_reduce(dense_square.reshape(1), "sum", tag="control")[0]
            expert_square = self.ep_comm.all_reduce(expert_square.reshape(1), "sum", tag="control")[0]
        total = (dense_square + expert_square).sqrt()
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([local(g) for g in dense] + experts, factor)

    # ------------------------------------------------------------------ checkpoints

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return {
            **self.compression.state_dict(),
            "experts": {self.param_name(p): p.detach() for p in self.expert_params()},
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "layout": [self.dp_size, self.ep_size, self.inner],
        }

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # The file's model holds rank 0's experts (every rank names its own experts alike); each rank
        # takes its own from its shard here, wherever a checkpoint is loaded (fit, validate, test,
        # predict), so that the sanity check and evaluation run on the right experts.
        super().load_model_state_dict(checkpoint, strict=strict)
        rank_state = self.states.pending_rank_state()
        if rank_state is None:
            return
        if list(rank_state["layout"]) != [self.dp_size, self.ep_size, self.inner]:
            log_rank_zero(
                log,
                logging.WARNING,
                "expert_parallel: the checkpoint's experts were sharded as dp x ep = %s x %s, this run is %s x %s;"
                " the model keeps the file's experts (rank 0's)",
                *rank_state["layout"][:2],
                self.dp_size,
                self.ep_size,
            )
            return
        params = dict(self.lightning_module.named_parameters())
        with torch.no_grad():
            for name, value in rank_state["experts"].items():
                if name in params and params[name].shape == value.shape:
                    params[name].copy_(value)

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        if list(rank_state["layout"]) != [self.dp_size, self.ep_size, self.inner]:
            raise ValueError(
                f"it was saved with dp x ep = {rank_state['layout'][0]} x {rank_state['layout'][1]}"
                f" ({rank_state['layout'][2]} inner) and this run has {self.dp_size} x {self.ep_size} ({self.inner});"
                " experts are not re-sharded"
            )
        params = dict(self.lightning_module.named_parameters())
        for name, value in rank_state["experts"].items():
            if name not in params or params[name].shape != value.shape:
                raise ValueError(f"its experts {name!r} {tuple(value.shape)} do not fit this model")
        self.check_compression_state(self.compression, rank_state)
        super().load_state_dict(state, rank_state)
        self.bind_compression(self.compression).load_state_dict(rank_state)
        with torch.no_grad():
            for name, value in rank_state["experts"].items():
                params[name].copy_(value)
        for optimizer, opt_state in zip(self.optimizers, rank_state["optimizers"], strict=True):
            optimizer.load_state_dict(opt_state)

    @override
    def reset_state(self) -> None:
        if self.compression.exchange is not None:
            self.compression.exchange.reset()
