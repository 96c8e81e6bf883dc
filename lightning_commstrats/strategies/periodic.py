"""The periodic family: ranks train alone and every ``sync_period`` an outer optimizer steps the global model.

:class:`PeriodicSyncStrategy` is the one strategy behind ``model_averaging``, ``bmuf``, ``local_sgd``,
``diloco`` and ``streaming_diloco``; they differ only in the components it holds:

- the outer optimizer (:class:`~lightning_commstrats.outer.OuterOptimizer`): the one global copy
  of the weights and the rule that steps it with the averaged pseudo-gradient
  ``G = w_start - mean over ranks(w_local)``: SGD with lr 1 (model averaging), the block-momentum
  filter (BMUF), Nesterov SGD (DiLoCo), or any ``torch.optim`` optimizer;
- the exchange (:class:`~lightning_commstrats.compression.TensorExchange`) that averages ``G``:
  fp32, 16-bit, or 8/4/2-bit codes with per-row scales and error feedback (the quantization
  residual is added to the next sync's ``G``);
- the schedule: the parameters in ``num_fragments`` fragments, each synced every ``sync_period``
  at its own offset; an exchange started at one step is applied ``fragment_sync_delay`` inner
  steps later (meanwhile it runs in a background thread on a communication channel of its own),
  mixed into the local weights with ``fragment_update_alpha``.

Shared machinery: the period in samples per worker or optimizer steps, the warm start (gradients
all-reduced every step before ``parallelization_start``), resetting the local optimizer's first
moment after a sync, a final synchronisation when fit ends (the exchange in flight lands, every
fragment's progress since its last sync is merged without an outer step, and every rank ends with
that global model), validation and saved weights always on the global model, and checkpoints that restore a
run mid-block and mid-fragment: the global model, outer optimizer, schedule and an exchange in
flight are shared state; each rank's local weights, inner optimizer state and quantization
residuals are its own.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import deque
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats.buckets import flatten, unflatten_into
from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.exchange import TensorExchange
from lightning_commstrats.fault_tolerance import FaultTolerance
from lightning_commstrats.moe.placement import ExpertPlacement, clipped_by_the_strategy
from lightning_commstrats.outer import OuterFactory, OuterOptimizer, resolve_outer_optimizer
from lightning_commstrats.replicas import ReplicaGroup, flat_buffers, load_buffers
from lightning_commstrats.sharding import local, tensors_in
from lightning_commstrats.sharding.checkpoint import global_state_dict
from lightning_commstrats.strategies.allreduce import dense_grad, trainable_params
from lightning_commstrats.strategies.base import CommStrategy
from lightning_commstrats.strategies.fragments import BackgroundRunner, Exchange, FragmentSchedule, fragment_bounds
from lightning_commstrats.strategies.periodic_settings import (
    OUTER_ARGUMENTS,
    check_periodic_settings,
)
from lightning_commstrats.strategies.trainer_hooks import (
    AgreedStop,
    reseed_samplers,
    reset_momentum,
    set_trainer_steps,
    step_schedulers_once,
)

log = logging.getLogger(__name__)


def refuse_outer_arguments(kwargs: dict[str, Any], owner: str, instead: str) -> None:
    """A preset with its own outer step takes no outer-optimizer argument: say so rather than drop it.
    An argument given at its default is no choice (the recipes' CLI passes every argument of the
    signature it follows, defaults included): it is dropped."""
    defaults = inspect.signature(PeriodicSyncStrategy.__init__).parameters
    for name in OUTER_ARGUMENTS:
        if name in kwargs and kwargs[name] == defaults[name].default:
            del kwargs[name]
    given = [name for name in OUTER_ARGUMENTS if name in kwargs]
    if given:
        raise ValueError(
            f"{owner} has a fixed outer step and does not take {', '.join(given)} (its settings: {instead});"
            " for another outer optimizer use DiLoCoStrategy or PeriodicSyncStrategy"
        )


class PeriodicSyncStrategy(CommStrategy):
    """Local training; every ``sync_period`` an outer optimizer steps the global model with the averaged
    pseudo-gradient. The base of the periodic schemes, usable directly with any outer optimizer.

    Args:
        sync_period: length of a block between synchronisations of a fragment, in ``sync_period_unit``.
        sync_period_unit: ``"samples"`` (per worker, CNTK's unit) or ``"steps"`` (optimizer steps).
        parallelization_start: warm start, in ``sync_period_unit``: before it, gradients are
            averaged every step (fully synchronous data parallelism); the first block starts there.
        reset_sgd_momentum: zero the local optimizers' first-moment buffers of the synced
            parameters after every synchronisation (SGD's ``momentum_buffer``, Adam's ``exp_avg``;
            Adam's second moment ``exp_avg_sq`` and step counts are kept).
        outer_optimizer: ``None`` (SGD), a class path such as ``"torch.optim.SGD"``, a
            ``torch.optim.Optimizer`` subclass, or a callable ``params -> Optimizer``.
        outer_lr: the outer learning rate (1.0 with no momentum is model averaging).
        outer_momentum: the outer momentum, for optimizers that take one (Nesterov for SGD when > 0).
        outer_optimizer_kwargs: further arguments of the outer optimizer class.
        pseudo_grad_bits: 32, 16, 8, 4 or 2 bits per value of the averaged pseudo-gradient's
            matrices (scales per ``pseudo_grad_scales``, error feedback); small tensors travel in fp32.
        pseudo_grad_scales: ``"rows"`` (default: one scale pair per row of each matrix, so every word
            of an embedding or output matrix is quantized on its own scale) or ``"columns"`` (per
            column, 1-bit SGD's layout; on a Brown LSTM's embedding the 4-bit error per row is about a
            fifth of the per-column one, see ``notebooks/onebit_inside.ipynb``).
        pseudo_grad_codec: ``"uniform"`` (default: at 2, 4, 8 bits, ``2^bits`` evenly spaced levels
            between two float32 scales per row or column, ``mean +- k std`` clipped to the values'
            range) or ``"e3m0"`` (``pseudo_grad_bits=4`` only: Streaming DiLoCo's 4-bit float,
            ``+-scale * 2^e`` for ``e`` in -6..0 and zero, one float32 scale per row or column, its
            largest magnitude); see :class:`~lightning_commstrats.compression.E3M0Codec`. Or ``"topk"``:
            sparse pseudo-gradients (SparseLoCo): of every chunk of ``topk_chunk`` values of a matrix,
            the ``topk_per_chunk`` largest in magnitude travel, in ``pseudo_grad_bits`` bits each (2, 4,
            8: sign and magnitude bin; 32: float32) with their positions, every rank's payload
            all-gathered; what is not sent stays in an error-feedback buffer decayed by
            ``error_feedback_decay``; see :mod:`lightning_commstrats.compression.sparse`. Or
            ``"statistical"`` (2, 4, 8 bits): every value of tensors of more than ``small_tensor_numel``
            values on SparseLoCo's statistical grid with a lookup per tensor, all-gathered, with error
            feedback decayed by ``error_feedback_decay``; see
            :mod:`lightning_commstrats.compression.density`.
        topk_chunk: with ``pseudo_grad_codec="topk"``, values per chunk (default 4096, SparseLoCo's).
        topk_per_chunk: with ``pseudo_grad_codec="topk"``, values kept per chunk (default 64: 1.6%).
        error_feedback_decay: with ``pseudo_grad_codec="topk"`` or ``"statistical"``, ``beta`` in ``e = beta * e + G``
            (default 1.0; SparseLoCo's 0.95, with which the buffer takes the place of outer momentum).
        topk_form: with ``pseudo_grad_codec="topk"``, ``"chunks"`` (default: runs of ``topk_chunk``
            consecutive values, sign-and-magnitude codes; a quorum of one replica sends nothing and
            skips the error feedback) or ``"published"`` (SparseLoCo as published: 2-D tiles of up to
            ``topk_tile x topk_tile`` values, ``topk_per_chunk`` kept per tile, a statistical quantizer
            with a per-tensor lookup, the same top-k and error feedback on any number of replicas);
            see :mod:`lightning_commstrats.compression.sparse_tiles`.
        topk_tile: with ``topk_form="published"``, the largest side of a tile (default 64; a side is
            the largest divisor of its dimension not above it).
        topk_sigmas: with ``topk_form="published"``, the quantizer's width in standard deviations
            (default 6: 4 bins of 1.5 at 2 bits).
        small_tensor_numel: tensors with at most this many values (and 1-D ones) go in fp32.
        half_dtype: the 16-bit format, ``"float16"`` or ``"bfloat16"``.
        num_fragments: parameters in this many fragments (contiguous in registration order,
            balanced by size), each synced every ``sync_period`` at its own offset; > 1 needs
            ``sync_period_unit="steps"``.
        fragment_sync_delay: inner steps between starting a fragment's exchange and applying its
            result (0: blocking); must be < ``sync_period / num_fragments``. With a delay the
            exchange runs in a background thread on a channel of its own. On CUDA that channel is
            a gloo group (the fragment staged through host memory, on a CUDA stream of its own), so
            every NCCL collective of the run is issued by the main thread alone: torch and NCCL do
            not order collectives that two threads issue on two communicators of one device, and
            the main thread issues some while the exchange is in flight (the SIGTERM flag round,
            an MoE bias all-reduce, ``verify_sync_every``, buffers synchronised for a checkpoint).
        fragment_update_alpha: the local weights of a synced fragment become
            ``alpha * local + (1 - alpha) * global``, in [0, 1] (0: restart from the global model).
        keep_local_progress: with a delay, keep the inner steps taken while the exchange was in
            flight: the fragment's local weights become the new start point plus their change since
            the exchange started (``w_start' + (w_local_now - w_local_at_launch)``), and the next
            block's pseudo-gradient carries those steps. Off (default), they are mixed away by
            ``fragment_update_alpha`` (Streaming DiLoCo's rule, which at ``alpha = 0`` discards
            ``fragment_sync_delay`` steps of every fragment per sync). Needs ``fragment_update_alpha=0``;
            costs one copy of the fragment while it is in flight. Without a delay it changes nothing.
        fault_tolerance: ``None`` (default), or the settings (a dict or a
            :class:`~lightning_commstrats.fault_tolerance.FaultTolerance`: ``lighthouse``,
            ``replica_id``, ``min_replicas``...) that make this job one *replica* of a run that
            survives replicas dying and coming back (torchft; the ``[ft]`` extra). The job's own
            ranks then average their gradients every step (synchronous data parallelism inside the
            replica); the pseudo-gradient is averaged across the replicas alive at each sync. See
            :mod:`lightning_commstrats.fault_tolerance` and the walk-through in docs/fault_tolerance.md. Needs
            ``sync_period_unit="steps"`` and no warm start.
        outer_state: where the global copy and the outer optimizer's state live on a CUDA run:
            ``"host"`` (default: pinned host memory, the outer step on the CPU, a fragment at a time
            on the device at a sync) or ``"device"`` (on the GPU). On CPU the two are the same memory.
            See :class:`~lightning_commstrats.outer.OuterOptimizer`.
        expert_parallel: ``False`` (default) or ``True``: mixture-of-experts across sites. Every group
            of ``group_size`` ranks holds every expert once, spread over its ranks, with its tokens'
            all-to-all inside the group and its dense part sharded by FSDP2 over the same ranks
            (needs ``shard="fsdp"``); rank ``i`` of every group holds the same experts and dense shard
            and exchanges them with rank ``i`` of the others (see
            :mod:`lightning_commstrats.moe.placement`). With ``fault_tolerance`` each replica is
            such a group: rank ``i`` of a restarted replica heals from rank ``i`` of a live one (its
            experts and its dense shard).
        **kwargs: passed to :class:`~lightning_commstrats.strategies.base.CommStrategy`.
    """

    supports_shard = True

    def __init__(
        self,
        sync_period: int,
        sync_period_unit: str = "samples",
        parallelization_start: int = 0,
        reset_sgd_momentum: bool = False,
        outer_optimizer: Any = None,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        outer_optimizer_kwargs: dict[str, Any] | None = None,
        pseudo_grad_bits: int = 32,
        pseudo_grad_scales: str = "rows",
        pseudo_grad_codec: str = "uniform",
        topk_chunk: int = 4096,
        topk_per_chunk: int = 64,
        error_feedback_decay: float = 1.0,
        topk_form: str = "chunks",
        topk_tile: int = 64,
        topk_sigmas: float = 6.0,
        small_tensor_numel: int = 1024,
        half_dtype: str = "float16",
        num_fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        keep_local_progress: bool = False,
        fault_tolerance: FaultTolerance | dict[str, Any] | None = None,
        outer_state: str = "host",
        expert_parallel: bool = False,
        **kwargs: Any,
    ) -> None:
        ft = check_periodic_settings(
            sync_period=sync_period,
            sync_period_unit=sync_period_unit,
            parallelization_start=parallelization_start,
            pseudo_grad_bits=pseudo_grad_bits,
            pseudo_grad_scales=pseudo_grad_scales,
            pseudo_grad_codec=pseudo_grad_codec,
            topk_chunk=topk_chunk,
            topk_per_chunk=topk_per_chunk,
            error_feedback_decay=error_feedback_decay,
            topk_form=topk_form,
            topk_tile=topk_tile,
            topk_sigmas=topk_sigmas,
            small_tensor_numel=small_tensor_numel,
            half_dtype=half_dtype,
            num_fragments=num_fragments,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            keep_local_progress=keep_local_progress,
            fault_tolerance=fault_tolerance,
            outer_state=outer_state,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            expert_parallel=expert_parallel,
            shard=kwargs.get("shard"),
            residuals=kwargs.get("residuals"),
        )
        self._outer_factory = resolve_outer_optimizer(outer_optimizer, outer_lr, outer_momentum, outer_optimizer_kwargs)
        # a slow hop's residuals (warm start, replicas) live with the outer state; passed as **kwargs, the
        # form through which the CLI (jsonargparse) finds the base's settings
        kwargs["residuals"] = outer_state
        super().__init__(**kwargs)
        self.sync_period = sync_period
        self.sync_period_unit = sync_period_unit
        self.parallelization_start = parallelization_start
        self.reset_sgd_momentum = reset_sgd_momentum
        self.pseudo_grad_bits = pseudo_grad_bits
        self.pseudo_grad_scales = pseudo_grad_scales
        self.pseudo_grad_codec = pseudo_grad_codec
        self.topk_chunk = topk_chunk
        self.topk_per_chunk = topk_per_chunk
        self.error_feedback_decay = error_feedback_decay
        self.topk_form = topk_form
        self.topk_tile = topk_tile
        self.topk_sigmas = topk_sigmas
        self.small_tensor_numel = small_tensor_numel
        self.half_dtype = half_dtype
        self.num_fragments = num_fragments
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = fragment_update_alpha
        self.keep_local_progress = keep_local_progress
        self.fault_tolerance = ft
        if ft is not None and ft.quorum_timeout >= self._timeout.total_seconds():
            # the replica's ranks wait together for a quorum; a rank held longer than the collective
            # timeout would make a peer's collective fail instead of the quorum's clear error
            raise ValueError(
                f"fault_tolerance.quorum_timeout={ft.quorum_timeout} s must be below timeout="
                f"{self._timeout.total_seconds():.0f} s (the collectives of the replica's ranks)"
            )
        self.outer_state = outer_state
        # expert_parallel=True: the experts spread over each group's ranks (placed at setup)
        self.experts: ExpertPlacement | None = ExpertPlacement() if expert_parallel else None
        # this replica's membership in a fault-tolerant run (every rank's torchft Manager)
        self.replicas: ReplicaGroup | None = None if ft is None else ReplicaGroup(ft)
        self._run_end = math.inf  # fault tolerance: the optimizer step at which every replica's fit ends
        self._stop_requested = False  # fault tolerance: a callback asked to stop; agreed at the next sync
        self.started = False  # past the warm start
        self.outer: OuterOptimizer | None = None
        self.schedule = FragmentSchedule(sync_period, num_fragments)  # when each fragment syncs
        self._bounds: list[tuple[int, int]] = []  # each fragment's parameters: [begin, end) indices
        self._inflight: Exchange | None = None
        self._exchange: TensorExchange | None = None
        self._runner = BackgroundRunner()  # the exchanges with a delay: a thread (and a CUDA stream)
        self._stash: list[Tensor] | None = None  # local weights while validation uses the global model
        # (fragment, step its exchange started after, step its result was applied after), recent syncs
        self.sync_history: deque[tuple[int, int, int]] = deque(maxlen=1024)
        self._schedule_checked = True  # until a Trainer's fit starts (warn_if_no_sync)

    # ------------------------------------------------------------------ components

    def outer_factory(self) -> OuterFactory:
        """Builds the outer optimizer over the global tensors (presets override)."""
        return self._outer_factory

    @property
    def exchange(self) -> TensorExchange:
        """The component that averages pseudo-gradients (and holds their quantization residuals).

        With a delay it runs on a second channel of the ranks, in a background thread.
        """
        if self._exchange is None:
            comm = self.replica_comm
            if self.fragment_sync_delay:
                host = self.root_device.type == "cuda"
                comm = (
                    self.sharding.cross_channel(self.comm, host=host) if self.sharding else self._background_channel()
                )
            self._exchange = self._make_exchange(comm)
        return self._exchange

    def _background_channel(self) -> Communicator:
        """The second channel of the ranks for the background thread: host memory on CUDA (see
        ``fragment_sync_delay``), else another group of the same backend."""
        return self.comm.duplicate(host=self.root_device.type == "cuda")

    def _make_exchange(self, comm: Communicator) -> TensorExchange:
        return TensorExchange(
            comm,
            self.pseudo_grad_bits,
            half_dtype=self.half_dtype,
            small_tensor_numel=self.small_tensor_numel,
            tag="weights",
            scales=self.pseudo_grad_scales,
            codec=self.pseudo_grad_codec,
            topk_chunk=self.topk_chunk,
            topk_per_chunk=self.topk_per_chunk,
            error_feedback_decay=self.error_feedback_decay,
            topk_form=self.topk_form,
            topk_tile=self.topk_tile,
            topk_sigmas=self.topk_sigmas,
            bucket_cap_mb=self.bucket_cap_mb,
            keep_buffers=False,  # once per period, a whole fragment: not worth a standing copy
            # outer_state="host" on CUDA: the error feedback waits in pinned host memory between syncs
            residual_home=torch.device("cpu") if self.outer_state == "host" else None,
        )

    @override
    def configure_model_parallel(self) -> None:
        if self.experts is not None:  # before FSDP2 shards the rest: the experts stay with their owners
            assert self.sharding is not None and self.lightning_module is not None
            self.experts.place(self.lightning_module, self.sharding.inner_channel(self.comm))
        super().configure_model_parallel()

    @override
    def params_kept_whole(self) -> set[torch.nn.Parameter]:
        return set(self.experts.params()) if self.experts is not None else set()

    @override
    def is_expert_param(self, name: str, p: torch.nn.Parameter) -> bool:
        return self.experts is not None and any(p is q for q in self.experts.params())

    def _clip_experts_and_shards(self, optimizer: Optimizer) -> None:
        """``expert_parallel=True``: the clip by norm over the group's whole model (Lightning's, over
        this rank's DTensor shards and plain expert tensors together, cannot run; it is switched off
        in :meth:`setup_scheme`)."""
        trainer = self.trainer
        max_norm = trainer.gradient_clip_val if trainer is not None else None
        if not max_norm or (trainer.gradient_clip_algorithm or "norm") != "norm":
            return
        assert self.experts is not None
        kept = {id(p) for p in self.experts.params()}
        dense = [local(p.grad) for p in trainable_params(optimizer) if p.grad is not None and id(p) not in kept]
        self.experts.clip_by_global_norm(dense, float(max_norm))

    @override
    def setup_scheme(self) -> None:
        super().setup_scheme()
        if self.experts is not None:
            self.precision_plugin.clip_grad_by_norm = clipped_by_the_strategy  # type: ignore[method-assign]
        n = len(self.params)
        if self.num_fragments > n:
            raise ValueError(f"num_fragments={self.num_fragments} is larger than the model's {n} parameter tensors")
        self._bounds = fragment_bounds([p.numel() for p in self.params], self.num_fragments)
        trainer = self.trainer
        evaluating = trainer is not None and trainer.state.fn != TrainerFn.FITTING
        if self.fault_tolerance is not None and not evaluating:  # validate/test alone: no quorum to join
            self._join_replicas()
        elif self.replica_comm.world_size > 1:
            _ = self.exchange  # every rank makes its channel now, in the same order

    # ------------------------------------------------------------------ parameters as vectors

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """Every parameter in the model's order (tied ones once): the vectors' layout."""
        return self.param_set.params

    def fragment_params(self, fragment: int) -> list[torch.nn.Parameter]:
        i0, i1 = self._bounds[fragment]
        return self.params[i0:i1]

    def flat_weights(self, fragment: int | None = None) -> Tensor:
        """A float32 copy of the local weights of ``fragment`` (of all parameters for ``None``)."""
        params = self.params if fragment is None else self.fragment_params(fragment)
        return flatten([local(p).detach().float() for p in params])

    def load_flat(self, flat: Tensor, fragment: int | None = None) -> None:
        params = self.params if fragment is None else self.fragment_params(fragment)
        with torch.no_grad():
            unflatten_into(flat, [local(p.data) for p in params])

    def _new_outer(self) -> OuterOptimizer:
        return OuterOptimizer(self.outer_factory(), self.root_device, self.outer_state)

    def global_weights(self) -> Tensor | None:
        """The global model as one flat float32 vector (what validation and checkpoints see), once started."""
        if self.outer is None:
            return None
        return torch.cat([self.outer.global_weights(f) for f in range(self.num_fragments)])

    # ------------------------------------------------------------------ the schedule

    @override
    def replicated_tensors(self) -> dict[str, Tensor]:
        # each rank's local weights differ by design; the global model must not
        if self.outer is None:
            return {}
        return {f"global model (fragment {f})": self.outer.global_weights(f) for f in range(self.num_fragments)}

    @override
    def schedule_counts_samples(self) -> bool:
        return self.sync_period_unit == "samples"

    def _progress(self) -> int:
        return self.samples_per_worker if self.sync_period_unit == "samples" else self.optimizer_steps

    def _start(self) -> None:
        self.started = True
        self.reducer.release("grad")  # the warm start's gradient exchange is over: free its buffers
        self.schedule.stagger(self._progress())
        self.outer = self._new_outer()
        self.outer.start([self.flat_weights(k) for k in range(self.num_fragments)])

    @override
    def after_backward(self, optimizer: Optimizer) -> None:
        if self.experts is not None:  # an expert's gradient holds its whole group's: the group's average
            self.experts.scale_gradients()
        if (not self.started or self.fault_tolerance is not None) and self.replica_comm.world_size > 1:
            # warm start, or inside a fault-tolerant replica: fully synchronous data parallelism
            params = trainable_params(optimizer)
            self.all_reduce_fused(
                [local(dense_grad(p)) for p in params], tag="grad", names=[self.param_name(p) for p in params]
            )
        if self.experts is not None:  # on the gradients the step will take
            self._clip_experts_and_shards(optimizer)

    @override
    def on_step_counted(self, optimizer: Optimizer) -> None:
        if self.started:
            if self._inflight is not None and self.optimizer_steps >= self._inflight.apply_at:
                self._apply()
            for k in self.schedule.due(self._progress()):
                self._launch(k, background=self.fragment_sync_delay > 0)
                if self.fragment_sync_delay == 0:
                    self._apply()
        elif self._progress() >= self.parallelization_start:
            self._start()
        if self.optimizer_steps >= self._run_end and self.trainer is not None:
            self.trainer.should_stop = True  # the run's agreed end: every replica stops after this step

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # restores a checkpoint's state first
        if not self.started and self.parallelization_start == 0:
            self._start()
        if self.replicas is not None:
            if self._inflight is not None:
                # an exchange restored from this replica's checkpoint (already averaged and committed):
                # applied now, before the run's state is agreed, so that none is in flight across it
                self._apply()
            self.replicas.first_quorum(self)
            trainer = self.trainer
            if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, AgreedStop)]
                trainer.callbacks.append(AgreedStop(self))
                if self._inflight is not None:  # joined the run's sync under way: its agreement holds already
                    self._run_end = min(self._run_end, self._inflight.run_end)
                if self.optimizer_steps >= self._run_end:  # joined at the run's last sync: nothing left to train
                    trainer.should_stop = True
                assert self.replicas.sync is not None and self.fault_tolerance is not None
                if self.replicas.sync.step > 1:
                    # a replica that joined a running run (restarted, or resumed): a fresh data order.
                    # Its place in its own old order is lost with it; replaying that order from the
                    # start of the epoch would feed the run again the batches it trained on before.
                    reseed_samplers(trainer, self.fault_tolerance.data_seed(self.replicas.sync.step))
        self._schedule_checked = False

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if not self._schedule_checked:  # the first batch: its size tells what a sample schedule means in steps
            self._schedule_checked = True
            self.warn_if_no_sync(extract_batch_size(batch))

    def warn_if_no_sync(self, batch_size: int) -> int | None:
        """Warn (rank 0) when this fit ends before its first synchronisation: a schedule sized for a
        long run (CNTK's 120,000 samples per worker of ``bmuf``) left on a short one averages the
        models only at the end of fit. Returns the optimizer step of the first sync when it is past
        the end (else None)."""
        trainer = self.trainer
        total = getattr(trainer, "estimated_stepping_batches", None) if trainer is not None else None
        if not isinstance(total, (int, float)) or not math.isfinite(total) or total <= 0:
            return None
        per_step = 1
        if self.sync_period_unit == "samples":
            per_step = batch_size * getattr(trainer, "accumulate_grad_batches", 1)
        first_turn = self.sync_period // self.num_fragments  # the first fragment's turn
        start = self.parallelization_start if not self.started else self._progress()
        first = self.optimizer_steps + math.ceil((start - self._progress() + first_turn) / max(per_step, 1))
        if first <= total:
            return None
        hint = max(int(total) // 10, 1)
        rank_zero_warn(
            f"{type(self).__name__}: sync_period={self.sync_period} {self.sync_period_unit}"
            f"{' per worker' if self.sync_period_unit == 'samples' else ''} puts the first synchronisation at"
            f" optimizer step {first}, after this fit's {int(total)} steps: the models are averaged only at the"
            f" end of fit. For this run pass, e.g., sync_period={hint}, sync_period_unit='steps'."
        )
        return first

    def _launch(self, fragment: int, background: bool) -> None:
        """Start averaging ``fragment``'s pseudo-gradient ``G = w_start - w_local``."""
        assert self.outer is not None
        if self._inflight is not None:
            raise RuntimeError(f"fragment {fragment} is due while fragment {self._inflight.fragment} is in flight")
        local = self.flat_weights(fragment)
        grad = self.outer.start_point(fragment) - local
        named = self.named_views(fragment, grad)
        self.schedule.launched(fragment, self._progress())
        delay = self.fragment_sync_delay if background else 0
        pending = Exchange(fragment, self.optimizer_steps, self.optimizer_steps + delay, grad)
        if self.keep_local_progress and delay:
            pending.launched = local
        if self.replicas is not None:
            pending.buffers = self._buffers_for(fragment, agree=True)  # once per period, with the last fragment
            pending.stop, pending.planned_end = self._stop_requested, self._planned_end()
            self.replicas.set_offer(self.replica_state(pending))  # read by a healing peer in this sync's quorum
        if background and (self.replica_comm.world_size > 1 or self.fault_tolerance is not None):
            exchange_on = self._exchange_on  # read now: the thread runs what was launched
            self._runner.submit(pending, lambda: exchange_on(pending, named))
        else:
            pending.nonfinite = self._average(pending, named)
        self._inflight = pending

    def _exchange_on(self, pending: Exchange, named: dict[str, Tensor]) -> list[str]:
        """The background thread's work (on the runner's side stream on CUDA): the average."""
        return self._average(pending, named)

    def _average(self, pending: Exchange, named: dict[str, Tensor]) -> list[str]:
        if self.fault_tolerance is not None:
            return self._replica_average(pending)
        return self.average_pseudo_gradient(named)

    def average_pseudo_gradient(self, named: dict[str, Tensor]) -> list[str]:
        """Average the named pseudo-gradient tensors over ranks in place (identical on every rank);
        returns the names whose average is not finite."""
        return self.exchange.average(named)

    def _apply(self, merge: bool = False) -> None:
        """The outer step of the fragment in flight; its local weights restart from (or mix with) the result.
        ``merge``: no outer step, the averaged progress is added to the global model as it is (the end of fit)."""
        self.wait_for_exchange()  # re-raises a failed exchange here
        pending, self._inflight = self._inflight, None
        assert pending is not None
        if pending.healed is not None:  # this replica healed at this sync: it takes the run's state first
            self.adopt(pending.healed)
        self._run_end = min(self._run_end, pending.run_end)
        assert self.outer is not None
        f = pending.fragment
        if pending.took_part == 0:  # every replica of the quorum was taking the run's state: nothing to step with
            self.load_flat(self.outer.start_point(f), f)
            return
        pending.nonfinite = self.agree_on_names(pending.nonfinite or [])
        if pending.nonfinite and self.handle_nonfinite(pending.nonfinite, f"pseudo-gradients (fragment {f})"):
            # the block is discarded on every rank: no outer step, the fragment restarts from the global model
            self.load_flat(self.outer.start_point(f), f)
            return
        if merge:
            self._merge(f, pending.grad)
        else:
            self.outer.step(f, pending.grad)
        start = self.outer.start_point(f)
        alpha = self.fragment_update_alpha
        if pending.launched is not None and pending.healed is None:
            # the steps taken since the launch, on top of the new start point
            self.load_flat(self.flat_weights(f).sub_(pending.launched).add_(start), f)
        else:
            self.load_flat(start if alpha == 0 else torch.lerp(start, self.flat_weights(f), alpha), f)
        if self.reset_sgd_momentum:
            ids = {id(p) for p in self.fragment_params(f)}
            for optimizer in self.optimizers:
                reset_momentum(optimizer, ids)
        self.sync_history.append((f, pending.started_at, self.optimizer_steps))
        self.after_sync(f)
        if pending.buffers is not None:  # averaged across replicas with this fragment
            assert self.lightning_module is not None
            load_buffers(pending.buffers, list(self.lightning_module.buffers()))
        elif f == self.num_fragments - 1:  # once per period: running statistics averaged as the weights are
            self.sync_buffers(tag="weights")

    def after_sync(self, fragment: int) -> None:
        """Called after every outer step (of ``fragment``), once the local weights are updated."""

    def synchronize(self) -> None:
        """Finish the exchange in flight (its outer step, a whole block's), then merge into the global
        model the progress of every fragment that trained since its last sync: ``w -= mean(G)``, the
        ranks' average progress as it is, not an outer step.

        The outer optimizer is for whole blocks, with more blocks to come: DiLoCo's Nesterov step adds
        ``lr * momentum^2`` times the momentum buffer (several times the pseudo-gradient of a part
        block), an extrapolation along the past blocks that the next blocks' training corrects. At the
        end nothing does: measured on the Brown LSTM (2 ranks, 576 steps, ``streaming_diloco`` H 16,
        4 fragments, 4 bits, delay 3), the closing outer steps left 149.4 perplexity where the landed
        global model had 148.6; the merge 147.4. For model averaging (outer SGD at lr 1, no momentum,
        SparseLoCo's outer step) the merge is its outer step."""
        if self._inflight is not None:
            self._apply()
        for k in self.schedule.behind(self._progress()):
            self._launch(k, background=False)
            self._apply(merge=True)
        # every fragment is in sync now: they take turns again from here, as at the start (a run
        # resumed from a checkpoint saved after this must not find every fragment due at once)
        self.schedule.stagger(self._progress())

    def _merge(self, fragment: int, pseudo_grad: Tensor) -> None:
        """``w -= G`` on ``fragment``'s global model where it lives; the outer optimizer's state is kept."""
        assert self.outer is not None
        w = self.outer.weights[fragment]
        with torch.no_grad():
            w.sub_(pseudo_grad.to(w.device, torch.float32))
        self.outer.syncs[fragment] += 1

    def named_views(self, fragment: int, flat: Tensor) -> dict[str, Tensor]:
        """``flat`` (a fragment's vector) as one view per parameter, of its local shard's shape."""
        views, offset = {}, 0
        for p in self.fragment_params(fragment):
            shard = local(p)
            views[self.param_name(p)] = flat[offset : offset + shard.numel()].view(shard.shape)
            offset += shard.numel()
        return views

    @override
    def on_train_end(self) -> None:
        # every rank ends with the global model
        if self.started:
            with self.process_memory.phase("sync"):
                self.synchronize()
                final = self.global_weights()
                assert final is not None
                self.load_flat(final)
            self.comm_stats.extend_last_step()  # the end-of-fit sync belongs to the last step
        self._runner.shutdown()
        if self.replicas is not None:
            rid = self.fault_tolerance.replica_id if self.fault_tolerance is not None else ""
            self.replicas.finish(f"replica {rid!r} finished it at optimizer step {self.optimizer_steps}")
        self.release_resources()  # the run is over for this replica: leave the quorums
        super().on_train_end()

    def replica_summary(self) -> tuple[str, dict[str, Any]] | None:
        """With ``fault_tolerance``: this replica's ``[ft]`` line and its figures (waits for quorums and
        commits, heals received, syncs that failed, replicas seen leaving and joining), as this rank saw
        them; else None. The communication statistics' monitor prints and saves them at the end of fit."""
        if self.replicas is None or self.fault_tolerance is None:
            return None
        summary = self.replicas.summary
        return summary.line(self.fault_tolerance.replica_id), summary.as_dict()

    @override
    def release_resources(self) -> None:
        # also when fit stopped on an error: the Manager's heartbeats would keep the replica alive
        if self.replicas is not None:
            self.replicas.leave()
        super().release_resources()

    # ------------------------------------------------------------------ fault tolerance across replicas

    def _join_replicas(self) -> None:
        """Every rank of this replica joins the run (its own torchft Manager, its own process group with
        the same rank of the other replicas); the replica's ranks learn together whether that worked."""
        assert self.replicas is not None
        host = self.fragment_sync_delay > 0  # a background exchange: host memory, no NCCL from its thread
        relay = self._background_channel() if host and self.world_size > 1 else self.comm
        holders = self.replica_comm  # the ranks of this replica that hold the same tensors as this one
        if host and holders.world_size > 1 and holders is not self.comm:
            assert self.sharding is not None
            holders = self.sharding.cross_channel(self.comm, host=self.root_device.type == "cuda")
        elif host and holders.world_size > 1:
            holders = relay
        self.replicas.join(self.comm, relay, holders, self.root_device, self.comm.stats, host=host)
        if self.replicas.sync is not None:  # a SIGTERM while it waits for a quorum stops it there
            self.replicas.sync.on_wait = self.stop_agreement.stop_waiting

    @property
    @override
    def ranks_check_apart(self) -> bool:
        # across replicas every rank exchanges its own slice (or shard) of the pseudo-gradient
        return super().ranks_check_apart or self.replicas is not None

    def _replica_average(self, pending: Exchange) -> list[str]:
        """Average ``pending`` over the replicas of a quorum (see :meth:`ReplicaGroup.average`)."""
        assert self.replicas is not None
        return self.replicas.average(pending, self)

    # what the replicas component needs of this strategy (lightning_commstrats.replicas.ReplicaHost)

    def replica_state(self, pending: Exchange | None) -> dict[str, Any]:
        """The state every replica shares (this rank's part of it: its shards when sharded): the global
        model and outer optimizer, the module's buffers, the schedule, the step count, the
        learning-rate schedules (the schedulers and the inner optimizers' hyperparameters); and the
        sync under way (its fragment and steps)."""
        assert self.outer is not None
        trainer = self.trainer
        schedulers = [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs] if trainer else []
        module = self.lightning_module
        return {
            "optimizer_steps": self.optimizer_steps,
            "samples_per_worker": self.samples_per_worker,
            **self.schedule.state_dict(),
            "outer": self.outer.state_dict(),
            "buffers": [] if module is None else [b.detach().clone() for b in module.buffers()],
            "sync": None if pending is None else (pending.fragment, pending.started_at, pending.apply_at),
            "run_end": self._run_end,
            "lr_schedulers": schedulers,
            # the hyperparameters a schedule set (a scheduler's state alone does not restore them)
            "param_groups": [
                [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
                for opt in self.optimizers
            ],
        }

    def adopt(self, state: dict[str, Any]) -> None:
        """Take the run's shared state (from the replica that healed this one, or the quorum's
        agreement). Local weights restart from the global model; quantization residuals restart at
        zero (they are this replica's own error on a trajectory the run did not keep; a peer's
        residual would count that peer's error twice); the inner optimizers keep their own state
        (a peer's is read while it trains, and Adam's moments rebuild in a few steps)."""
        outer = self._new_outer()
        outer.load_state_dict(state["outer"], self.root_device)
        self.outer, self.started = outer, True
        self.schedule.load_state_dict(state)
        self._run_end = min(self._run_end, float(state.get("run_end", math.inf)))
        for f in range(self.num_fragments):
            self.load_flat(outer.start_point(f), f)
        module = self.lightning_module
        if module is not None and state.get("buffers"):
            with torch.no_grad():
                for mine, theirs in zip(module.buffers(), state["buffers"], strict=True):
                    mine.copy_(theirs)
        if self._inflight is not None and self._inflight.launched is not None:
            # the local weights restart here: the steps kept when the exchange lands are those from now
            self._inflight.launched = outer.start_point(self._inflight.fragment).clone()
        if self._exchange is not None:
            self._exchange.reset()
        self.samples_per_worker = self._samples_at_step = int(state["samples_per_worker"])
        self._samples_total_all_ranks = self.samples_per_worker * self.world_size
        steps = int(state["optimizer_steps"])
        for opt, groups in zip(self.optimizers, state["param_groups"], strict=True):
            for group, saved in zip(opt.param_groups, groups, strict=True):
                group.update(saved)
        trainer = self.trainer
        if trainer is not None:
            for cfg, saved in zip(trainer.lr_scheduler_configs, state["lr_schedulers"], strict=True):
                cfg.scheduler.load_state_dict(saved)
            if steps != self.optimizer_steps:
                set_trainer_steps(trainer, steps)
        self.optimizer_steps = steps

    def join_sync(self, state: dict[str, Any]) -> Exchange:
        """The sync a peer was in when this replica healed from it: this replica takes part (sending
        zeros) and applies it when the others do."""
        # the snapshot was taken inside the source's optimizer step, before Lightning stepped its
        # schedulers for it: step them here, where this replica's loop will not
        step_schedulers_once(self.trainer)
        fragment, started_at, apply_at = state["sync"]
        pending = Exchange(fragment, started_at, apply_at, self.flat_weights(fragment).zero_(), contributes=False)
        pending.buffers = self._buffers_for(fragment, agree=False)
        pending.planned_end = self._planned_end()
        self._inflight = pending
        return pending

    def retarget(self, pending: Exchange, sync: tuple[int, int, int]) -> Tensor:
        """Point ``pending`` at the sync the run is in (another fragment, later steps), with a zero
        pseudo-gradient of that fragment's size, applied at this replica's next step; returns it."""
        fragment, started_at, _ = sync
        pending.fragment, pending.started_at, pending.apply_at = fragment, started_at, 0
        pending.grad = torch.zeros_like(self.flat_weights(fragment))
        pending.launched = None  # the weights this replica launched were another fragment's
        pending.buffers = self._buffers_for(fragment, agree=False)
        return pending.grad

    def bind_exchange(self, comm: Communicator) -> TensorExchange:
        """The exchange over this quorum's replicas (made at the first quorum, rebound at each one after)."""
        if self._exchange is None:
            self._exchange = self._make_exchange(comm)
        else:
            self._exchange.rebind(comm)
        return self._exchange

    def global_tensors(self, state: dict[str, Any] | None) -> list[Tensor]:
        if state is not None:
            return [w.to(self.root_device) for w in state["outer"]["weights"]]
        assert self.outer is not None
        return [self.outer.global_weights(f) for f in range(self.num_fragments)]

    def _planned_end(self) -> float:
        """The optimizer step at which this replica's own limits (``max_steps``, ``max_epochs``) end its
        fit; infinite when none does (a time limit or a callback: those ask to stop instead)."""
        trainer = self.trainer
        if trainer is None:
            return math.inf
        ends = [float(trainer.max_steps)] if trainer.max_steps is not None and trainer.max_steps >= 0 else []
        batches = trainer.num_training_batches
        if trainer.max_epochs is not None and trainer.max_epochs >= 0 and math.isfinite(batches) and batches > 0:
            accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1)), 1)
            per_epoch = math.ceil(batches / accumulate)
            done = trainer.fit_loop.epoch_loop.batch_progress.current.ready // accumulate  # this epoch's steps
            epochs_after = trainer.max_epochs - trainer.current_epoch - 1
            ends.append(float(self.optimizer_steps + per_epoch - done + epochs_after * per_epoch))
        return min(ends, default=math.inf)

    def _buffers_for(self, fragment: int, *, agree: bool) -> Tensor | None:
        """The module's floating-point buffers as one vector, sent across replicas with the period's last
        fragment (``None`` with the others). ``agree``: made equal over this replica's ranks first, a
        collective (every rank launches the same sync at the same step); without it, for a replica
        that does not contribute (it sends zeros) and may be in the exchange's thread."""
        module = self.lightning_module
        if module is None or fragment != self.num_fragments - 1:
            return None
        if agree:
            self.sync_buffers(tag="weights")
        return flat_buffers(list(module.buffers()))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs = super().distributed_sampler_kwargs
        if self.fault_tolerance is not None:  # every replica its own data order
            kwargs["seed"] = self.fault_tolerance.data_seed()
        return kwargs

    # ------------------------------------------------------------------ validation on the global model

    def reshard(self) -> None:
        """Put every FSDP2 module of a sharded model back on its shards (:meth:`ParamSet.reshard`).

        A forward without backward (validation) leaves a module that does not reshard after forward
        (``shard_policy.reshard_after_forward=False``, and the root under FSDP2's default) with its
        gathered parameters registered in place of the shards; the shards are what this strategy
        reads and writes, and what the next forward gathers again."""
        if self.sharding is not None and self.lightning_module is not None:
            self.param_set.reshard()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        global_weights = self.global_weights()
        if global_weights is not None:
            self.reshard()
            self._stash = [local(p).detach().clone() for p in self.params]
            self.load_flat(global_weights)

    @override
    def on_validation_end(self) -> None:
        if self._stash is not None:
            self.reshard()  # validation's forwards may have left the global model gathered
            with torch.no_grad():
                for p, mine in zip(self.params, self._stash, strict=True):
                    local(p).copy_(mine)
            self._stash = None
        super().on_validation_end()

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        if self.outer is not None and self.sharding is not None:  # the global model's shards, as DTensors
            named: dict[str, Tensor] = {}
            for f in range(self.num_fragments):
                # the host copy itself where the outer state lives there: no trip through the device
                named.update(self.named_views(f, self.outer.weights[f].detach()))
            return global_state_dict(state, self.lightning_module, named)
        flat = self.global_weights()
        if flat is None:
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
        inflight = None
        self.wait_for_exchange()
        if self._inflight is not None:
            inflight = {
                "fragment": self._inflight.fragment,
                "started_at": self._inflight.started_at,
                "apply_at": self._inflight.apply_at,
                "grad": self._inflight.grad,
                "nonfinite": self._inflight.nonfinite,
            }
        return {
            **super().state_dict(),
            "started": self.started,
            **self.schedule.state_dict(),
            "outer": None if self.outer is None else self.outer.state_dict(),
            "inflight": inflight,
            # fault tolerance: the torchft Manager's committed step and batches (a full restart
            # continues from the replica with the most committed progress)
            "replicas": None if self.replicas is None else self.replicas.state_dict(),
        }

    @override
    def resharded_rank_state(
        self, state: dict[str, Any], rank_state: dict[str, Any] | None, saved_world_size: int
    ) -> dict[str, Any]:
        # The global model, the outer optimizer, the schedule and an exchange in flight (already
        # averaged) are the same on every rank and carry over as they are. Each rank's local
        # weights restart from their block's start point (the block's local steps are dropped;
        # before the first block every rank holds the same weights), its inner optimizer state is
        # old rank (r mod N_old)'s, and the quantization residuals, cut in stripes that depend on
        # the number of ranks, restart at zero.
        if rank_state is None:
            raise ValueError(f"the shard of old rank {self.global_rank % saved_world_size} is not here")
        started = (state.get("outer") or {}).get("weights") is not None
        weights = None if started else rank_state["weights"]
        return {"weights": weights, "optimizers": rank_state["optimizers"], "exchange": None}

    def wait_for_exchange(self) -> None:
        """Let the exchange in flight (if any) complete; its result is applied at its step as
        planned. Called before it lands, before either state is read for a checkpoint (the
        background thread is still writing the quantization residuals), and by a benchmark that
        must not let an exchange overlap anything but training."""
        self._runner.join(self._inflight, self.comm_stats)

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        self.wait_for_exchange()
        # During validation the parameters hold the global model and the local weights are set
        # aside; a checkpoint saved then (ModelCheckpoint runs before this strategy's
        # on_validation_end) must keep the local ones.
        local = self.flat_weights() if self._stash is None else flatten([t.float() for t in self._stash])
        return {
            "weights": local,
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "exchange": self.exchange.state_dict() if self._exchange is not None else None,
            # keep_local_progress: this rank's weights of the fragment in flight when it left
            "launched": None if self._inflight is None else self._inflight.launched,
        }

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        # the exchange in flight is replaced: its thread must not write the residuals loaded below
        self.wait_for_exchange()
        n = sum(local(p).numel() for p in self.params)
        if rank_state["weights"] is not None and rank_state["weights"].numel() != n:
            raise ValueError(f"it holds {rank_state['weights'].numel()} weights and this model has {n}")
        sizes = [sum(local(p).numel() for p in self.fragment_params(k)) for k in range(self.num_fragments)]
        outer = self._new_outer()
        if state["outer"] is not None:
            outer.check_state(state["outer"], sizes)
        if len(state["block_start"]) not in (0, self.num_fragments):
            raise ValueError(f"it has {len(state['block_start'])} fragments and this run {self.num_fragments}")
        # across fault-tolerant replicas the residuals restart at zero, as after a heal: the stripes
        # they belong to depend on the quorum, which is not known before the first sync
        residuals = rank_state["exchange"] if self.fault_tolerance is None else None
        if residuals is not None:
            self.exchange.check_state(residuals, {self.param_name(p): local(p).shape for p in self.params})
        super().load_state_dict(state, rank_state)
        self.started = bool(state["started"])
        self.schedule.load_state_dict(state)
        if self.replicas is not None:
            self.replicas.load_state_dict(state.get("replicas"))
        self.outer = None
        if state["outer"] is not None and state["outer"]["weights"] is not None:
            outer.load_state_dict(state["outer"], self.root_device)
            self.outer = outer
        saved = state["inflight"]
        self._inflight = None
        if saved is not None:
            grad = saved["grad"].to(self.root_device, torch.float32)
            self._inflight = Exchange(int(saved["fragment"]), int(saved["started_at"]), int(saved["apply_at"]), grad)
            self._inflight.nonfinite = saved.get("nonfinite")
            launched = rank_state.get("launched")
            if launched is not None and self.keep_local_progress:
                self._inflight.launched = launched.to(self.root_device, torch.float32)
        if rank_state["weights"] is not None:
            self.load_flat(rank_state["weights"].to(self.root_device))
        elif self.outer is not None:  # resharded: every fragment restarts from its block's start point
            for f in range(self.num_fragments):
                self.load_flat(self.outer.start_point(f), f)
        for optimizer, opt_state in zip(self.optimizers, rank_state["optimizers"], strict=True):
            optimizer.load_state_dict(opt_state)
        if residuals is not None:
            self.exchange.load_state_dict(residuals)

    @override
    def scheme_tensors(self) -> list[Tensor]:
        inflight = self._inflight
        held = [
            self.outer.state_dict() if self.outer is not None else None,
            None if inflight is None else [inflight.grad, inflight.launched],
            self._exchange.state_dict() if self._exchange is not None else None,
            self._exchange.fused if self._exchange is not None else None,
            self._stash,
        ]
        return super().scheme_tensors() + tensors_in(held)

    @override
    def reset_state(self) -> None:
        self.started = False
        self.outer = None
        self._inflight = None
        if self._exchange is not None:
            self._exchange.reset()
