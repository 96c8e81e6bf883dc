"""Connects a worker script to its peers, from what the harness put in the environment."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lightning_commstrats.comm import Communicator, create_communicator, destroy_process_group


def connect(backend: str = "gloo") -> Communicator:
    """This rank's communicator: ranks from MPI under ``mpiexec``, else from ``LOCAL_RANK`` / ``WORLD_SIZE``."""
    if backend == "mpi":
        from mpi4py import MPI

        rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    else:
        rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return create_communicator(
        backend,
        rank=rank,
        world_size=world,
        device=torch.device("cpu"),
        main_address=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        main_port=int(os.environ.get("MASTER_PORT", 0)),
    )


def finish(comm: Communicator) -> None:
    """Leave together: a rank that exits while a peer's gloo threads still talk to it aborts that peer."""
    comm.barrier()
    destroy_process_group()


def save_and_leave(results: Any, out: Path, rank: int) -> None:
    """A Trainer or Fabric worker's end: save rank ``rank``'s ``results`` as ``out/rank<r>.pt``, then
    leave with the others (gloo's threads torn down by one rank's exit, at interpreter exit, can abort
    a peer still talking to it: "terminate called without an active exception")."""
    torch.save(results, out / f"rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    destroy_process_group()
