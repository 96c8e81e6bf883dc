"""The communicator interface: the collectives every scheme needs, each one accounted.

A :class:`Communicator` is the only object in the package that moves tensors between ranks.
Each public method

1. validates its arguments (shapes, splits, ranks) before anything is sent, so a bad call fails
   on the rank that made it instead of hanging its peers;
2. runs the collective on the backend (:class:`~lightning_commstrats.comm.TorchCommunicator` for
   gloo / NCCL, :class:`~lightning_commstrats.comm.MPICommunicator` for mpi4py);
3. charges this rank's :class:`~lightning_commstrats.comm.CommStats` with the bytes it sent
   (formulas in :mod:`lightning_commstrats.comm.wire`) and the seconds it spent waiting, under a
   *tag* naming the kind of traffic (``"grad"``, ``"weights"``, ``"control"``...). On CPU tensors
   the seconds are wall time; on CUDA tensors they are measured between two CUDA events on the
   tensor's stream and read when the statistics are, so no collective waits for the device.

Tensors the communicator makes itself (the lengths and bytes of object collectives, split counts)
are made on :attr:`Communicator.device`, the device its backend moves: CUDA for NCCL, CPU for gloo
and MPI.

With one rank every collective is a local no-op that sends and records nothing.
"""

from __future__ import annotations

import math
import pickle
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_commstrats.comm import wire
from lightning_commstrats.comm.stats import CommStats, CudaInterval

ReduceOpName = Literal["sum", "avg", "max", "min"]
REDUCE_OPS = ("sum", "avg", "max", "min")


class Communicator(ABC):
    """Collectives over ``world_size`` ranks with per-rank byte and time accounting.

    Args:
        rank: this process's rank in the communicator (0-based).
        world_size: number of ranks.
        stats: the statistics to charge (a subgroup shares its parent's); default: new ones.

    Attributes:
        device: where the communicator makes the tensors of its own messages (object
            collectives): a device its backend can move tensors from.
    """

    backend: str = "local"
    device: torch.device = torch.device("cpu")

    def __init__(self, rank: int, world_size: int, stats: CommStats | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank={rank}, {world_size=}")
        self.rank = rank
        self.world_size = world_size
        self.stats = CommStats() if stats is None else stats
        if not hasattr(self, "ranks"):  # a subclass that knows its channel's ranks sets them first
            self.ranks: tuple[int, ...] | None = tuple(range(world_size))
            """The run's ranks this channel joins, in its rank order (None: not known); a world's."""
        self.crosses: bool | None = None
        """Whether the channel joins ranks of different groups: None, from :attr:`ranks` and the
        statistics' groups; True for a channel between replicas."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, world_size={self.world_size})"

    # ------------------------------------------------------------------ public, accounted collectives

    def all_reduce(self, tensor: Tensor, op: ReduceOpName = "sum", *, tag: str = "grad") -> Tensor:
        """Reduce ``tensor`` over all ranks, in place; returns it. ``op="avg"`` divides the sum by N."""
        _check_op(op)
        if self.world_size == 1:
            return tensor
        _check_contiguous(tensor, "tensor")
        nbytes = wire.all_reduce_bytes(tensor.numel(), self._reduce_itemsize(tensor), self.world_size)
        self._timed(tag, nbytes, tensor, lambda: self._all_reduce(tensor, "sum" if op == "avg" else op))
        if op == "avg":
            tensor.div_(self.world_size)
        return tensor

    def reduce_scatter(self, tensor: Tensor, op: ReduceOpName = "sum", *, tag: str = "grad") -> Tensor:
        """Reduce a 1-D ``tensor`` of ``N * c`` elements over ranks; rank ``r`` gets chunk ``r`` (``c`` elements)."""
        _check_op(op)
        if tensor.dim() != 1 or tensor.numel() % self.world_size:
            raise ValueError(
                f"reduce_scatter needs a 1-D tensor whose length is divisible by world_size={self.world_size},"
                f" got shape {tuple(tensor.shape)}"
            )
        if self.world_size == 1:
            return tensor.clone()
        _check_contiguous(tensor, "tensor")
        out = tensor.new_empty(tensor.numel() // self.world_size)
        nbytes = wire.reduce_scatter_bytes(tensor.numel(), self._reduce_itemsize(tensor), self.world_size)
        self._timed(tag, nbytes, out, lambda: self._reduce_scatter(out, tensor, "sum" if op == "avg" else op))
        if op == "avg":
            out.div_(self.world_size)
        return out

    def all_gather(self, tensor: Tensor, *, tag: str = "grad") -> Tensor:
        """Gather equally shaped tensors from all ranks into a new tensor of shape ``(N, *tensor.shape)``."""
        if self.world_size == 1:
            return tensor.unsqueeze(0).clone()
        _check_contiguous(tensor, "tensor")
        out = tensor.new_empty((self.world_size, *tensor.shape))
        nbytes = wire.all_gather_bytes(tensor.numel(), tensor.element_size(), self.world_size)
        self._timed(tag, nbytes, out, lambda: self._all_gather(out, tensor))
        return out

    def all_gather_uneven(self, tensor: Tensor, *, tag: str = "grad") -> list[Tensor]:
        """Gather tensors whose first dimension differs between ranks; returns one tensor per rank.

        Two collectives: an all-gather of the lengths (8 bytes each), then an all-gather of the
        tensors padded to the longest (the padding travels and is counted).
        """
        if self.world_size == 1:
            return [tensor.clone()]
        lengths = self.all_gather(torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device), tag=tag)
        lengths_list = [int(n) for n in lengths.flatten().tolist()]
        longest = max(lengths_list)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = self.all_gather(padded, tag=tag)
        return [gathered[r, :n] for r, n in enumerate(lengths_list)]

    def all_to_all(
        self,
        tensor: Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int] | None = None,
        *,
        tag: str = "tokens",
    ) -> Tensor:
        """Exchange slices of ``tensor`` along dim 0: rows ``send_splits[j]`` go to rank ``j``.

        Returns the received rows concatenated in rank order. When ``recv_splits`` is not given it
        is learned first with an all-to-all of the counts (8 bytes per peer, counted under ``tag``).
        Splits may be uneven and zero.
        """
        send_splits = [int(s) for s in send_splits]
        if len(send_splits) != self.world_size or any(s < 0 for s in send_splits):
            raise ValueError(f"send_splits must be {self.world_size} non-negative counts, got {send_splits}")
        if sum(send_splits) != tensor.shape[0]:
            raise ValueError(f"send_splits sum to {sum(send_splits)} but tensor has {tensor.shape[0]} rows")
        if recv_splits is None:
            counts = torch.tensor(send_splits, dtype=torch.int64, device=tensor.device)
            recv_splits = self.all_to_all(counts, [1] * self.world_size, [1] * self.world_size, tag=tag).tolist()
        recv_splits = [int(s) for s in recv_splits]
        if len(recv_splits) != self.world_size or any(s < 0 for s in recv_splits):
            raise ValueError(f"recv_splits must be {self.world_size} non-negative counts, got {recv_splits}")
        if self.world_size == 1:
            return tensor.clone()
        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
        row = math.prod(tensor.shape[1:])
        nbytes = wire.all_to_all_bytes([s * row for s in send_splits], tensor.element_size(), self.rank)
        self._timed(tag, nbytes, out, lambda: self._all_to_all(out, tensor, recv_splits, send_splits))
        return out

    def broadcast(self, tensor: Tensor, src: int = 0, *, tag: str = "weights") -> Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s, in place; returns it."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be in [0, {self.world_size}), got {src}")
        if self.world_size == 1:
            return tensor
        _check_contiguous(tensor, "tensor")
        nbytes = wire.broadcast_bytes(tensor.numel(), tensor.element_size(), self.rank, src, self.world_size)
        self._timed(tag, nbytes, tensor, lambda: self._broadcast(tensor, src))
        return tensor

    def barrier(self) -> None:
        """Block until every rank has entered the barrier."""
        if self.world_size == 1:
            return
        self._timed("control", 0, None, self._barrier)

    def broadcast_object(self, obj: Any, src: int = 0, *, tag: str = "control") -> Any:
        """Send a picklable object from ``src`` to every rank (length, then payload)."""
        if self.world_size == 1:
            return obj
        payload = _to_bytes(obj, self.device) if self.rank == src else None
        size = payload.numel() if payload is not None else 0
        length = self.broadcast(torch.tensor([size], dtype=torch.int64, device=self.device), src, tag=tag)
        if payload is None:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(payload, src, tag=tag)
        return obj if self.rank == src else _from_bytes(payload)

    def all_gather_object(self, obj: Any, *, tag: str = "control") -> list[Any]:
        """Gather a picklable object from every rank; returns the list in rank order."""
        if self.world_size == 1:
            return [obj]
        return [_from_bytes(p) for p in self.all_gather_uneven(_to_bytes(obj, self.device), tag=tag)]

    def new_subgroups(self, groups: Sequence[Sequence[int]]) -> Communicator:
        """Split the ranks into ``groups`` (lists of ranks covering every rank once); every rank must
        call this with the same groups. Returns the communicator of this rank's group (ranks in
        ascending order), which charges the same :class:`CommStats`."""
        groups = [sorted(g) for g in groups]
        flat = sorted(r for g in groups for r in g)
        if flat != list(range(self.world_size)):
            raise ValueError(f"groups must cover ranks 0..{self.world_size - 1} once each, got {list(groups)}")
        mine = next(i for i, g in enumerate(groups) if self.rank in g)
        if len(groups) == 1:
            return self
        made = self._new_subgroups(groups, mine)
        made.ranks = None if self.ranks is None else tuple(self.ranks[r] for r in groups[mine])
        return made

    def _new_subgroups(self, groups: list[list[int]], mine: int) -> Communicator:
        raise NotImplementedError(f"{type(self).__name__} cannot make subgroups")

    def duplicate(self, *, host: bool = False) -> Communicator:
        """A communicator over the same ranks on a channel of its own, charging the same statistics.

        Collectives on it may run in another thread while this one is used (a background exchange
        never interleaves with the main thread's collectives). Every rank must call this, in the
        same order. ``host=True``: the channel moves host memory (a gloo group for
        torch.distributed; CUDA tensors are staged through host copies), so a thread using it never
        issues an NCCL collective beside the main thread's.
        """
        if self.world_size == 1:
            return self
        made = self._duplicate(host)
        made.ranks, made.crosses = self.ranks, self.crosses
        return made

    def _duplicate(self, host: bool) -> Communicator:
        raise NotImplementedError(f"{type(self).__name__} cannot make a second channel")

    def flag_channel(self) -> FlagChannel | None:
        """A channel of its own over the same ranks that ORs one flag per round without blocking
        the caller (:class:`FlagChannel`); ``None`` with one rank. Every rank must call this, in the
        same order, and then use the channel in lockstep."""
        if self.world_size == 1:
            return None
        made = self._flag_channel()
        made.crosses = self.crosses_groups
        return made

    def _flag_channel(self) -> FlagChannel:
        raise NotImplementedError(f"{type(self).__name__} has no flag channel")

    # ------------------------------------------------------------------ backend hooks

    def _reduce_itemsize(self, tensor: Tensor) -> int:
        """Bytes per element a reduction of ``tensor`` puts on the wire (a backend that stages a
        dtype in a wider one says so here, so that it is charged what it really sends)."""
        return tensor.element_size()

    @abstractmethod
    def _all_reduce(self, tensor: Tensor, op: str) -> None: ...

    @abstractmethod
    def _reduce_scatter(self, out: Tensor, tensor: Tensor, op: str) -> None: ...

    @abstractmethod
    def _all_gather(self, out: Tensor, tensor: Tensor) -> None: ...

    @abstractmethod
    def _all_to_all(self, out: Tensor, tensor: Tensor, recv_splits: list[int], send_splits: list[int]) -> None: ...

    @abstractmethod
    def _broadcast(self, tensor: Tensor, src: int) -> None: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    # ------------------------------------------------------------------ helpers

    def _timed(self, tag: str, nbytes: int, result: Tensor | None, fn: Callable[[], None]) -> None:
        start = time.perf_counter()
        # A collective on CUDA tensors returns to the host before it has run (the stream waits for
        # it): the host clock would time the launch. Two events on the stream time it on the device.
        on_device = CudaInterval(result.device) if result is not None and result.is_cuda else None
        try:
            fn()
        except Exception as err:  # a peer died or hung: say which, on this rank, and stop
            raise self.failure(f"a collective ({tag})", err, time.perf_counter() - start) from err
        seconds = on_device.stop() if on_device else time.perf_counter() - start
        self.stats.record(tag, nbytes, seconds, across=self.crosses_groups())

    def crosses_groups(self) -> bool:
        """Whether this channel's traffic goes between groups (sites) or replicas: the slow link."""
        return self.crosses if self.crosses is not None else self.stats.spans_groups(self.ranks)

    def failure(self, what: str, err: BaseException, seconds: float | None = None) -> CollectiveError:
        """The :class:`CollectiveError` to raise for ``err``, a failure of ``what`` on this rank (one
        of its own collectives, or one another library issued over these ranks, as FSDP2's), naming
        the peers that stopped where the backend can tell."""
        why = self._diagnose()
        after = f" after {seconds:.1f} s" if seconds is not None else ""
        return CollectiveError(
            f"rank {self.rank} of {self.world_size}: {what} failed{after}{': ' + why if why else ''}. {err}"
        )

    def _diagnose(self) -> str:
        """Why a collective may have failed (which peer stopped), where the backend can tell."""
        return ""


class FlagChannel(ABC):
    """An OR of one boolean over every rank, one round at a time, that never blocks its caller
    for long: :meth:`start` sends this rank's flag for the next round (one 4-byte all-reduce,
    charged under ``"control"``) and returns at once; :meth:`result` waits for the round and
    returns True when any rank's flag was set. Only the wait inside :meth:`result` is charged as
    seconds (the round overlaps whatever the caller did in between, which is not communication).
    Every rank starts and reads the same rounds in the same order, so every rank reads the same
    value for each round.

    It runs on a channel of its own (a gloo group on the CPU for torch.distributed, whatever the
    data's backend; a duplicate communicator for MPI): its rounds never interleave with the
    data's collectives, nor stall a CUDA stream.
    """

    def __init__(self, stats: CommStats, diagnose: Callable[[], str] | None = None) -> None:
        self.stats = stats
        self._diagnose = diagnose
        self._pending = False
        self.crosses: Callable[[], bool] = lambda: False
        """Whether its rounds go between groups: the communicator's answer (set where it is made)."""

    def start(self, flag: bool) -> None:
        if self._pending:
            raise RuntimeError("a flag round is already in flight; read its result first")
        self._start(int(bool(flag)))
        self._pending = True

    def result(self) -> bool:
        """The OR of the round in flight (False when none is): waits for it."""
        if not self._pending:
            return False
        self._pending = False
        waiting = time.perf_counter()
        try:
            value = self._wait()
        except Exception as err:  # a peer stopped: say which where the backend can tell
            why = self._diagnose() if self._diagnose is not None else ""
            raise CollectiveError(f"a flag round (control) failed{': ' + why if why else ''}. {err}") from err
        self.stats.record("control", 4, time.perf_counter() - waiting, across=self.crosses())
        return bool(value)

    @property
    def pending(self) -> bool:
        return self._pending

    def close(self) -> None:
        """Release the channel (no round may be in flight). Its group holds the rendezvous store: a
        channel kept past the end of its process group would keep that store, and the keys of its
        groups, alive into the next group made on the same address."""
        if self._pending:
            raise RuntimeError("a flag round is in flight; read its result before closing the channel")
        self._close()

    @abstractmethod
    def _close(self) -> None: ...

    @abstractmethod
    def _start(self, flag: int) -> None: ...

    @abstractmethod
    def _wait(self) -> int: ...


class CollectiveError(RuntimeError):
    """A collective failed on this rank: a peer stopped (killed, out of memory, exited on an error),
    hung past the timeout, or the network broke. The message names the peers that stopped when the
    backend can tell."""


# how a backend's own failure reads when it reaches us through another library's collective (FSDP2's)
_BACKEND_FAILURES = ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "ProcessGroup", "c10d")


def is_backend_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective's failure raised by the communication backend (a peer gone, a
    timeout), not an error of the code around it."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in _BACKEND_FAILURES)


class LocalCommunicator(Communicator):
    """The one-rank communicator: every collective is a local no-op and nothing is recorded."""

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=1)

    def _all_reduce(self, tensor: Tensor, op: str) -> None:  # pragma: no cover - unreachable with one rank
        raise AssertionError("unreachable")

    _reduce_scatter = _all_gather = _all_to_all = _broadcast = _barrier = _all_reduce  # type: ignore[assignment]


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")


def _check_contiguous(tensor: Tensor, name: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (collectives write in place)")


def _to_bytes(obj: Any, device: torch.device) -> Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(payload: Tensor) -> Any:
    return pickle.loads(payload.cpu().numpy().tobytes())
