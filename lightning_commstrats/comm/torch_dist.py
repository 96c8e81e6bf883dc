"""Communicator over ``torch.distributed`` process groups (gloo on CPU, NCCL on CUDA).

NCCL moves only CUDA tensors of the device its group is bound to. The communicator's own messages
are made there (:attr:`TorchCommunicator.device`), and a tensor handed to an NCCL collective from
elsewhere (a CPU metric Lightning reduces) travels through a copy on that device, written back
after, as the MPI communicator stages CUDA tensors through the host. A gloo group moves host
memory: CUDA tensors handed to it travel through host copies the same way (the second channel of a
background exchange on a CUDA run is such a group, see :meth:`Communicator.duplicate`).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_commstrats.comm.base import Communicator, FlagChannel
from lightning_commstrats.comm.stats import CommStats

log = logging.getLogger(__name__)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Heartbeat:
    """Every rank bumps a counter in the rendezvous store from a background thread, so that a rank
    whose collective fails can name the peers that stopped (killed, out of memory, exited on an
    exception) instead of only reporting a closed connection.

    Args:
        store: the process group's key-value store (hosted by rank 0's process).
        rank: this process's global rank.
        world_size: number of ranks.
        interval: seconds between beats.
    """

    PREFIX = "commstrats/heartbeat/"

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval: float = 0.5) -> None:
        self.store, self.rank, self.world_size, self.interval = store, rank, world_size, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="commstrats-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(f"{self.PREFIX}{self.rank}", 1)
            except Exception:  # the store's host is gone; the collectives will say so
                return
            self._stop.wait(self.interval)

    def stopped_peers(self) -> list[int] | None:
        """The other ranks whose counter did not move over four beats, leaving out those that
        reported a failed collective themselves (they saw the same dead peer and are leaving too);
        ``None`` when the store cannot be reached (rank 0's process, which hosts it, is gone)."""
        if self.store is None:
            return None
        try:
            self.store.set(f"{self.PREFIX}failed/{self.rank}", "1")
            before = [int(self.store.add(f"{self.PREFIX}{r}", 0)) for r in range(self.world_size)]
            time.sleep(4 * self.interval)
            after = [int(self.store.add(f"{self.PREFIX}{r}", 0)) for r in range(self.world_size)]
            reported = set(r for r in range(self.world_size) if self.store.check([f"{self.PREFIX}failed/{r}"]))
            self.store.set(f"{self.PREFIX}diagnosed/{self.rank}", "1")
        except Exception:
            return None
        stopped = [r for r in range(self.world_size) if r not in reported and after[r] == before[r]]
        if self.rank == 0:
            # this process hosts the store: if it left now, the others, still diagnosing the same
            # failure, would find it gone and could not name the rank that stopped
            self._await_diagnoses([r for r in range(1, self.world_size) if r not in stopped])
        return stopped

    def _await_diagnoses(self, ranks: list[int]) -> None:
        """Wait (at most ten beats and two seconds) until ``ranks`` have finished their diagnosis."""
        deadline = time.monotonic() + 10 * self.interval + 2.0
        keys = [f"{self.PREFIX}diagnosed/{r}" for r in ranks]
        while time.monotonic() < deadline:
            try:
                if all(self.store.check([key]) for key in keys):
                    return
            except Exception:
                return
            time.sleep(self.interval / 5)

    def counts(self) -> list[int] | None:
        """Every rank's counter now, without waiting (``None`` when the store cannot be reached)."""
        if self.store is None:
            return None
        try:
            return [int(self.store.add(f"{self.PREFIX}{r}", 0)) for r in range(self.world_size)]
        except Exception:
            return None

    def close(self) -> None:
        """Stop beating and let go of the store: rank 0's store (a server) must close with its process
        group, or a later group's rendezvous on the same port would find the old one."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.store = None


def describe_stopped(stopped: list[int] | None) -> str:
    """What a failed wait says of the peers a heartbeat found stopped (``None``: the store is gone)."""
    if stopped is None:
        return "rank 0's process, which hosts the rendezvous store, is gone"
    return f"rank(s) {stopped} stopped (killed, out of memory, or exited on an error)"


class LivenessWatch:
    """For a wait that is not a collective (a reply from a parameter server): polls the heartbeat
    counters and names the ranks whose counter has not moved for ``after`` seconds.

    Args:
        heartbeat: the ranks' counters.
        after: seconds without a beat after which a rank counts as stopped (ten beats by default).
    """

    def __init__(self, heartbeat: Heartbeat, after: float | None = None) -> None:
        self.heartbeat = heartbeat
        self.after = 10 * heartbeat.interval if after is None else after
        self._last: list[int] | None = heartbeat.counts()
        now = time.monotonic()
        self._moved = [now] * heartbeat.world_size

    def stopped(self) -> list[int] | None:
        """The ranks whose counter has not moved for ``after`` seconds; ``None`` when the store is
        gone (rank 0's process, which hosts it, has stopped)."""
        counts = self.heartbeat.counts()
        if counts is None:
            return None
        now = time.monotonic()
        for r, c in enumerate(counts):
            if self._last is None or c != self._last[r]:
                self._moved[r] = now
        self._last = counts
        return [r for r in range(len(counts)) if r != self.heartbeat.rank and now - self._moved[r] > self.after]


_HEARTBEAT: tuple[object, Heartbeat] | None = None  # (the default process group, its heartbeat)
_EXIT_HOOK = False  # destroy_process_group registered to run at exit


def world_heartbeat(rank: int, world_size: int) -> Heartbeat:
    """The heartbeat of the default process group: one beating thread per process, however many
    communicators (Trainers) use the group; a new group gets a new one."""
    global _HEARTBEAT
    group = dist.distributed_c10d._get_default_group()
    if _HEARTBEAT is None or _HEARTBEAT[0] is not group:
        if _HEARTBEAT is not None:
            _HEARTBEAT[1].close()
        store = dist.distributed_c10d._get_default_store()  # the world group's rendezvous store
        _HEARTBEAT = (group, Heartbeat(store, rank, world_size))
    return _HEARTBEAT[1]


class TorchCommunicator(Communicator):
    """Collectives on a ``torch.distributed`` process group.

    Args:
        group: the process group; ``None`` is the default (world) group, which must be initialised
            (see :func:`init_process_group`).
        heartbeat: the ranks' liveness counters, to name a peer that stopped when a collective
            fails (shared with subgroups and duplicates).
        device: this rank's CUDA device, for NCCL (default: the current CUDA device when the
            communicator is made); ignored by gloo, whose messages are made on the CPU.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        heartbeat: Heartbeat | None = None,
        device: torch.device | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        self.group = group
        self.backend = str(dist.get_backend(group))
        self.heartbeat = heartbeat
        # fixed now, not looked up per call: a background thread's current CUDA device is cuda:0
        self.device = nccl_device(device) if self.backend == "nccl" else torch.device("cpu")
        if group is not None and group is not dist.group.WORLD:
            self.ranks = tuple(dist.get_process_group_ranks(group))
        super().__init__(rank=dist.get_rank(group), world_size=dist.get_world_size(group), stats=stats)

    def _new_subgroups(self, groups: list[list[int]], mine: int) -> Communicator:
        made = None
        for i, ranks in enumerate(groups):  # every rank creates every group, in the same order
            # of this channel's backend: the subgroups of a host (gloo) channel beside NCCL move host memory too
            group = dist.new_group([self._global(r) for r in ranks], backend=self.backend)
            if i == mine:
                made = group
        return TorchCommunicator(made, stats=self.stats, heartbeat=self.heartbeat, device=self.device)

    def _duplicate(self, host: bool) -> Communicator:
        ranks = list(range(dist.get_world_size())) if self.group is None else dist.get_process_group_ranks(self.group)
        group = dist.new_group(ranks, backend="gloo" if host else None)
        return TorchCommunicator(group, stats=self.stats, heartbeat=self.heartbeat, device=self.device)

    def _flag_channel(self) -> FlagChannel:
        ranks = list(range(dist.get_world_size())) if self.group is None else dist.get_process_group_ranks(self.group)
        group = dist.new_group(ranks, backend="gloo")  # CPU: no CUDA stream waits on a flag
        return _GlooFlags(group, self.stats, self._diagnose)

    def _diagnose(self) -> str:
        if self.heartbeat is None:
            return ""
        stopped = self.heartbeat.stopped_peers()
        if stopped == []:
            return "every rank is alive: one is stuck or failed inside the collective"
        return describe_stopped(stopped)

    def _all_reduce(self, tensor: Tensor, op: str) -> None:
        with self._staged(tensor) as t:
            dist.all_reduce(t, op=_OPS[op], group=self.group)

    def _reduce_scatter(self, out: Tensor, tensor: Tensor, op: str) -> None:
        with self._staged(out, fill=False) as o, self._staged(tensor, writeback=False) as t:
            dist.reduce_scatter(o, list(t.chunk(self.world_size)), op=_OPS[op], group=self.group)

    def _all_gather(self, out: Tensor, tensor: Tensor) -> None:
        with self._staged(out, fill=False) as o, self._staged(tensor, writeback=False) as t:
            dist.all_gather(list(o.unbind(0)), t, group=self.group)

    def _all_to_all(self, out: Tensor, tensor: Tensor, recv_splits: list[int], send_splits: list[int]) -> None:
        with self._staged(out, fill=False) as o, self._staged(tensor, writeback=False) as t:
            dist.all_to_all_single(o, t, recv_splits, send_splits, group=self.group)

    def _broadcast(self, tensor: Tensor, src: int) -> None:
        with self._staged(tensor) as t:
            dist.broadcast(t, src=self._global(src), group=self.group)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _staged(self, tensor: Tensor, *, fill: bool = True, writeback: bool = True) -> _Staged:
        """``tensor`` as the backend takes it: itself, or a copy on :attr:`device` (NCCL: a tensor on
        another device; gloo: a CUDA tensor, through host memory), filled from it when ``fill`` and
        copied back into it when ``writeback``. The copies run on the calling thread's current
        stream: a background exchange on its own stream waits for them, the main stream does not."""
        return staged_on(self.device, tensor, fill=fill, writeback=writeback)


def staged_on(device: torch.device, tensor: Tensor, *, fill: bool = True, writeback: bool = True) -> _Staged:
    """A context handing out ``tensor`` itself when it is on ``device``, else a copy there (filled
    from it when ``fill``; copied back into it on success when ``writeback``)."""
    if tensor.device == device:
        return _Staged(tensor, tensor, writeback=False)
    staged = tensor.to(device) if fill else torch.empty_like(tensor, device=device)
    return _Staged(tensor, staged, writeback=writeback)


class _GlooFlags(FlagChannel):
    """A flag channel on a gloo group of its own: an asynchronous MAX all-reduce of one int32."""

    def __init__(self, group: dist.ProcessGroup, stats: CommStats, diagnose: Callable[[], str]) -> None:
        super().__init__(stats, diagnose)
        self.group = group
        self._buffer = torch.zeros(1, dtype=torch.int32)
        self._work: dist.Work | None = None

    def _start(self, flag: int) -> None:
        self._buffer.fill_(flag)
        self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def _wait(self) -> int:
        assert self._work is not None
        work, self._work = self._work, None
        work.wait()
        return int(self._buffer.item())

    def _close(self) -> None:
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)


class _Staged:
    """A context that hands out ``staged`` and, on success, copies it back into ``tensor``."""

    def __init__(self, tensor: Tensor, staged: Tensor, *, writeback: bool) -> None:
        self.tensor, self.staged, self.writeback = tensor, staged, writeback

    def __enter__(self) -> Tensor:
        return self.staged

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None and self.writeback:
            self.tensor.copy_(self.staged)


def nccl_device(device: torch.device | None = None) -> torch.device:
    """The CUDA device an NCCL communicator of this rank moves tensors on: ``device`` (a CUDA device)
    or the current CUDA device, with its index."""
    if device is not None and device.type == "cuda" and device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def init_process_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    main_address: str,
    main_port: int,
    device: torch.device,
    timeout: timedelta,
) -> None:
    """Initialise the default process group once (a second call with the same world is a no-op)."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()},"
                f" not rank {rank} of {world_size}"
            )
        return
    os.environ["MASTER_ADDR"] = main_address
    os.environ["MASTER_PORT"] = str(main_port)
    log.info(
        "initialising %s process group: rank %d of %d at %s:%d", backend, rank, world_size, main_address, main_port
    )
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    # A group still alive when the interpreter shuts down is torn down with it, gloo's worker threads
    # included, and the process can abort there ("terminate called without an active exception")
    # after everything else went well. Lightning registers this for NCCL only; the group made here
    # is destroyed at exit whatever its backend (a no-op once the user destroyed it).
    global _EXIT_HOOK
    if not _EXIT_HOOK:
        atexit.register(destroy_process_group)
        _EXIT_HOOK = True


def destroy_process_group() -> None:
    global _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT[1].close()
        _HEARTBEAT = None
    if dist.is_initialized():
        dist.destroy_process_group()
