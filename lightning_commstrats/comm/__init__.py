"""The communication layer: the only part of the package that talks to the network.

Strategies get a :class:`Communicator` from :func:`create_communicator` and call its collectives;
each call is charged to the communicator's :class:`CommStats` (bytes sent by this rank, calls,
seconds waiting) under a tag that names the traffic. Byte formulas: :mod:`.wire`.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from lightning_commstrats.comm import wire
from lightning_commstrats.comm.base import (
    REDUCE_OPS,
    CollectiveError,
    Communicator,
    LocalCommunicator,
    is_backend_failure,
)
from lightning_commstrats.comm.mpi import MPI4PY_AVAILABLE, MPICommunicator, import_mpi
from lightning_commstrats.comm.stats import CommCounters, CommSnapshot, CommStats, delta
from lightning_commstrats.comm.torch_dist import (
    Heartbeat,
    LivenessWatch,
    TorchCommunicator,
    destroy_process_group,
    init_process_group,
    world_heartbeat,
)

BACKENDS = ("auto", "gloo", "nccl", "mpi")

__all__ = [
    "BACKENDS",
    "MPI4PY_AVAILABLE",
    "REDUCE_OPS",
    "CollectiveError",
    "CommCounters",
    "CommSnapshot",
    "CommStats",
    "Communicator",
    "Heartbeat",
    "LivenessWatch",
    "LocalCommunicator",
    "MPICommunicator",
    "TorchCommunicator",
    "create_communicator",
    "delta",
    "destroy_process_group",
    "import_mpi",
    "init_process_group",
    "is_backend_failure",
    "resolve_backend",
    "wire",
]


def resolve_backend(backend: str, device_type: str) -> str:
    """The concrete backend for ``backend`` on a device of type ``device_type``.

    ``"auto"`` is NCCL on CUDA and gloo otherwise. Raises ``ValueError`` naming the argument for an
    unknown backend or one that cannot drive that device (NCCL without CUDA).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {BACKENDS}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"lightning_commstrats runs on 'cpu' or 'cuda' devices, not {device_type!r}")
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(f"backend='nccl' needs CUDA devices, but the accelerator is {device_type!r}; use 'gloo'")
    return backend


def create_communicator(
    backend: str,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    main_address: str = "127.0.0.1",
    main_port: int = 29500,
    timeout: timedelta = timedelta(minutes=30),
) -> Communicator:
    """Connect this rank and return its communicator.

    Args:
        backend: ``"auto"``, ``"gloo"``, ``"nccl"`` or ``"mpi"`` (mpi4py; ranks come from ``mpiexec``).
        rank: this process's global rank.
        world_size: number of ranks; with 1 no connection is made and a :class:`LocalCommunicator`
            is returned.
        device: the device this rank computes on.
        main_address: rendezvous host for torch.distributed (ignored by MPI).
        main_port: rendezvous port for torch.distributed (ignored by MPI).
        timeout: torch.distributed timeout for every collective.
    """
    backend = resolve_backend(backend, device.type)
    if world_size == 1:
        return LocalCommunicator()
    if backend == "mpi":
        comm = MPICommunicator()
        if (comm.rank, comm.world_size) != (rank, world_size):
            raise RuntimeError(
                f"MPI sees rank {comm.rank} of {comm.world_size} but the trainer expects rank {rank} of"
                f" {world_size}: launch with `mpiexec -n {world_size}`"
            )
        return comm
    init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        main_address=main_address,
        main_port=main_port,
        device=device,
        timeout=timeout,
    )
    return TorchCommunicator(heartbeat=world_heartbeat(rank, world_size), device=device)
