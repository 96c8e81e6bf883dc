"""The base of every strategy in the package: processes, ranks and a communicator, no DDP wrapper.

:class:`CommStrategy` is a Lightning :class:`~lightning.pytorch.strategies.ParallelStrategy` that
launches one process per device like ``ddp`` does (or runs under ``mpiexec``, SLURM, torchrun),
connects the ranks through :mod:`lightning_commstrats.comm`, and leaves the model unwrapped. The
schemes hook into two places of an optimizer step:

- :meth:`CommStrategy.after_backward`: gradients of the optimizer's parameters are complete on this
  rank (after gradient accumulation, before clipping and ``optimizer.step``). Gradient schemes
  exchange here.
- :meth:`CommStrategy.after_optimizer_step`: the local update is done. Weight schemes exchange here.

Lightning's own traffic (``barrier``, ``broadcast``, ``reduce`` for ``self.log(..., sync_dist=True)``,
``all_gather``) also goes through the communicator, tagged ``"control"`` or ``"metrics"``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_commstrats._logging import log_rank_zero
from lightning_commstrats.buckets import DEFAULT_BUCKET_CAP_MB, BucketKey, flatten, unflatten_into
from lightning_commstrats.comm import (
    CollectiveError,
    CommStats,
    Communicator,
    create_communicator,
    is_backend_failure,
    resolve_backend,
)
from lightning_commstrats.compression.hierarchical import SlowHop, TwoLevelAllReduce
from lightning_commstrats.sharding import ProcessMemory, Sharding, local, memory_by_kind, tensors_in
from lightning_commstrats.sharding import checkpoint as sharded_checkpoint
from lightning_commstrats.sharding.materialize import (
    check_initialisable,
    has_meta,
    materialize,
    parameters_on_meta,
    unwritten_error,
)
from lightning_commstrats.strategies.comm_settings import check_comm_settings
from lightning_commstrats.strategies.params import ParamSet
from lightning_commstrats.strategies.reducer import BUFFERS, GRADIENTS, Reducer
from lightning_commstrats.strategies.state import STATE_KEY, StateStore, log_here
from lightning_commstrats.strategies.stop import StopAgreement
from lightning_commstrats.topology import Topology

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)

_REDUCE_OPS = {"mean": "avg", "avg": "avg", "sum": "sum", "max": "max", "min": "min"}


class RankDevices:
    """Devices, processes and the data sharding of one process per device, as ``ddp`` has them: the
    part both front ends (the Trainer's :class:`CommStrategy` and Fabric's ``FabricStrategy``) share,
    for their two Lightning base classes."""

    parallel_devices: list[torch.device] | None
    local_rank: int
    global_rank: int
    _num_nodes: int

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}


class CommStrategy(RankDevices, ParallelStrategy):
    """Multi-process data parallelism whose communication is done by the package's communicator.

    Args:
        backend: ``"auto"`` (NCCL on CUDA, gloo on CPU), ``"gloo"``, ``"nccl"`` or ``"mpi"``
            (mpi4py; start the ranks with ``mpiexec -n N``).
        timeout: timeout of every torch.distributed collective: a ``timedelta`` or seconds.
        start_method: how Lightning starts the ranks when it starts them itself: ``"popen"``
            (re-run the script, like ``ddp``), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        bucket_cap_mb: largest fused buffer per collective, in MiB (default 25, as DDP). Bigger
            buckets mean fewer collectives (less latency); the buckets are kept from step to step,
            one copy of the gradients whatever their size, as DDP's are.
        resume_mismatch: what to do when a checkpoint's strategy state does not fit this run
            (another world size, other parameter shapes): ``"error"`` (default), ``"reset"``
            (start the state afresh, with a warning) or ``"reshard"`` (another number of ranks:
            keep the state every rank shares and rebuild the rank-local part, where the scheme
            allows it; see :meth:`resharded_rank_state`).
        nonfinite: what to do when an exchanged average (gradients, or a periodic scheme's
            pseudo-gradient) holds an inf or a NaN: ``"raise"`` (default: ``FloatingPointError``
            naming the parameters, on every rank at once) or ``"skip"`` (every rank skips the step,
            or discards the block, and changes nothing: no update, no residual, no counter). Either
            way error-feedback residuals never take a non-finite value.
        verify_sync_every: every this many optimizer steps, check that the replicas agree (the
            weights every rank must hold bit for bit: all parameters for the gradient schemes, the
            global model for the periodic ones, the dense parameters for ``expert_parallel``): two
            float64 moments per tensor, one small all-gather. 0 (default) never checks.
        verify_sync_action: ``"raise"`` (default: ``RuntimeError`` naming the tensors and ranks, on
            every rank at once) or ``"warn"`` when the replicas disagree.
        stop_check_every: batches between two rounds of the ranks' agreement on a SIGTERM
            (:class:`~lightning_commstrats.strategies.stop.StopAgreement`): default 1, a 4-byte
            all-reduce per batch that overlaps the batch; ``k`` sends one per ``k`` batches (its
            packets are mostly headers: worth it beside a sparse scheme's few KB per step) and every rank stops
            within ``2 * k`` batches of the signal instead of 2.
        process_group_backend: another name of ``backend``, as Lightning's ``DDPStrategy`` calls it.
        group_size: ranks per group of fast links (a node, a supernode; consecutive ranks), or
            ``"node"`` (the devices per node); then every fp32 gradient all-reduce of the scheme goes
            in two levels: a reduce-scatter inside the group, an all-reduce across the groups of
            ``1 / group_size`` of the buffer per rank, an all-gather inside
            (:class:`~lightning_commstrats.compression.hierarchical.TwoLevelAllReduce`). ``None``
            (default): one flat ring over all ranks.
        slow_hop_bits: bits per value on the hop between groups: 32 (fp32) or 16, 8, 4, 2, 1
            (quantized with per-column scales and error feedback; needs ``group_size``).
        shard: ``None`` (default: every rank holds the whole model) or ``"fsdp"``: parameters,
            gradients and the inner optimizer state are sharded with torch's FSDP2 over each group of
            ``group_size`` consecutive ranks (default ``"node"``), and the scheme exchanges each rank's
            own shard with the same shard of the other groups (see :mod:`lightning_commstrats.sharding`).
            Supported by ``allreduce``, ``onebit_sgd``, ``expert_parallel`` and the periodic schemes; the
            others refuse it.
        shard_policy: with ``shard="fsdp"``, which modules are units of sharding when the model's
            ``configure_model`` did not apply ``fully_shard`` itself: a
            :class:`~lightning_commstrats.sharding.ShardPolicy` or a dict of its fields (default: the
            elements of module lists and embeddings of at least 65,536 values, then the root).
        residuals: where the slow hop's error-feedback residuals (``slow_hop_bits``) wait between
            steps: ``"device"`` (default) or ``"host"`` (pinned host memory on CUDA, brought to the
            device for each step's encoding; two copies of them over the host link a step). The
            periodic schemes keep them with their outer state (``outer_state``).
        memory_phases: how :attr:`process_memory` measures the peaks of the ``training`` and ``sync``
            phases: ``True`` (default) sampled every 5 ms, leaving the process's peak counters alone
            (``/usr/bin/time``, ``ru_maxrss``, CUDA's peak statistics read true); ``"reset"`` exact, by
            resetting those counters at each phase's start (the kernel's ``VmHWM`` through
            ``/proc/self/clear_refs``, CUDA's peak statistics), so that anything else reading them sees
            the peak since the last step's boundary; ``False`` the run's peak only.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as in
            Lightning's ``DDPStrategy``; the Trainer fills them in.
    """

    strategy_name: ClassVar[str] = ""
    supports_shard: ClassVar[bool] = False  # whether the scheme works on FSDP2 shards (shard="fsdp")

    def __init__(
        self,
        backend: str = "auto",
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        resume_mismatch: str = "error",
        nonfinite: str = "raise",
        verify_sync_every: int = 0,
        verify_sync_action: str = "raise",
        stop_check_every: int = 1,
        process_group_backend: str | None = None,
        group_size: int | str | None = None,
        slow_hop_bits: int = 32,
        shard: str | None = None,
        shard_policy: Any = None,
        residuals: str = "device",
        memory_phases: bool | str = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **unknown: Any,
    ) -> None:
        backend, timeout = check_comm_settings(
            type(self),
            unknown,
            backend=backend,
            timeout=timeout,
            start_method=start_method,
            bucket_cap_mb=bucket_cap_mb,
            resume_mismatch=resume_mismatch,
            nonfinite=nonfinite,
            verify_sync_every=verify_sync_every,
            verify_sync_action=verify_sync_action,
            process_group_backend=process_group_backend,
            group_size=group_size,
            slow_hop_bits=slow_hop_bits,
            shard=shard,
            shard_policy=shard_policy,
            memory_phases=memory_phases,
        )
        self.sharding = Sharding(group_size or "node", shard_policy) if shard is not None else None
        self.shard = shard
        self.group_size = group_size
        self.slow_hop_bits = slow_hop_bits
        # the fused reductions by route; connected with the ranks: gradients in two levels over groups,
        # or across them when sharded
        self.reducer = Reducer(bucket_cap_mb, residuals=residuals)
        self.topology: Topology | None = None  # the ranks' layout, once the world is known
        self.verify_sync_every = verify_sync_every
        self.verify_sync_action = verify_sync_action
        self._backend = backend
        self.resume_mismatch = resume_mismatch
        self.nonfinite = nonfinite
        self._nonfinite_names: list[str] = []  # set by an exchange of this step whose average was not finite
        # init_module(empty_init=True) without shard: the weights are what the allocator left (as ddp)
        self.built_uninitialised = False
        self.bucket_cap_mb = bucket_cap_mb
        self._param_set: ParamSet | None = None  # built when the model is final (setup_scheme)
        self._process_memory: ProcessMemory | None = None  # made at setup, once the rank's device is known
        self.memory_phases = memory_phases
        self.samples_per_worker = 0
        self._samples_total_all_ranks = 0  # samples over all ranks, agreed when a schedule counts them
        self.optimizer_steps = 0
        self.last_step_skipped = False  # the precision plugin skipped the last step (overflow)
        self._samples_at_step = 0  # samples_per_worker after the last step that ran
        self._samples_at_step_all_ranks = 0
        self.states = StateStore(self)  # snapshots and checkpoint files of the scheme's state
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._comm: Communicator | None = None
        self._host_comm: Communicator | None = None
        self.stop_agreement = StopAgreement(every=stop_check_every)  # SIGTERM: every rank stops at the same batch
        # called with the optimizer once this rank's own gradients are complete and unscaled, before
        # the exchange (lightning_commstrats.GradientNoiseScale reads each rank's gradient here)
        self.gradient_observers: list[Callable[[Optimizer], None]] = []
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    # ------------------------------------------------------------------ configuration checks

    @property  # type: ignore[override]
    def accelerator(self) -> pl.accelerators.Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: pl.accelerators.Accelerator | None) -> None:
        if accelerator is not None:
            if not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator)):
                raise ValueError(
                    f"{type(self).__name__} runs on accelerator='cpu' or 'cuda', got accelerator="
                    f"{type(accelerator).__name__}"
                )
            cuda = isinstance(accelerator, CUDAAccelerator)
            resolve_backend(self._backend, "cuda" if cuda else "cpu")
            if cuda and self.shard is not None and self._backend == "gloo":
                raise ValueError(
                    f"shard={self.shard!r} on CUDA needs backend='nccl' (or 'auto'): FSDP2's collectives move"
                    " CUDA tensors, which gloo does not reduce-scatter"
                )
        self._accelerator = accelerator

    @property
    def backend(self) -> str:
        """The backend as given (``"auto"`` until the device is known)."""
        return self._backend

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to shard the data with a distributed sampler."""
        return True

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.check_launch()
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def check_launch(self) -> None:
        """Before any rank starts (the Trainer's construction): the layout of the ranks the Trainer asks
        for fits the settings (:meth:`check_layout`), and ranks of ``backend="mpi"`` come from
        ``mpiexec`` (Lightning cannot start them)."""
        assert self.cluster_environment is not None
        world_size = self.num_nodes * self.num_processes
        if world_size:
            self.check_layout(world_size)
        if self._backend == "mpi" and self.num_nodes * self.num_processes > 1:
            if not self.cluster_environment.creates_processes_externally:
                raise RuntimeError(
                    f"backend='mpi' with devices={self.num_processes} needs its ranks started by MPI:"
                    f" run `mpiexec -n {self.num_nodes * self.num_processes} python <script>`"
                )

    def site_size(self) -> int | None:
        """Ranks per group of fast links (a site) when the run has several such groups of more than
        one rank, else None: the communication statistics charge what crosses between them apart."""
        topology = self.topology
        return topology.group_size if topology.group_size > 1 and topology.num_groups > 1 else None

    def check_layout(self, world_size: int) -> None:
        """Raise ``ValueError`` naming the setting when ``world_size`` ranks (``devices`` x ``num_nodes``)
        cannot be laid out as asked (``group_size`` must divide them): called before the ranks start, so
        a wrong size costs no spawn."""
        try:
            Topology.of(world_size, self.num_processes, self.group_size, self.shard)
        except ValueError as e:
            raise ValueError(
                f"{type(self).__name__}: {e} (devices={self.num_processes} x num_nodes={self.num_nodes});"
                " pass a group_size that divides it, or 'node'"
            ) from None

    def set_world_ranks(self) -> None:
        """Assign ranks like ``ddp``; when the processes were started outside Lightning (``mpiexec``,
        torchrun, SLURM), check that the Trainer's ``devices`` x ``num_nodes`` matches them."""
        expected = self.num_nodes * self.num_processes
        env = self.cluster_environment
        if env is None:
            return
        launched = _externally_launched_world_size(env)
        if launched is not None and self.num_processes and launched != expected:
            raise ValueError(
                f"The launcher started {launched} processes but the Trainer asks for devices={self.num_processes}"
                f" x num_nodes={self.num_nodes} = {expected}; make them equal"
            )
        env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        env.set_world_size(expected)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ set-up

    @property
    def comm(self) -> Communicator:
        """This rank's communicator (available once the strategy has set up its environment)."""
        if self._comm is None:
            raise RuntimeError(f"{type(self).__name__} has no communicator before Trainer.fit/validate/test starts")
        return self._comm

    @property
    def host_comm(self) -> Communicator:
        """A channel of the ranks that moves host memory, for the small control messages the host
        decides on (sample counts): the communicator itself unless it is NCCL, else a gloo group
        made once (every rank makes it at its first use, at the same batch)."""
        if self._host_comm is None:
            self._host_comm = self.comm.duplicate(host=True) if self.comm.backend == "nccl" else self.comm
        return self._host_comm

    @property
    def comm_stats(self) -> CommStats:
        """Cumulative communication statistics of this rank (bytes, calls, seconds, steps, per-step delta)."""
        return self.comm.stats if self._comm is not None else CommStats()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self._comm is None:
            env = self.cluster_environment
            assert env is not None
            multi = self.world_size > 1 and self._backend != "mpi"
            self._comm = create_communicator(
                self._backend,
                rank=self.global_rank,
                world_size=self.world_size,
                device=self.root_device,
                main_address=env.main_address if multi else "127.0.0.1",
                main_port=env.main_port if multi else 0,
                timeout=self._timeout,
            )
        self.topology = Topology.of(self.world_size, self.num_processes, self.group_size, self.shard)
        self._comm.stats.set_groups(self.site_size())  # what crosses between them: the [comm] line's first figure
        if self.sharding is not None and self.sharding.mesh is None:
            self.sharding.connect(self._comm, self.num_processes, self.root_device)
            assert self.sharding.cross is not None
            self.reducer.connect(
                self._comm, self.replica_comm, SlowHop(self.sharding.cross, self.slow_hop_bits, hold=True)
            )
            if self.lightning_module is not None:  # for a configure_model that shards the model itself
                self.lightning_module._device_mesh = self.sharding.mesh
        elif self.reducer.hop is None:
            hop = None
            if self.group_size is not None and self.world_size > 1:  # groups of one too: a hop between ranks
                hop = TwoLevelAllReduce(self._comm, self.topology.group_size, self.slow_hop_bits, hold=True)
            self.reducer.connect(self._comm, self.replica_comm, hop)
        log.info(
            "%s: rank %d of %d over %r%s",
            type(self).__name__,
            self.global_rank,
            self.world_size,
            self._comm,
            f", gradients by {self.two_level!r}" if self.two_level is not None else "",
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._process_memory = ProcessMemory(self.root_device, self.memory_phases)  # one per fit
        plugin = self.precision_plugin
        if getattr(plugin, "scaler", None) is not None and not hasattr(plugin, "unscale_and_check"):
            # Lightning's GradScaler unscales after the exchange and skips an overflowing step on
            # each rank alone: an inf would reach 1-bit residuals and ranks could disagree.
            raise ValueError(
                f"{type(self).__name__} cannot use precision={plugin.precision!r} (a GradScaler without"
                " rank agreement); use plugins=[lightning_commstrats.LayeredMixedPrecision('O1', dtype='fp16')]"
            )
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.configure_model_parallel()
        self.synchronize_initial_weights()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.setup_scheme()
        if fitting:  # before the Trainer registers its signal handlers
            self.stop_agreement.attach(trainer, self.comm)

    def setup_scheme(self) -> None:
        """The model is on its device with rank 0's weights: build the scheme's own structures (both
        front ends, the Trainer and Fabric, call it once per run). The base routes the model's
        torchmetrics metrics through the communicator."""
        self.refresh_params()
        self.route_metrics()

    @property
    def param_set(self) -> ParamSet:
        """The LightningModule's parameters by name, with what each is on this rank (whole, a shard, an
        expert): see :class:`~lightning_commstrats.strategies.params.ParamSet`."""
        if self._param_set is None or self._param_set.module is not self.lightning_module:
            self.refresh_params()
        assert self._param_set is not None
        return self._param_set

    def refresh_params(self) -> None:
        """Build :attr:`param_set` from the model as it is now (called once the model is final)."""
        assert self.lightning_module is not None
        self._param_set = ParamSet(self.lightning_module, expert=self.is_expert_param)

    def params_kept_whole(self) -> set[torch.nn.Parameter]:
        """Parameters FSDP2 leaves alone under ``shard="fsdp"`` (the scheme places them itself: the
        experts of expert parallelism); none by default."""
        return set()

    def kept_whole_index(self) -> int:
        """This rank's place along the dimension :meth:`params_kept_whole` are split over (the ranks
        holding other such tensors draw other values when built empty); 0 by default."""
        return 0

    def is_expert_param(self, name: str, p: torch.nn.Parameter) -> bool:
        """Whether ``p`` is an expert this rank owns (expert parallelism); none by default."""
        return False

    def route_metrics(self) -> None:
        """Make the model's torchmetrics metrics synchronise through this strategy's communicator
        (tag ``"metrics"``, counted): under ``backend="mpi"`` torch.distributed is not initialised and
        torchmetrics would otherwise compute each rank's own value without a word. A metric that
        already has a ``dist_sync_fn`` of its own keeps it."""
        module = self.lightning_module
        if module is None:
            return
        for metric in module.modules():
            if isinstance(metric, Metric) and metric.dist_sync_fn is None:
                metric.dist_sync_fn = self._gather_metric_state
                metric.distributed_available_fn = self._metrics_distributed

    def _metrics_distributed(self) -> bool:
        return self._comm is not None and self.world_size > 1

    def _gather_metric_state(self, tensor: Tensor, group: Any = None) -> list[Tensor]:
        """torchmetrics' ``dist_sync_fn``: every rank's ``tensor`` (first dimensions may differ)."""
        if group is not None:
            raise ValueError(f"{type(self).__name__} synchronises metrics over all ranks only, got group={group!r}")
        tensor = tensor.contiguous()
        if tensor.dim() == 0:
            return list(self.comm.all_gather(tensor.reshape(1), tag="metrics").reshape(-1).unbind(0))
        return self.comm.all_gather_uneven(tensor, tag="metrics")

    @property
    def trainer(self) -> pl.Trainer | None:
        """The Trainer running this strategy; None under Fabric or before a run."""
        return getattr(self.lightning_module, "_trainer", None)

    def note_built_uninitialised(self) -> None:
        """The model is being built with ``empty_init=True`` and no sharding: say what that means."""
        self.built_uninitialised = True
        log_rank_zero(
            log,
            logging.WARNING,
            "%s: init_module(empty_init=True) without shard='fsdp' leaves the weights uninitialised, as"
            " Lightning's ddp does: load a checkpoint into them before training, or pass shard='fsdp' to"
            " build the parameters on the meta device and initialise only each rank's shards",
            type(self).__name__,
        )

    def configure_model_parallel(self) -> None:
        """Shard the model across ranks before the optimizers are built: with ``shard="fsdp"``, FSDP2
        over each group by the shard policy (unless ``configure_model`` did it); else a no-op. A model
        built on the meta device is then materialised: its local shards only when sharded."""
        module = self.lightning_module
        assert module is not None
        empty = has_meta(module)
        if self.sharding is not None and len(self.agree_on_names(["on meta" if empty else "with memory"])) > 1:
            # the ranks of a group would wait in each other's collectives (materialising, FSDP2's first gathers)
            raise ValueError(
                "some ranks built the model on the meta device and others with memory: build it the same way on every"
                " rank (init_module(empty_init=True) or configure_model on meta everywhere, or nowhere)"
            )
        if empty:  # refused before anything is sharded or allocated
            check_initialisable(module)
        kept = self.params_kept_whole()  # FSDP2 leaves them alone: the same objects after sharding
        if self.sharding is not None:
            # a per-module precision policy (LayeredMixedPrecision): each unit gathered in its dtype
            dtypes = getattr(self.precision_plugin, "module_dtypes", None)
            self.sharding.shard_module(module, dtypes, ignored=kept)
        if empty:
            index = self.sharding.index if self.sharding is not None else 0
            called, unwritten = materialize(
                module, self.root_device, index, kept=kept, kept_index=self.kept_whole_index()
            )
            unwritten = self.agree_on_names(unwritten)  # a rank whose shard is empty sees nothing
            if unwritten:
                raise unwritten_error(unwritten, called)
            log_rank_zero(log, logging.INFO, "built on the meta device, initialised by %s", _some_names(called))

    def synchronize_initial_weights(self) -> None:
        """Every rank starts from rank 0's weights, as DDP does when it wraps a model (sharded: every
        group from group 0's shards)."""
        assert self.model is not None
        if self.sharding is None:
            self.broadcast_module(self.model)
            return
        # rank i of every group holds the same chunks as rank i of group 0; buffers are not sharded
        shards = [s for s in map(local, self.model.parameters()) if s.numel()]
        broadcast_tensors(shards, self.replica_comm)
        broadcast_tensors(list(self.model.buffers()), self.comm)

    @property
    def replica_comm(self) -> Communicator:
        """The ranks that hold the same tensors as this one and exchange them: all ranks, or with
        ``shard="fsdp"`` the cross-group channel (rank ``i`` of every group)."""
        if self.sharding is not None and self.sharding.cross is not None:
            return self.sharding.cross
        return self.comm

    @property
    def residuals(self) -> str:
        """Where the scheme's error-feedback residuals wait between steps: ``"device"`` or ``"host"``
        (the ``residuals`` setting; a periodic scheme's ``outer_state``)."""
        return self.reducer.residuals

    @property
    def num_models(self) -> int:
        """The models the scheme averages: every rank's, or with ``shard="fsdp"`` every group's."""
        if self.topology is None:  # before the ranks are connected
            return self.world_size
        return self.topology.num_models

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds now, by kind (``parameters``, ``gradients``, ``optimizer``, ``scheme``)
        and device (``"cpu"``, ``"cuda:0"``...), counted from the tensors' storages, each storage once
        (see :func:`lightning_commstrats.sharding.memory_by_kind`)."""
        assert self.lightning_module is not None
        return memory_by_kind(self.lightning_module, self.optimizers, self.scheme_tensors())

    @property
    def process_memory(self) -> ProcessMemory:
        """What this process holds at its peak as the operating system (its resident set) and the
        device (CUDA's caching allocator) count it, over the run and within the phases ``training``
        (from the start of training to its end) and ``sync`` (each step's exchange, a periodic
        scheme's sync): :class:`~lightning_commstrats.sharding.ProcessMemory`."""
        if self._process_memory is None:  # the Fabric front end: made at its first use
            self._process_memory = ProcessMemory(self.root_device, self.memory_phases)
        return self._process_memory

    def process_memory_stats(self) -> dict[str, dict[str, Any]]:
        """This rank's peaks in bytes, ``{"rss" | "allocated" | "reserved": {"device", "start", "now",
        "peak", "phases": {name: bytes}}}``, beside :meth:`memory_stats`, which counts the tensors
        (see :meth:`~lightning_commstrats.sharding.ProcessMemory.stats`)."""
        return self.process_memory.stats()

    def scheme_tensors(self) -> list[Tensor]:
        """The tensors of the scheme's own state (residuals, global model, outer optimizer...), for
        :meth:`memory_stats`; the base holds the fused buckets and the slow hop's residuals."""
        return tensors_in(self.reducer.held())

    def broadcast_module(self, module: Module, src: int = 0) -> None:
        """Overwrite every parameter and buffer of ``module`` with rank ``src``'s (tag ``"setup"``)."""
        broadcast_tensors([*module.parameters(), *module.buffers()], self.comm, src)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        move_to_device(self.model, self.root_device)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``Trainer.init_module``. ``empty_init=True`` with ``shard="fsdp"``: the parameters are built
        on the meta device and each rank materialises only its shards after sharding (see
        :mod:`lightning_commstrats.sharding.materialize`); unsharded, the weights are left
        uninitialised, as Lightning's ``ddp`` leaves them, for a checkpoint to fill."""
        if empty_init and self.sharding is not None:
            with parameters_on_meta(), self.precision_plugin.tensor_init_context():
                yield
            return
        if empty_init:
            self.note_built_uninitialised()
        with super().tensor_init_context(empty_init):
            yield

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.states.restore_pending()
        self.comm_stats.start_clock()
        self.process_memory.close()  # a fit that raised left its phases open
        self.process_memory.begin("training")

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.stop_agreement.poll()  # raises SIGTERMException on every rank at once after a SIGTERM
        size = extract_batch_size(batch)
        if self.world_size > 1 and self.schedule_counts_samples():
            # Ranks can see different numbers of samples (uneven last batches, an IterableDataset,
            # a custom sampler); a schedule decided on local counts would make them issue different
            # collectives. As CNTK does, they agree on the count: the mean over ranks (8 bytes each),
            # counted on the host: on a channel of host memory (a gloo group beside NCCL), so no CUDA
            # stream waits for it.
            count = torch.tensor([size], dtype=torch.int64)
            total = self.host_comm.all_reduce(count, tag="control")
            self._samples_total_all_ranks += int(total.item())
            self.samples_per_worker = self._samples_total_all_ranks // self.world_size
        else:
            self.samples_per_worker += size
            self._samples_total_all_ranks = self.samples_per_worker * self.world_size

    def schedule_counts_samples(self) -> bool:
        """Whether a decision still ahead (a warm start's end, a block boundary) is counted in
        samples; then every rank agrees on the count before each step (one 8-byte all-reduce)."""
        return False

    # ------------------------------------------------------------------ buffers

    def buffers_to_sync(self) -> list[Tensor]:
        """The module buffers that replicas hold (running statistics...): all of them by default,
        but those every rank computes alike (:func:`agreed_buffer_ids`)."""
        module = self.lightning_module
        if module is None:
            return []
        agreed = agreed_buffer_ids(module)
        return [b for b in module.buffers() if id(b) not in agreed]

    def sync_buffers(self, tag: str = "buffers") -> None:
        """Make every rank's buffers equal: floating-point ones averaged exactly over every rank in
        fp32 or wider (BatchNorm's running statistics of all ranks' data; never through a quantized
        slow hop, whatever ``slow_hop_bits``), the others (counters) taken from rank 0; fused, one
        collective per dtype and bucket. Called before validation during fit, at every periodic
        sync, before a checkpoint is written and when fit ends: buffers never see a gradient, so
        no exchange of the schemes keeps them in agreement otherwise."""
        if self._comm is None or self.world_size == 1:
            return
        buffers = self.buffers_to_sync()
        floats = [b for b in buffers if b.is_floating_point()]
        if floats:
            # half-precision buffers are summed in fp32 (a bf16 sum of ranks' statistics rounds twice)
            wide = [b if b.element_size() >= 4 else b.float() for b in floats]
            named = {id(b): n for n, b in self.lightning_module.named_buffers()}
            names = [named.get(id(b), f"buffer {i}") for i, b in enumerate(floats)]
            self.all_reduce_fused(wide, tag=tag, names=names, route=BUFFERS)
            for b, w in zip(floats, wide, strict=True):
                if w is not b:
                    b.copy_(w)
        others: dict[torch.dtype, list[Tensor]] = {}
        for b in buffers:
            if not b.is_floating_point():
                others.setdefault(b.dtype, []).append(b)
        for group in others.values():
            flat = flatten(group)
            self.comm.broadcast(flat, 0, tag=tag)
            unflatten_into(flat, group)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self.sync_buffers()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.sync_buffers()
        self.stop_agreement.finish()
        self.process_memory.close()  # ends "training", after a periodic scheme's last sync

    # ------------------------------------------------------------------ the strategy's own state

    def state_dict(self) -> dict[str, Any]:
        """State that is the same on every rank (counters, global model...), saved in checkpoints."""
        return {"samples_per_worker": self.samples_per_worker, "optimizer_steps": self.optimizer_steps}

    def rank_state_dict(self) -> dict[str, Any]:
        """State that differs between ranks (residuals...), saved for every rank in the checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        """Restore both; raise ``ValueError`` before changing anything when they do not fit this run."""
        self.samples_per_worker = self._samples_at_step = int(state["samples_per_worker"])
        self._samples_total_all_ranks = self.samples_per_worker * self.world_size
        self.optimizer_steps = int(state["optimizer_steps"])

    def reset_state(self) -> None:
        """Start the scheme's own state afresh (counters keep counting)."""

    def take_snapshot(self) -> dict[str, Any]:
        """A private copy of everything of this strategy's that training changes, for
        :meth:`restore_snapshot` (AutoAdjust rolls its trials back with it): :meth:`StateStore.snapshot`."""
        return self.states.snapshot()

    def restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Put back a :meth:`take_snapshot` (which stays usable): :meth:`StateStore.restore`."""
        self.states.restore(snapshot)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Collective. Rank 0 writes the checkpoint (the model, the state shared by every rank); each
        rank writes its own rank-local state (residuals, local weights and optimizer state...) to a
        shard beside it, ``<file>.rank<r>-of-<N>``, so no rank ever holds another rank's state and
        memory per rank stays that of one rank. The shards are written first and every rank waits
        for all of them before rank 0 writes the file that names them: a checkpoint file that
        exists is complete. Without a shared filesystem each node keeps its ranks' shards.

        With ``shard="fsdp"`` the checkpoint is a directory that every rank writes its shards into
        (``torch.distributed.checkpoint``) and rank 0 completes: it needs a filesystem every rank
        shares; a remote URL or ``storage_options`` is refused before anything is written, and a
        directory that some rank cannot see after the save raises on every rank, naming them."""
        if self._comm is not None:
            self.sync_buffers()  # the file holds the ranks' agreed buffers, not rank 0's alone
            saved = checkpoint.get("state_dict", {})
            for name, b in self.lightning_module.named_buffers():
                if name in saved:
                    saved[name] = b.detach().clone()
            if self.sharding is not None:  # a directory through torch.distributed.checkpoint, every rank's
                sharded_checkpoint.save_strategy(self, checkpoint, str(filepath), storage_options)
                return
            checkpoint[STATE_KEY] = self.states.entry(filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a sharded checkpoint loads into the sharded model and its optimizers: after setup
        return self.sharding is not None

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.sharding is not None:
            if self.is_global_zero:
                sharded_checkpoint.remove(str(filepath))
            return
        super().remove_checkpoint(filepath)  # rank 0: the file
        self.states.remove_shard(filepath)  # every rank: its own shard

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.sharding is not None:
            return sharded_checkpoint.load_strategy(self, str(checkpoint_path))
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.states.read(checkpoint, checkpoint_path, weights_only=weights_only)
        return checkpoint

    def resharded_rank_state(
        self, state: dict[str, Any], rank_state: dict[str, Any] | None, saved_world_size: int
    ) -> dict[str, Any]:
        """The rank-local state to restore on another number of ranks, from the shared ``state`` and
        the state of old rank ``global_rank mod saved_world_size`` (``None`` if its shard is not
        here). Raises ``ValueError`` where the scheme's state cannot be re-split."""
        raise ValueError(f"{type(self).__name__} cannot re-split its state over another number of ranks")

    # ------------------------------------------------------------------ FSDP2's own collectives

    @contextmanager
    def named_failures(self, where: str) -> Iterator[None]:
        """With ``shard="fsdp"``, FSDP2 issues its own collectives inside forward and backward (its
        all-gathers and reduce-scatters), not through the communicator: a peer that died surfaces
        there as the backend's raw error (gloo's "Connection closed by peer"). Raise it as the
        :class:`~lightning_commstrats.comm.CollectiveError` that names the ranks that stopped, as
        every collective of the package does."""
        if self.sharding is None or self._comm is None:
            yield
            return
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as err:
            if not is_backend_failure(err):
                raise
            raise self._comm.failure(f"FSDP2's collectives in {where}", err) from err

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.named_failures("the training step's forward"):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.named_failures("a validation step"):
            return super().validation_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        with self.named_failures("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ------------------------------------------------------------------ the optimizer step

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        runs = True

        def closure_then_exchange() -> Any:
            nonlocal runs
            result = closure()
            runs = self.exchange_before_step(optimizer)
            return result

        output = super().optimizer_step(optimizer, closure_then_exchange, model, **kwargs)
        self.end_step(optimizer, runs)
        return output

    # The two halves of a step around ``optimizer.step``, shared by the Trainer (above) and the Fabric
    # front end (:class:`lightning_commstrats.fabric.FabricStrategy`), which calls them itself.

    def exchange_before_step(self, optimizer: Optimizer) -> bool:
        """This rank's gradients are complete: agree on whether the step runs and exchange. Returns
        False when every rank skips the step (its gradients are then cleared)."""
        # A precision plugin that scales the loss unscales here and, with every rank, decides
        # whether the step runs: before the exchange, so an overflow never reaches a residual.
        check = getattr(self.precision_plugin, "unscale_and_check", None)
        runs = check(optimizer, self) if check is not None else True
        if runs:
            self._nonfinite_names = []
            for observe in self.gradient_observers:
                observe(optimizer)
            self.reducer.discard()  # nothing held from a step that raised
            with self.process_memory.phase("sync"):  # the gradient schemes' exchange
                self.after_backward(optimizer)
            self._nonfinite_names = self.agree_on_names(self._nonfinite_names)
            if self._nonfinite_names and self.handle_nonfinite(self._nonfinite_names, "gradients"):
                runs = False
                for group in optimizer.param_groups:  # the optimizer steps over nothing
                    for p in group["params"]:
                        p.grad = None
            # the slow hop's residuals move only with a step that runs, all or none
            self.reducer.commit() if runs else self.reducer.discard()
        return runs

    def end_step(self, optimizer: Optimizer, runs: bool) -> None:
        """After ``optimizer.step``: the weight schemes' exchange, counters, the replica check."""
        self.last_step_skipped = not runs
        if not runs:  # as if the step's samples had not come: schedules in samples stay where they were
            self.samples_per_worker = self._samples_at_step
            self._samples_total_all_ranks = self._samples_at_step_all_ranks
        else:
            # one phase for the weight schemes' exchange and a periodic scheme's sync (a boundary
            # reads /proc/self/status, and writes clear_refs with memory_phases="reset": tens of microseconds)
            with self.process_memory.phase("sync"):
                self.after_optimizer_step(optimizer)
                self.optimizer_steps += 1
                self._samples_at_step = self.samples_per_worker
                self._samples_at_step_all_ranks = self._samples_total_all_ranks
                self.on_step_counted(optimizer)
        if self.verify_sync_every and runs and self.optimizer_steps % self.verify_sync_every == 0:
            self.verify_replicas()
        self.comm_stats.mark_step()  # what this step sent, its syncs included, is its last_step

    def on_step_counted(self, optimizer: Optimizer) -> None:
        """Called after every optimizer step that ran, once the counters include it, before its
        communication statistics are closed (a periodic scheme syncs here)."""

    def after_backward(self, optimizer: Optimizer) -> None:
        """Called once per optimizer step when this rank's gradients are complete (before clipping).
        An exchange whose average is not finite reports it with :meth:`report_nonfinite`."""

    def agree_on_names(self, names: Sequence[str]) -> list[str]:
        """Collective. ``names`` that this rank found (non-finite averages, disagreeing replicas), made
        every rank's: with ``shard="fsdp"`` the ranks of a group check different shards, and a rank
        that raised or skipped alone would leave the others waiting in FSDP2's next all-gather. One
        4-byte all-reduce over all ranks, the names themselves only when some rank found any."""
        if not self.ranks_check_apart or self.world_size == 1:
            return list(names)
        found = torch.tensor([1 if names else 0], dtype=torch.int32)
        if int(self.host_comm.all_reduce(found, "max", tag="control").item()) == 0:
            return []
        every = self.host_comm.all_gather_object(list(names), tag="control")
        return list(dict.fromkeys(name for mine in every for name in mine))

    @property
    def ranks_check_apart(self) -> bool:
        """Whether the ranks check different tensors for :meth:`agree_on_names` (their shards)."""
        return self.sharding is not None

    def report_nonfinite(self, names: Sequence[str]) -> None:
        """Note parameters whose exchanged average of this step is not finite (every rank must
        report the same names: they come from averages every rank holds)."""
        self._nonfinite_names.extend(names)

    def handle_nonfinite(self, names: Sequence[str], what: str, *, everywhere: bool = True) -> bool:
        """Apply the ``nonfinite`` policy to ``names``: raise, or return True (skip) with a warning.
        ``everywhere=False``: a decision of this rank alone (the asynchronous parameter server)."""
        shown = _some_names(names)
        where = "on every rank" if everywhere else f"on rank {self.global_rank}"
        averaged = "averaged " if everywhere else ""
        if self.nonfinite == "raise" and self.built_uninitialised and self.optimizer_steps == 0:
            raise FloatingPointError(
                f"{type(self).__name__}: the {averaged}{what} of {shown} hold inf or NaN at the first step: the"
                " model was never initialised. It was built with init_module(empty_init=True), which without"
                " shard='fsdp' leaves the weights uninitialised (as Lightning's ddp does). Load a checkpoint"
                " into it before training, build it without empty_init, or pass shard='fsdp' (built on the meta"
                " device and initialised shard by shard)"
            )
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"{type(self).__name__}: the {averaged}{what} of {shown} hold inf or NaN at optimizer step"
                f" {self.optimizer_steps} ({where}). Lower the learning rate, clip gradients, use loss"
                f" scaling, or pass nonfinite='skip' to skip such steps."
            )
        say = log_rank_zero if everywhere else log_here  # a decision every rank took alike: said once
        say(
            log,
            logging.WARNING,
            "non-finite %s%s (%s): step %d skipped %s",
            averaged,
            what,
            shown,
            self.optimizer_steps,
            where,
        )
        return True

    def all_reduce_fused(
        self,
        tensors: Sequence[Tensor],
        *,
        tag: str,
        names: Sequence[str],
        route: str = GRADIENTS,
        exchange: Callable[[Tensor, list[int]], Tensor] | None = None,
    ) -> None:
        """Average ``tensors`` (named ``names``, one each) in place, fused into buckets of at most
        ``bucket_cap_mb``, by the route of their kind (:mod:`~lightning_commstrats.strategies.reducer`:
        gradients over the replicas through the hop, whose residuals move only with a step that
        runs; optimizer state exactly over the replicas; buffers exactly over every rank). Gradient
        averages that hold an inf or a NaN are reported (:meth:`report_nonfinite`), for the
        ``nonfinite`` policy to raise or skip the step on every rank.

        ``exchange(flat, indices)`` replaces the plain all-reduce of one gradient bucket (``indices``
        into ``tensors``); it must return the same tensor on every rank.
        """
        bad = self.reducer.reduce(tensors, tag=tag, names=names, route=route, exchange=exchange)
        if bad:
            self.report_nonfinite(bad)

    def average_flat(self, flat: Tensor, tag: str, key: BucketKey) -> Tensor:
        """The average over the replicas of one flat gradient bucket named by ``key``: two levels
        with ``group_size``, else one ring."""
        return self.reducer.average_flat(flat, tag, key)

    @property
    def two_level(self) -> TwoLevelAllReduce | SlowHop | None:
        """The gradients' two-level all-reduce, or with ``shard="fsdp"`` the hop across groups (``None``:
        one flat ring)."""
        return self.reducer.hop

    def replicated_tensors(self) -> dict[str, Tensor]:
        """The tensors every rank of :attr:`replica_comm` must hold bit for bit (all parameters, or
        their local shards, for a gradient scheme)."""
        return {n: t.detach() for n, t in self.param_set.local_tensors().items()}

    def verify_replicas(self) -> list[str]:
        """Check that the replicas agree: two float64 moments of every replicated tensor, gathered
        from every rank (16 bytes a tensor) and compared exactly. Every rank sees the same gathered
        values, so all of them raise (or warn) together. Returns the tensors that disagree."""
        if self._comm is None or self.replica_comm.world_size == 1:
            return []
        named = self.replicated_tensors()
        if not named:
            return []
        moments = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for t in named.values()])
        every = self.replica_comm.all_gather(moments, tag="control")  # [ranks, tensors, 2]
        differs = (every != every[0]).any(-1)  # [ranks, tensors]
        bad = self.agree_on_names([name for name, d in zip(named, differs.any(0).tolist(), strict=True) if d])
        if bad:
            ranks = [r for r in range(self.replica_comm.world_size) if bool(differs[r].any())]
            shown = _some_names(bad)
            message = (
                f"{type(self).__name__}: replicas disagree at optimizer step {self.optimizer_steps}: {shown}"
                f" differ between rank 0 and ranks {ranks}"
            )
            if self.verify_sync_action == "raise":
                raise RuntimeError(message)
            log_rank_zero(log, logging.WARNING, message)  # every rank saw the same gathered moments
        return bad

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Called after every optimizer step, once the local update is applied."""

    def wait_for_exchange(self) -> None:
        """Let a background exchange in flight complete (the periodic schemes have one)."""

    def param_name(self, p: Tensor) -> str:
        """The LightningModule's name of parameter ``p`` (the key of per-parameter state). A parameter
        the set does not hold makes it read the module again once (its parameters were replaced)."""
        name = self.param_set.name_of(p)
        if name is None:
            self.refresh_params()
            name = self.param_set.name_of(p)
        if name is None:
            raise ValueError(f"{type(self).__name__} keeps state only for parameters of the LightningModule")
        return name

    @override
    def teardown(self) -> None:
        self.stop_agreement.detach()
        self.release_resources()
        if self._process_memory is not None:  # a fit that raised left its phases open: stop their sampler
            self._process_memory.close()
        module = self.lightning_module
        if module is None or not has_meta(module):
            super().teardown()
            return
        # A model refused before it was materialised still holds meta tensors, and Lightning's teardown
        # moves the module to the CPU, which cannot copy out of meta: that error would replace the
        # refusal. The tensors with memory go to the CPU here, the meta ones stay.
        move_to_device(module, torch.device("cpu"))
        module.cpu = lambda: module  # type: ignore[method-assign]
        try:
            super().teardown()
        finally:
            del module.cpu

    def release_resources(self) -> None:
        """Stop what the scheme started beside its communicator (an RPC agent...) at the end of a run;
        both front ends call it. The communicator itself stays, as ``ddp``'s process group does."""

    # ------------------------------------------------------------------ Lightning's collectives

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._comm is not None:
            self._comm.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if self._comm is None:
            return obj
        return self._comm.broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if not isinstance(tensor, Tensor) or self._comm is None:
            return tensor
        if group is not None:
            raise ValueError(f"{type(self).__name__}.reduce supports only the world group, got group={group!r}")
        op = _reduce_op_name(reduce_op)
        out = tensor.detach().clone().contiguous()
        if out.is_floating_point() or op != "avg":
            return self._comm.all_reduce(out, op, tag="metrics")
        return self._comm.all_reduce(out.double(), "avg", tag="metrics")

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if group is not None or sync_grads:
            raise ValueError(f"{type(self).__name__}.all_gather supports neither group= nor sync_grads=True")
        if self._comm is None:
            return tensor
        return self._comm.all_gather(tensor.detach().contiguous(), tag="metrics")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name:
            strategy_registry.register(cls.strategy_name, cls, description=(cls.__doc__ or "").strip().split("\n")[0])


def broadcast_tensors(tensors: Sequence[Tensor], comm: Communicator, src: int = 0) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s of ``comm`` (tag ``"setup"``)."""
    with torch.no_grad():
        for t in tensors:
            if t.is_contiguous():
                comm.broadcast(t.data, src, tag="setup")
            else:
                t.copy_(comm.broadcast(t.detach().contiguous(), src, tag="setup"))


def move_to_device(module: Module, device: torch.device) -> None:
    """``module.to(device)``, leaving tensors on the meta device where they are (a model built
    empty is materialised after it is sharded)."""
    if has_meta(module):
        module._apply(lambda t: t if t.is_meta else t.to(device))
    else:
        module.to(device)


def agreed_buffer_ids(module: Module) -> set[int]:
    """The ids of the buffers in ``module`` that every rank computes alike by construction, named by
    their modules in an ``agreed_buffers`` tuple (an MoE layer's expert bias, updated from the load
    of all ranks): they need no exchange, and averaging could only round them (the mean of three
    equal floats is not always that float)."""
    return {
        id(buffer)
        for m in module.modules()
        for name in getattr(m, "agreed_buffers", ())
        if (buffer := m._buffers.get(name)) is not None
    }


def _some_names(names: Sequence[str], most: int = 8) -> str:
    """The first ``most`` names, and how many more."""
    return ", ".join(list(names)[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _reduce_op_name(reduce_op: ReduceOp | str | None) -> str:
    if reduce_op is None:
        return "avg"
    key = reduce_op.lower() if isinstance(reduce_op, str) else str(reduce_op).rsplit(".", 1)[-1].lower()
    if key not in _REDUCE_OPS:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported; choose one of {sorted(_REDUCE_OPS)}")
    return _REDUCE_OPS[key]


def _externally_launched_world_size(env: ClusterEnvironment) -> int | None:
    """How many processes a launcher outside Lightning started (``mpiexec``, torchrun, SLURM), if known."""
    if not env.creates_processes_externally:
        return None
    if isinstance(env, LightningEnvironment):
        # Lightning's own environment learns the size from the Trainer; a launcher that sets
        # LOCAL_RANK itself also exports WORLD_SIZE (as torchrun and Lightning's children do).
        return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    return env.world_size()
