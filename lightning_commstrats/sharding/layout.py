"""The sharded layout of a run: FSDP2 inside each group of ranks, the schemes across the groups.

A run of ``N`` ranks in groups of ``g`` consecutive ranks (a node, a supernode: the fast links) is a
2-D ``DeviceMesh`` ``(replicate, shard)`` of ``G x g``. FSDP2 shards the parameters, gradients and
inner optimizer state over the ``shard`` dimension (rank ``i`` of a group holds chunk ``i`` of every
sharded parameter, dim 0); the schemes exchange across the ``replicate`` dimension, over the
*cross-group channel*: the communicator of rank ``i`` of every group, whose ranks hold the same
chunks. Every rank thus carries its own share across the slow links (``1 / g`` of the model); none
funnels through a group's first rank.

:class:`Sharding` is the component a strategy holds for this: it validates the setting, builds the
mesh and the cross-group channel, shards the model (:mod:`lightning_commstrats.sharding.policy`),
hands out local tensors, and saves and loads sharded checkpoints
(:mod:`lightning_commstrats.sharding.checkpoint`). No Lightning here.
"""

from __future__ import annotations

import atexit
import logging
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_commstrats.comm import Communicator
from lightning_commstrats.comm.torch_dist import TorchCommunicator, destroy_process_group
from lightning_commstrats.sharding.policy import ShardPolicy, apply_fsdp, register_step_methods
from lightning_commstrats.sharding.traffic import count_fsdp_traffic
from lightning_commstrats.topology import Topology

log = logging.getLogger(__name__)

SHARD_MODES = (None, "fsdp")


def fsdp_available() -> bool:
    """Whether this torch has FSDP2 (``fully_shard``) and DTensor."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError:
        return False
    return torch.distributed.is_available()


def check_shard(shard: Any, owner: str, supported: bool, backend: str = "auto") -> None:
    """Construction-time checks of ``shard``: its value, the scheme's support, FSDP2's presence."""
    if shard not in SHARD_MODES:
        raise ValueError(f"shard={shard!r} is not supported; choose one of {SHARD_MODES}")
    if shard is None:
        return
    if not supported:
        raise ValueError(
            f"{owner} cannot honour shard={shard!r}: sharding with FSDP2 is supported by allreduce, onebit_sgd,"
            " expert_parallel and the periodic schemes (model_averaging, bmuf, diloco, streaming_diloco, sparseloco)"
        )
    if backend == "mpi":
        raise ValueError(
            f"shard={shard!r} needs torch.distributed (FSDP2); backend='mpi' cannot carry it: use gloo or nccl"
        )
    if not fsdp_available():
        raise ValueError(
            f"shard={shard!r} needs torch's FSDP2 (torch.distributed.fsdp.fully_shard and DTensor), which this"
            f" torch {torch.__version__} lacks; install torch >= 2.6"
        )


try:  # looked up once: local() runs per tensor on the hot path of unsharded runs too
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch without distributed support
    _DTensor = None


def is_dtensor(t: Any) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (sharing its storage), else ``t``."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


class Sharding:
    """FSDP2 inside groups of ``group_size`` ranks; the cross-group channel for the scheme.

    Args:
        group_size: ranks per group (consecutive ranks); must divide the world (checked at
            :meth:`connect`, when the world is known).
        policy: which modules are units (:class:`~lightning_commstrats.sharding.policy.ShardPolicy`).
    """

    def __init__(self, group_size: int | str, policy: ShardPolicy | dict[str, Any] | None = None) -> None:
        self.group_size = group_size
        self.policy = ShardPolicy.of(policy)
        self.mesh: Any = None  # the 2-D (replicate, shard) DeviceMesh
        self.cross: Communicator | None = None  # rank i of every group
        self.units: list[str] = []
        self._mine: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the models this object sharded
        self.num_groups = 1
        self.group = 0  # this rank's group
        self.index = 0  # this rank's place in its group
        self.stats: Any = None  # the run's communication statistics, where FSDP2's own traffic is counted

    def __repr__(self) -> str:
        size = self.group_size if self.mesh is None else self.mesh.shape[1]
        return f"Sharding(fsdp, {self.num_groups} group(s) of {size}, {len(self.units)} unit(s) + root)"

    def connect(self, comm: Communicator, devices_per_node: int, device: torch.device) -> None:
        """Build the mesh and the cross-group channel (collective: every rank, in the same order)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.stats = comm.stats
        if not dist.is_initialized():  # one rank: no process group was made, and FSDP2 needs one
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
            atexit.register(destroy_process_group)  # kept for the process, as a world's group is
        # raises when the size does not divide the world
        topology = Topology.of(comm.world_size, devices_per_node, self.group_size, "fsdp")
        size = topology.group_size
        self.num_groups, self.group, self.index = (
            topology.num_groups,
            topology.group_of(comm.rank),
            topology.index_of(comm.rank),
        )
        self.mesh = init_device_mesh(device.type, (self.num_groups, size), mesh_dim_names=("replicate", "shard"))
        self._across = topology.across()
        # the mesh's own groups of rank i of every group, not another set of them
        self.cross = self._mesh_channel(comm, "replicate")

    def cross_channel(self, comm: Communicator, *, host: bool) -> Communicator:
        """Another cross-group channel, for a background exchange (collective, as :meth:`connect`):
        over host memory (gloo) when ``host``, else the backend of ``comm``."""
        if self.num_groups == 1:
            return _single(comm)
        return comm.duplicate(host=host).new_subgroups(self._across)

    def inner_channel(self, comm: Communicator) -> Communicator:
        """A communicator over this rank's group (the mesh's ``shard`` dimension, FSDP2's ranks), its
        traffic charged to ``comm``'s statistics: the channel of expert parallelism inside a group."""
        return self._mesh_channel(comm, "shard")

    def _mesh_channel(self, comm: Communicator, dim: str) -> Communicator:
        """A communicator over this rank's group of the mesh's dimension ``dim``, charged to ``comm``'s
        statistics; this rank alone where that dimension has one rank."""
        if self.mesh.shape[self.mesh.mesh_dim_names.index(dim)] == 1:
            return _single(comm)
        return TorchCommunicator(
            self.mesh.get_group(dim), stats=comm.stats, heartbeat=comm.heartbeat, device=comm.device
        )

    @property
    def shard_mesh(self) -> Any:
        """The 1-D mesh of this rank's group, over which FSDP2 shards."""
        return self.mesh["shard"]

    def shard_module(
        self, module: nn.Module, dtypes: Mapping[str, str] | None = None, ignored: set[nn.Parameter] | None = None
    ) -> None:
        """Shard ``module`` by the policy, unless its ``configure_model`` already applied
        ``fully_shard`` (then it is used as it is, after a check that it was sharded over this mesh).
        ``dtypes`` (module name -> dtype name, a precision policy's) gathers each unit in the dtype
        it computes in (:func:`~lightning_commstrats.sharding.policy.plan_units`); ``ignored`` are
        parameters FSDP2 leaves whole (a scheme places them itself). Either way FSDP2's
        collectives are counted (:mod:`~lightning_commstrats.sharding.traffic`)."""
        sharded = [p for p in module.parameters() if is_dtensor(p)]
        if module in self._mine:  # sharded here for an earlier stage (fit, then validate): as it is
            pass
        elif sharded:
            if len(sharded) != len([p for p in module.parameters() if p not in (ignored or ())]):
                names = [n for n, p in module.named_parameters() if not is_dtensor(p)][:5]
                raise ValueError(
                    f"configure_model sharded only part of the model ({names} are not DTensors): apply fully_shard"
                    " to the root module too, over self.device_mesh['shard']"
                )
            meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in sharded}
            mine = tuple(self.shard_mesh.mesh.flatten().tolist())
            if meshes != {mine}:
                raise ValueError(
                    f"configure_model sharded the model over ranks {sorted(meshes)}; with shard='fsdp' shard it over"
                    f" self.device_mesh['shard'] (ranks {list(mine)})"
                )
            self.units = ["(configure_model)"]
            register_step_methods(module)
            unapplied = _unapplied_settings(self.policy, dtypes)
            if unapplied and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
                warnings.warn(
                    f"configure_model sharded the model itself, so {' and '.join(unapplied)} did not apply: its units"
                    " are gathered as configure_model made them. Pass fully_shard an mp_policy (FSDP2's"
                    " MixedPrecisionPolicy: param_dtype for half blocks, reduce_dtype=torch.float32) and checkpoint the"
                    " blocks there, or leave the sharding to the strategy",
                    stacklevel=2,
                )
        else:
            self.units = apply_fsdp(module, self.shard_mesh, self.policy, dtypes, ignored)
            self._mine.add(module)
            if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
                # FSDP2 warns (once a process) about in-place ops on the root's output when it is a
                # view, as a Linear's is: once, from rank 0, says it
                warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
            log.info("shard='fsdp': units %s and the root, over %s", self.units, self.shard_mesh)
        if self.stats is not None:
            count_fsdp_traffic(module, self.stats)


def _unapplied_settings(policy: ShardPolicy, dtypes: Mapping[str, str] | None) -> list[str]:
    """What a ``configure_model`` that shards the model itself leaves out: a shard policy other than the
    default, and a precision plan's half units (each would be gathered in half by the policy)."""
    out = []
    if policy != ShardPolicy():
        given = {k: v for k, v in vars(policy).items() if v != getattr(ShardPolicy(), k)}
        out.append(f"shard_policy {given}")
    half = sorted({d for d in (dtypes or {}).values() if d != "fp32"})
    if half:
        out.append(f"the precision plugin's units in {'/'.join(half)} (gathered in float32 instead)")
    return out


def _single(comm: Communicator) -> Communicator:
    """The cross-group channel of a run with one group: this rank alone."""
    from lightning_commstrats.comm.base import LocalCommunicator

    single = LocalCommunicator()
    single.stats = comm.stats
    return single
