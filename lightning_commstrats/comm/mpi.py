"""Communicator over mpi4py (processes launched with ``mpiexec``).

Buffers are the tensors themselves: a CPU tensor is handed to MPI through ``Tensor.numpy()``, which
shares its memory, so nothing is copied through Python objects. CUDA tensors are staged through a
host copy (the ``mpich`` wheel of the ``[mpi]`` extra is not CUDA-aware); bfloat16, which numpy
lacks, travels as its 16-bit pattern in moves and as float32 in reductions (4 bytes an element on
the wire, and charged so).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from lightning_utilities.core.imports import RequirementCache
from torch import Tensor

from lightning_commstrats.comm.base import Communicator, FlagChannel
from lightning_commstrats.comm.stats import CommStats

MPI4PY_AVAILABLE = RequirementCache("mpi4py")


def import_mpi() -> Any:
    """Return ``mpi4py.MPI``, or raise an error that says how to install it."""
    if not MPI4PY_AVAILABLE:
        raise ModuleNotFoundError(
            f"{MPI4PY_AVAILABLE}. The MPI backend needs mpi4py and an MPI runtime: `pip install"
            ' "lightning-commstrats[mpi]"` (mpi4py and the mpich wheel), or mpi4py built against your cluster\'s MPI.'
        )
    try:
        from mpi4py import MPI
    except ImportError as err:  # mpi4py installed but no MPI library to load
        raise ModuleNotFoundError(
            f"mpi4py is installed but could not load an MPI library ({err}). Install one, e.g. `pip install mpich`."
        ) from err
    return MPI


class MPICommunicator(Communicator):
    """Collectives on an MPI communicator.

    Args:
        comm: an ``mpi4py.MPI.Comm``; ``None`` is ``MPI.COMM_WORLD``.
    """

    backend = "mpi"

    def __init__(self, comm: Any = None, stats: CommStats | None = None) -> None:
        mpi = import_mpi()
        self._MPI = mpi
        self.comm = mpi.COMM_WORLD if comm is None else comm
        super().__init__(rank=self.comm.Get_rank(), world_size=self.comm.Get_size(), stats=stats)
        self._ops = {"sum": mpi.SUM, "max": mpi.MAX, "min": mpi.MIN}

    def _new_subgroups(self, groups: list[list[int]], mine: int) -> Communicator:
        return MPICommunicator(self.comm.Split(color=mine, key=self.rank), stats=self.stats)

    def _duplicate(self, host: bool) -> Communicator:  # MPI stages CUDA tensors through the host already
        # the second channel is used from a background thread while the main thread uses this one
        level = self._MPI.Query_thread()
        if level < self._MPI.THREAD_MULTIPLE:
            names = {self._MPI.THREAD_SINGLE: "SINGLE", self._MPI.THREAD_FUNNELED: "FUNNELED"}
            raise RuntimeError(
                f"a background exchange needs MPI initialised with MPI_THREAD_MULTIPLE; this MPI gives"
                f" MPI_THREAD_{names.get(level, 'SERIALIZED')}: use fragment_sync_delay=0 with backend='mpi',"
                " or an MPI library built with thread support (the mpich wheel of the [mpi] extra has it)"
            )
        return MPICommunicator(self.comm.Dup(), stats=self.stats)

    def _flag_channel(self) -> FlagChannel:
        return _MPIFlags(self.comm.Dup(), self._MPI, self.stats)

    def _reduce_itemsize(self, tensor: Tensor) -> int:
        # numpy has no bfloat16: reductions stage it as float32, which is what travels
        return 4 if tensor.dtype == torch.bfloat16 else tensor.element_size()

    def _all_reduce(self, tensor: Tensor, op: str) -> None:
        with _host(tensor, reduce=True) as buf:
            self.comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._ops[op])

    def _reduce_scatter(self, out: Tensor, tensor: Tensor, op: str) -> None:
        with _host(tensor, reduce=True, writeback=False) as send, _host(out, reduce=True) as recv:
            self.comm.Reduce_scatter_block(send, recv, op=self._ops[op])

    def _all_gather(self, out: Tensor, tensor: Tensor) -> None:
        with _host(tensor, writeback=False) as send, _host(out) as recv:
            self.comm.Allgather(send, recv)

    def _all_to_all(self, out: Tensor, tensor: Tensor, recv_splits: list[int], send_splits: list[int]) -> None:
        row = math.prod(tensor.shape[1:])
        scounts = [s * row for s in send_splits]
        rcounts = [s * row for s in recv_splits]
        with _host(tensor, writeback=False) as send, _host(out) as recv:
            self.comm.Alltoallv(
                [send.reshape(-1), (scounts, _displs(scounts))], [recv.reshape(-1), (rcounts, _displs(rcounts))]
            )

    def _broadcast(self, tensor: Tensor, src: int) -> None:
        with _host(tensor) as buf:
            self.comm.Bcast(buf, root=src)

    def _barrier(self) -> None:
        self.comm.Barrier()


class _MPIFlags(FlagChannel):
    """A flag channel on a duplicate of the MPI communicator: a nonblocking MAX ``Iallreduce``."""

    def __init__(self, comm: Any, mpi: Any, stats: CommStats) -> None:
        super().__init__(stats)
        self.comm, self._MPI = comm, mpi
        self._send = np.zeros(1, dtype=np.int32)
        self._recv = np.zeros(1, dtype=np.int32)
        self._request: Any = None

    def _start(self, flag: int) -> None:
        self._send[0] = flag
        self._request = self.comm.Iallreduce(self._send, self._recv, op=self._MPI.MAX)

    def _wait(self) -> int:
        request, self._request = self._request, None
        request.Wait()
        return int(self._recv[0])

    def _close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None and not self._MPI.Is_finalized():
            comm.Free()


def _displs(counts: list[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]


class _host:
    """A numpy view of a tensor for MPI; copies only when the tensor is not a CPU numpy-able buffer."""

    def __init__(self, tensor: Tensor, *, reduce: bool = False, writeback: bool = True) -> None:
        self.tensor = tensor
        self.writeback = writeback
        staged = tensor
        if staged.device.type != "cpu":
            staged = staged.cpu()
        if staged.dtype == torch.bfloat16:
            # numpy has no bfloat16: reductions run in float32, plain moves carry the raw 16 bits.
            staged = staged.float() if reduce else staged.view(torch.int16)
        self.staged = staged
        self.copied = staged is not tensor and staged.data_ptr() != tensor.data_ptr()

    def __enter__(self) -> np.ndarray:
        return self.staged.numpy()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None and self.copied and self.writeback:
            src = self.staged
            if self.tensor.dtype == torch.bfloat16 and src.dtype == torch.int16:
                src = src.view(torch.bfloat16)
            self.tensor.copy_(src)
