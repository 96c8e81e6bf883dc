"""Fault-tolerant periodic training on torchft: replica groups that die, rejoin and heal while the run goes on.

A *replica* is one Lightning job of its own (one or more devices, its own process group for what
runs inside it every step, its own launcher). The replicas of a run find each other through a
torchft Lighthouse; the periodic schemes (``model_averaging``, ``bmuf``, ``diloco``,
``streaming_diloco``) exchange their pseudo-gradients across replicas over torchft's
reconfigurable process group, once per sync, with torchft's ``Manager`` deciding membership
(the quorum) and whether a sync counts (``should_commit``).

What this module holds (no Lightning here):

- :class:`FaultTolerance`: the user's settings (``fault_tolerance=`` of every periodic strategy,
  a dict or this object), checked at construction;
- :class:`ReplicaCommunicator`: the package's :class:`~lightning_commstrats.comm.Communicator` over
  torchft's process group of one quorum, so the fp32 average and the packed n-bit exchange run
  unchanged across replicas and every byte is charged to ``comm_stats``;
- :class:`ReplicaSync`: the replica's torchft ``Manager`` (held by the replica's rank 0, which
  speaks for its replica), its quorum, commit and healing;
- :func:`lighthouse_main`: the ``commstrats-lighthouse`` console command (torchft's Lighthouse).

How a sync goes (:meth:`PeriodicSyncStrategy <lightning_commstrats.strategies.periodic.PeriodicSyncStrategy>`
drives it):

1. quorum: the replicas alive now; the process group is reconfigured when membership changed.
   A replica whose committed step is behind the quorum's highest (a fresh replica, one restarted,
   one whose last sync failed) *heals*: it receives the shared state of a replica at the highest
   step (torchft picks the source by committed step, never by who answers first, so a replica
   restarted from a fresh initialisation never overwrites the others).
2. exchange: every replica's pseudo-gradient is averaged; a replica that has just healed sends
   zeros and is not counted, so the average divides by the replicas that trained the block.
3. commit: ``should_commit``. A replica that died during the exchange makes it fail on the
   survivors; they discard the result (their pseudo-gradient and residuals are restored), form a
   new quorum and run the exchange again: a partial average is never applied.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
from lightning_utilities.core.imports import RequirementCache
from torch import Tensor

from lightning_commstrats.comm.base import Communicator
from lightning_commstrats.comm.stats import CommStats
from lightning_commstrats.comm.torch_dist import staged_on
from lightning_commstrats.sharding.memory import tensors_in

log = logging.getLogger(__name__)

TORCHFT_AVAILABLE = RequirementCache("torchft")
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
QUORUM_TAG = "quorum"  # the statistics' tag of the waits for a quorum and a commit (no bytes)
PEER_TIMEOUT_MIN = 2.0  # seconds: four of the replica's heartbeats (every 0.5 s)
INSTALL_HINT = 'fault tolerance needs torchft: pip install "lightning-commstrats[ft]"'


def import_torchft() -> Any:
    """The ``torchft`` module, or ``ModuleNotFoundError`` with the install hint."""
    if not TORCHFT_AVAILABLE:
        raise ModuleNotFoundError(f"{INSTALL_HINT} ({TORCHFT_AVAILABLE.message})")
    import torchft

    return torchft


@dataclass
class FaultTolerance:
    """Fault-tolerance settings of a periodic scheme (``fault_tolerance=`` of ``model_averaging``,
    ``bmuf``, ``diloco``, ``streaming_diloco``, ``sparseloco``, :class:`~lightning_commstrats.PeriodicSyncStrategy`).

    Args:
        lighthouse: the Lighthouse's address, such as ``"http://host:29510"``
            (``commstrats-lighthouse --port 29510 --min-replicas K`` starts one); ``None`` reads
            torchft's ``TORCHFT_LIGHTHOUSE`` environment variable.
        replica_id: this replica's name, unique in the run (a restarted replica takes its old
            name again). It also seeds the replica's data order, so that replicas do not train on
            the same batches in the same order.
        min_replicas: the fewest replicas a sync may average over. With fewer alive, the replica
            waits for others to join, at most ``quorum_timeout`` seconds, then fails saying so.
            The Lighthouse's own ``--min-replicas`` should be the same.
        quorum_timeout: seconds a sync waits for a quorum (the other replicas reach their sync
            point, or new ones join); the longest block of local steps between syncs must fit
            in it, or a replica that is merely slower makes the others fail.
        timeout: seconds a cross-replica collective may take before it counts as failed (and the
            checkpoint transfer of a heal). Must exceed the time of an exchange on the slowest link.
        connect_timeout: seconds to reach the Lighthouse and the other replicas' managers.
        max_sync_attempts: how many times one sync is tried (a new quorum each time) before the
            replica gives up with an error.
        quorum_renew_interval: seconds after which a replica still waiting for a quorum renews its
            request. The Lighthouse counts its join timeout from the oldest pending request; a
            request pending since long before the others arrive (a replica that restarted, or
            missed the last quorum) would make the next quorum form at a bare majority without
            waiting for the slowest live replica, which then misses it too, round after round.
            Keep it below the Lighthouse's ``--join-timeout-ms``.
        hostname: the name other replicas reach this one at (default: this machine's host name).
        peer_timeout: seconds a rank of this replica may go without a heartbeat before its other
            ranks take it for stopped and the replica leaves the run (to be restarted as a whole).
            The beats come from a Python thread every 0.5 s: a rank whose process holds the GIL
            longer than this (a long call into an extension that does not release it) counts as
            stopped. A dead rank is mostly seen sooner (its peers' collectives with it fail, or its
            rendezvous store is gone); this bounds the case where nothing else tells.
        store_bind: the address the replica's rendezvous store (hosted by its rank 0; the replicas of
            a quorum rendezvous their process group through one replica's) listens at. ``None``
            (default): the address ``hostname`` resolves to, so the store is reachable exactly where
            the replica says it is (on a machine whose host name maps to loopback, this machine
            only); ``"0.0.0.0"`` (every IPv4 interface) or ``"::"`` (every interface) where that
            address is not one of this machine's (a container behind a mapped port). torchft's own
            Manager server and checkpoint server listen on every interface whatever this says.
        run_store: ``"host:port"`` of the run's store, where the replicas that finish the run say
            so, and a replica that starts after the run ended learns it at once and exits saying
            why (instead of waiting ``quorum_timeout`` for replicas that are gone).
            ``commstrats-lighthouse`` serves one at its port + 1 and prints it; ``None`` (default):
            the Lighthouse's host at its port + 1, when a store answers there.
    """

    lighthouse: str | None = None
    replica_id: str = ""
    min_replicas: int = 1
    quorum_timeout: float = 300.0
    timeout: float = 60.0
    connect_timeout: float = 10.0
    max_sync_attempts: int = 10
    quorum_renew_interval: float = 2.0
    hostname: str | None = None
    run_store: str | None = None
    store_bind: str | None = None
    peer_timeout: float = 15.0

    def __post_init__(self) -> None:
        if self.lighthouse is None:
            self.lighthouse = os.environ.get(LIGHTHOUSE_ENV) or None
        if not self.lighthouse:
            raise ValueError(
                f"fault_tolerance.lighthouse is not set and {LIGHTHOUSE_ENV} is empty: give the Lighthouse's"
                " address, such as 'http://host:29510' (start one with `commstrats-lighthouse --port 29510`)"
            )
        parsed = urlparse(self.lighthouse if "://" in self.lighthouse else f"http://{self.lighthouse}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
            raise ValueError(
                f"fault_tolerance.lighthouse={self.lighthouse!r} is not an address such as 'http://host:29510'"
            )
        self.lighthouse = f"{parsed.scheme}://{parsed.hostname}:{parsed.port}"
        if not isinstance(self.replica_id, str) or not self.replica_id or ":" in self.replica_id:
            raise ValueError(
                f"fault_tolerance.replica_id must be a non-empty name without ':', unique in the run,"
                f" got {self.replica_id!r}"
            )
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"fault_tolerance.min_replicas must be an int >= 1, got {self.min_replicas!r}")
        for name in ("quorum_timeout", "timeout", "connect_timeout", "quorum_renew_interval", "peer_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"fault_tolerance.{name} must be a number of seconds > 0, got {value!r}")
        if self.peer_timeout < PEER_TIMEOUT_MIN:
            raise ValueError(
                f"fault_tolerance.peer_timeout must be >= {PEER_TIMEOUT_MIN} s (a few of the ranks' 0.5 s heartbeats),"
                f" got {self.peer_timeout!r}"
            )
        if self.timeout >= self.quorum_timeout:
            # a quorum that gave up before a slow collective on the others could end would split the run
            raise ValueError(
                f"fault_tolerance.timeout={self.timeout} must be < quorum_timeout={self.quorum_timeout}"
                " (the timeouts nest: a collective ends before a quorum gives up)"
            )
        if self.run_store is not None:
            host, _, port = str(self.run_store).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"fault_tolerance.run_store={self.run_store!r} is not an address such as 'host:29511'")
        if self.store_bind is not None:
            try:
                bind_host(str(self.store_bind))
            except ValueError as err:
                raise ValueError(f"fault_tolerance.store_bind={self.store_bind!r}: {err}") from None
        attempts = self.max_sync_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"fault_tolerance.max_sync_attempts must be an int >= 1, got {attempts!r}")

    @classmethod
    def of(cls, value: FaultTolerance | Mapping[str, Any] | None) -> FaultTolerance | None:
        """``value`` as settings: ``None``, an instance, or a dict of its fields (unknown keys are an error)."""
        if value is None or isinstance(value, FaultTolerance):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"fault_tolerance must be a dict, a FaultTolerance or None, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"fault_tolerance got unknown setting(s) {unknown}; it takes {sorted(known)}")
        return cls(**value)

    def data_seed(self, joined_at: int = 0) -> int:
        """A seed for this replica's data order, derived from its name and, for a replica that joined a
        running run, the committed step it joined at (a fresh order for each of its lives)."""
        key = self.replica_id if joined_at <= 1 else f"{self.replica_id}@{joined_at}"
        return zlib.crc32(key.encode()) & 0x7FFFFFFF


def check_lighthouse(config: FaultTolerance) -> None:
    """Raise ``ConnectionError`` naming the setting when the Lighthouse cannot be reached within
    ``connect_timeout`` (instead of a quorum that waits for ever)."""
    parsed = urlparse(config.lighthouse)
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=config.connect_timeout):
            pass
    except OSError as err:
        raise ConnectionError(
            f"fault_tolerance.lighthouse={config.lighthouse!r} cannot be reached within connect_timeout="
            f"{config.connect_timeout} s ({err}); start it with `commstrats-lighthouse --port {parsed.port}`"
            " (with --bind <an address of its machine> for replicas on other machines: by default it listens"
            " on the loopback interface only)"
        ) from err


class _NoFlightRecorderNote(logging.Filter):
    """Drops torchft's warning that NCCL's flight recorder cannot be reset: it comes at every quorum
    from a torch build without NCCL (a CPU build), where replicas exchange over gloo and there is
    no NCCL trace to keep right."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


def _quiet_flight_recorder() -> None:
    manager_log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NoFlightRecorderNote) for f in manager_log.filters):
        manager_log.addFilter(_NoFlightRecorderNote())


class ReplicaCommunicator(Communicator):
    """The collectives of one quorum, over torchft's reconfigurable process group (one member per
    replica). Made anew for every quorum (its rank and size are the quorum's); charges the
    replica's :class:`CommStats`. A failed collective raises
    :class:`~lightning_commstrats.comm.CollectiveError`, which the sync turns into a failed commit."""

    backend = "torchft"

    def __init__(self, pg: Any, rank: int, world_size: int, stats: CommStats, device: torch.device) -> None:
        self.pg = pg
        self.device = device
        super().__init__(rank=rank, world_size=world_size, stats=stats)
        self.ranks, self.crosses = None, True  # between replicas: the slow link

    def _all_reduce(self, tensor: Tensor, op: str) -> None:
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}[op]
        with staged_on(self.device, tensor) as t:
            self.pg.allreduce([t], opts).wait()

    def _reduce_scatter(self, out: Tensor, tensor: Tensor, op: str) -> None:
        # gloo has no reduce-scatter: nothing in the cross-replica exchange needs one
        raise NotImplementedError("the cross-replica communicator has no reduce_scatter")

    def _all_gather(self, out: Tensor, tensor: Tensor) -> None:
        from torch.distributed.distributed_c10d import AllgatherOptions

        with staged_on(self.device, out, fill=False) as o, staged_on(self.device, tensor, writeback=False) as t:
            self.pg.allgather([list(o.unbind(0))], [t], AllgatherOptions()).wait()

    def _all_to_all(self, out: Tensor, tensor: Tensor, recv_splits: list[int], send_splits: list[int]) -> None:
        from torch.distributed.distributed_c10d import AllToAllOptions

        with staged_on(self.device, out, fill=False) as o, staged_on(self.device, tensor, writeback=False) as t:
            self.pg.alltoall_base(o, t, recv_splits, send_splits, AllToAllOptions()).wait()

    def _broadcast(self, tensor: Tensor, src: int) -> None:
        from torch.distributed.distributed_c10d import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = src
        with staged_on(self.device, tensor) as t:
            self.pg.broadcast([t], opts).wait()

    def _barrier(self) -> None:
        one = torch.zeros(1, device=self.device)
        self._all_reduce(one, "sum")


@dataclass
class Quorum:
    """What one quorum gave this replica."""

    comm: ReplicaCommunicator
    step: int  # this replica's committed step after the quorum (the source's when it healed)
    healed: dict[str, Any] | None  # the shared state received from a live peer, when this replica healed


@dataclass
class ReplicaSummary:
    """What one replica went through in a fit, as its rank saw it: the waits for quorums and commits,
    the heals it received, the syncs that did not count, and the replicas it saw leave and join
    (from the size of one quorum to the next). The fault-tolerance line at the end of fit and the
    saved statistics read it (:meth:`line`, :meth:`as_dict`)."""

    quorums: int = 0
    quorum_seconds: float = 0.0
    longest_quorum_seconds: float = 0.0
    commit_seconds: float = 0.0
    heals: int = 0
    heal_bytes: int = 0
    heal_seconds: float = 0.0  # the quorums that brought a heal, its transfer included
    models_taken: int = 0  # quorums whose replicas held different models: this one took another's
    syncs_failed: int = 0
    replicas_left: int = 0
    replicas_joined: int = 0
    smallest_quorum: int | None = None
    largest_quorum: int | None = None
    _last_size: int | None = None

    def on_quorum(self, seconds: float, size: int, healed: dict[str, Any] | None) -> None:
        self.quorums += 1
        self.quorum_seconds += seconds
        self.longest_quorum_seconds = max(self.longest_quorum_seconds, seconds)
        if healed is not None:
            self.heals += 1
            self.heal_bytes += sum(t.numel() * t.element_size() for t in tensors_in(healed))
            self.heal_seconds += seconds
        if self._last_size is not None:
            self.replicas_left += max(self._last_size - size, 0)
            self.replicas_joined += max(size - self._last_size, 0)
        self._last_size = size
        self.smallest_quorum = size if self.smallest_quorum is None else min(self.smallest_quorum, size)
        self.largest_quorum = size if self.largest_quorum is None else max(self.largest_quorum, size)

    def on_commit(self, seconds: float, counted: bool) -> None:
        self.commit_seconds += seconds
        self.syncs_failed += not counted

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def line(self, replica_id: str) -> str:
        """``[ft] replica 'a': 12 quorums (waited 3.1 s, longest 2.0 s; commits 0.4 s); healed 1 time (4.2 MB
        in 0.9 s); 0 syncs failed; replicas seen leaving 1, joining 1 (quorums of 2-3)``."""
        sizes = (
            ""
            if self.smallest_quorum is None
            else f" (quorums of {self.smallest_quorum}"
            + (f"-{self.largest_quorum})" if self.largest_quorum != self.smallest_quorum else ")")
        )
        heals = (
            f"healed {self.heals} time{'s' if self.heals != 1 else ''} ({self.heal_bytes / 1e6:.1f} MB in"
            f" {self.heal_seconds:.1f} s)"
            if self.heals
            else "no heal"
        )
        taken = f", took another replica's model {self.models_taken}x" if self.models_taken else ""
        return (
            f"[ft] replica {replica_id!r}: {self.quorums} quorums (waited {self.quorum_seconds:.1f} s, longest"
            f" {self.longest_quorum_seconds:.1f} s; commits {self.commit_seconds:.1f} s); {heals}{taken};"
            f" {self.syncs_failed} sync{'s' if self.syncs_failed != 1 else ''} failed; replicas seen leaving"
            f" {self.replicas_left}, joining {self.replicas_joined}{sizes}"
        )


class ReplicaSync:
    """One rank's torchft ``Manager`` and its process group across replicas (rank ``i`` of every replica).

    Every rank of a replica holds one (:class:`~lightning_commstrats.replicas.ReplicaGroup` makes
    them); the replica's rank 0 hosts the Manager server that speaks to the Lighthouse for the whole
    replica, so that a quorum and a commit are decided for all its ranks together.

    Args:
        config: the settings.
        device: the device the exchange's tensors live on (NCCL across replicas on CUDA, gloo on CPU).
        state_dict: returns the shared state a healing peer receives (called by torchft in its
            quorum thread: return a snapshot, or tensors nobody changes until the sync commits).
        stats: the statistics the cross-replica collectives charge.
        host: exchange through host memory (torchft's gloo group, CUDA tensors staged through
            host copies) also on CUDA: for an exchange issued from a background thread.
        rank: this rank in its replica. world_size: the replica's ranks.
        store: ``(host, port)`` of the replica's rendezvous store (made by its rank 0).

    Attributes:
        on_wait: called between two attempts while this replica waits for a quorum; raises to stop
            waiting (the strategy's: a SIGTERM noted meanwhile stops the replica within one renewal).
    """

    on_wait: Callable[[], None] | None = None
    _told_waiting = False  # the replica said once why it waits
    summary: ReplicaSummary | None = None  # what the replica went through (made in __init__)

    def __init__(
        self,
        config: FaultTolerance,
        device: torch.device,
        state_dict: Callable[[], dict[str, Any]],
        stats: CommStats,
        *,
        host: bool = False,
        rank: int = 0,
        world_size: int = 1,
        store: tuple[str, int],
    ) -> None:
        torchft = import_torchft()
        check_lighthouse(config)
        self.config = config
        self.device = device
        self.host = host or device.type != "cuda"
        self.stats = stats
        self.summary = ReplicaSummary()  # the replica group hands its own over, kept across joins
        self._received: dict[str, Any] | None = None
        self.closed = False
        self.run_store = RunStore.connect(config)
        self.check_ended()
        if self.run_store is not None:  # the same size as the run's other replicas, before any quorum
            ranks = self.run_store.claim_ranks(world_size)
            if ranks != world_size:
                raise ReplicaMismatch(mismatch_message(config.replica_id, world_size, ranks))
        # A renewal cancels the pending request: one that falls when the Lighthouse's join timeout
        # elapses cancels the very quorum it waited for, round after round (measured: a run stalled
        # for 2 minutes with both at 2 s). At most 0.4 join timeouts when the run's store says it.
        join_ms = None if self.run_store is None else self.run_store.join_timeout_ms()
        self.renew_interval = paced_renewal(config.quorum_renew_interval, join_ms)
        timeout = timedelta(seconds=config.timeout)
        # NCCL on CUDA, unless the exchange runs in a background thread (``host``): then gloo, the
        # tensors staged through host memory, so that thread never issues an NCCL collective beside
        # the replica's own (its per-step gradient all-reduce)
        pg_class = torchft.ProcessGroupGloo if self.host else torchft.ProcessGroupNCCL
        self.pg = pg_class(timeout=timeout)
        if self.host:  # no NCCL here: torchft's note about NCCL's flight recorder (every quorum) says nothing
            _quiet_flight_recorder()
        hostname = config.hostname or socket.gethostname()
        self.manager = torchft.Manager(
            checkpoint_transport=_advertised_http_transport(hostname, timeout),
            pg=self.pg,
            load_state_dict=self._receive,
            state_dict=state_dict,
            min_replica_size=config.min_replicas,
            use_async_quorum=False,  # a quorum per sync, healed before the exchange
            # no heal at step 0: the first quorum agrees on one replica's model by a broadcast
            # (torchft's step-0 heal is not served by its source)
            init_sync=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout),
            connect_timeout=timedelta(seconds=config.connect_timeout),
            rank=rank,
            world_size=world_size,
            store_addr=store[0],
            store_port=store[1],
            lighthouse_addr=config.lighthouse,
            replica_id=config.replica_id,
            hostname=hostname,
        )

    def check_ended(self) -> None:
        """Raise :class:`RunEnded` when the run's store says the run is over."""
        ended = None if self.run_store is None else self.run_store.ended()
        if ended is not None:
            raise RunEnded(
                f"replica {self.config.replica_id!r} has nothing to join: the run has ended ({ended}). Its final"
                f" model is what the replicas that finished it saved. The Lighthouse at {self.config.lighthouse}"
                " remembers the end for as long as it runs (in its run store): to start another run, or to train"
                " this one further from their checkpoints, start a fresh Lighthouse (`commstrats-lighthouse`) and"
                " the replicas against it"
            )

    def _receive(self, state: dict[str, Any]) -> None:  # torchft's load_state_dict callback: adopted later
        self._received = state

    @property
    def step(self) -> int:
        """This replica's committed step (syncs that committed, plus the run's first agreement)."""
        return self.manager.current_step()

    @property
    def batches_committed(self) -> int:
        """Replicas times syncs that committed over the run's history this replica holds."""
        return int(self.manager.batches_committed())

    def quorum(self) -> Quorum:
        """Join the next quorum; waits for ``min_replicas`` replicas at most ``quorum_timeout`` seconds.
        The wait is charged to the statistics (tag ``"quorum"``): the loop's waiting when a blocking sync
        waits, background seconds in an exchange's thread."""
        began = time.perf_counter()
        quorum = None
        try:
            quorum = self._quorum()
            return quorum
        finally:
            seconds = time.perf_counter() - began
            self.stats.record_wait(QUORUM_TAG, seconds, background=None)
            if quorum is not None and self.summary is not None:
                self.summary.on_quorum(seconds, quorum.comm.world_size, quorum.healed)

    def _quorum(self) -> Quorum:
        config = self.config
        deadline = time.monotonic() + config.quorum_timeout
        # a heal received by an attempt that is then retried (too few replicas) still counts: torchft
        # has moved this replica's step on and will not send it again
        self._received = None
        waited = False
        while True:
            if self.closed:
                raise RuntimeError(f"replica {config.replica_id!r} has left the run (its Manager is shut down)")
            self.check_ended()  # every renewal: a replica that came back after the end learns it in seconds
            if waited:
                self._waiting(deadline)
            waited = True
            began = time.monotonic()
            renew = max(min(self.renew_interval, deadline - began), 0.1)
            try:
                self.manager.start_quorum(timeout=timedelta(seconds=renew))
            except Exception as err:
                # No quorum yet (or the Lighthouse is away): renew the request, so that the Lighthouse's
                # join timeout counts from now (see quorum_renew_interval). torchft keeps the failed
                # request's future and re-raises its error at the next start: drop it.
                self.manager._quorum_future = None
                # a request that failed at once (the Lighthouse or the Manager server is gone) is
                # renewed at the same pace as one that waited, not in a busy loop
                time.sleep(max(0.0, min(renew - (time.monotonic() - began), deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"no quorum of fault_tolerance.min_replicas={config.min_replicas} replica(s) formed at"
                        f" {config.lighthouse} within quorum_timeout={config.quorum_timeout} s ({err})"
                    ) from err
                continue
            n = self.manager.num_participants()
            if n >= config.min_replicas and self.manager.errored() is None:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"only {n} replica(s) alive, fewer than fault_tolerance.min_replicas={config.min_replicas},"
                    f" for quorum_timeout={config.quorum_timeout} s (Lighthouse {config.lighthouse})"
                )
            time.sleep(min(1.0, config.quorum_timeout / 10))
        rank = self.manager.participating_rank()
        assert rank is not None
        comm = ReplicaCommunicator(self.pg, rank, n, self.stats, torch.device("cpu") if self.host else self.device)
        return Quorum(comm=comm, step=self.step, healed=self._received)

    def _waiting(self, deadline: float) -> None:
        """Between two attempts at a quorum: say once why this replica waits (torchft logs a failed
        attempt at every renewal), and let :attr:`on_wait` stop the wait (a SIGTERM meanwhile)."""
        if not self._told_waiting:
            self._told_waiting = True
            log.warning(
                "replica %r is waiting for a quorum of fault_tolerance.min_replicas=%d replica(s) at %s, for at most"
                " %.0f s more; torchft logs 'lighthouse quorum failed' at every renewal (every %.1f s) while it"
                " waits, which is expected",
                self.config.replica_id,
                self.config.min_replicas,
                self.config.lighthouse,
                max(deadline - time.monotonic(), 0.0),
                self.renew_interval,
            )
        if self.on_wait is not None:
            self.on_wait()

    def commit(self, ok: bool, error: BaseException | None = None) -> bool:
        """Whether the sync counts: ``False`` when this replica's exchange failed (``ok`` false), the
        process group reported an error, or fewer than ``min_replicas`` took part."""
        if not ok:
            self.manager.report_error(error if isinstance(error, Exception) else RuntimeError("exchange failed"))
        began = time.perf_counter()  # every rank of every replica votes: the slowest's lateness is waited for here
        counted = False
        try:
            counted = bool(self.manager.should_commit(timeout=timedelta(seconds=self.config.timeout)))
            return counted
        finally:
            seconds = time.perf_counter() - began
            self.stats.record_wait(QUORUM_TAG, seconds, background=None)
            if self.summary is not None:
                self.summary.on_commit(seconds, counted)

    def shutdown(self) -> None:
        """Leave the run (idempotent; safe from another thread: a call waiting in the Manager fails)."""
        if not self.closed:
            self.closed = True
            self.manager.shutdown(wait=False)


def _advertised_http_transport(hostname: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (a healing replica fetches the shared state from it),
    advertised at ``hostname``: torchft's own uses this machine's host name, which on a host with
    several network namespaces (or an /etc/hosts that maps it to loopback) other replicas cannot reach."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{hostname}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


RENEW_SHARE = 0.4  # of the Lighthouse's join timeout: the default 2 s of the default 5000 ms


def paced_renewal(interval: float, join_timeout_ms: int | None) -> float:
    """The seconds between quorum renewals: ``interval``, kept at or below 0.4 of the Lighthouse's join
    timeout when it is known. A renewal cancels the pending request, and one that falls when the
    join timeout elapses (``interval`` equal to it, or a whole fraction of it) can cancel the very
    quorum it waited for, on every attempt."""
    limit = None if join_timeout_ms is None else RENEW_SHARE * join_timeout_ms / 1000
    if limit is None or interval <= limit:
        return interval
    log.warning(
        "fault_tolerance.quorum_renew_interval=%s s is above %.1f of the Lighthouse's join timeout (%d ms):"
        " renewing every %.2f s instead",
        interval,
        RENEW_SHARE,
        join_timeout_ms,
        limit,
    )
    return limit


class ReplicaMismatch(ValueError):
    """The replicas of a run cannot exchange: they have different numbers of ranks, or other layouts."""


def mismatch_message(replica_id: str, mine: int, theirs: Any) -> str:
    return (
        f"replica {replica_id!r} has {mine} ranks and the run's replicas have {theirs}: every replica of a run must"
        " have the same number of ranks (rank i of each exchanges the same part of the model)"
    )


def layout_mismatch_message(replica_id: str, mine: str, theirs: str) -> str:
    if mine == theirs:  # the same sharding, other tensors per rank
        return (
            f"replica {replica_id!r} ({mine}) exchanges other tensors than the run's replicas ({theirs}, the same"
            " layout): another model, or another num_fragments; every replica of a run must train the same model"
            " with the same settings"
        )
    return (
        f"replica {replica_id!r} has the layout '{mine}' and the run's replicas have '{theirs}': every replica of a"
        " run must have the same layout (the same number of ranks, sharded alike: rank i of each exchanges the same"
        " part of the model); start this replica with the run's shard and group_size"
    )


class RunEnded(RuntimeError):
    """The run this replica would join has ended (its other replicas finished it)."""


class RunStore:
    """The run's small key-value store (served by ``commstrats-lighthouse``): the replicas that finish
    the run write where it ended; a replica that (re)starts reads it before waiting for a quorum.

    ``connect`` returns ``None`` when no store answers (a Lighthouse started otherwise): a replica
    that comes back after the run ended then waits ``quorum_timeout`` and fails, as before."""

    KEY = "commstrats/run/ended"
    JOIN_TIMEOUT_KEY = "commstrats/run/join_timeout_ms"
    RANKS_KEY = "commstrats/run/ranks_per_replica"
    LAYOUT_KEY = "commstrats/run/replica_layout"

    def __init__(self, store: Any) -> None:
        self.store = store

    @classmethod
    def connect(cls, config: FaultTolerance) -> RunStore | None:
        from torch.distributed import TCPStore

        if config.run_store is not None:
            host, _, port = config.run_store.rpartition(":")
            address = (host, int(port))
        else:
            parsed = urlparse(config.lighthouse)
            assert parsed.hostname is not None and parsed.port is not None
            address = (parsed.hostname, parsed.port + 1)
        try:
            with socket.create_connection(address, timeout=min(config.connect_timeout, 2.0)):
                pass
            store = TCPStore(
                address[0],
                address[1],
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=min(config.connect_timeout, 5.0)),
            )
            store.check([cls.KEY])  # a TCPStore answers; anything else fails here
        except Exception as err:  # no store there: the run goes on without one
            level = logging.WARNING if config.run_store is not None else logging.INFO
            log.log(
                level,
                "no run store at %s:%d (%s): a replica started after the run ended waits quorum_timeout",
                address[0],
                address[1],
                err,
            )
            return None
        return cls(store)

    def ended(self) -> str | None:
        """What the replicas that finished the run wrote (``None`` while it goes on)."""
        try:
            if self.store.check([self.KEY]):
                return self.store.get(self.KEY).decode()
        except Exception:  # the store went away: no answer, the quorum decides
            return None
        return None

    def claim_ranks(self, ranks: int) -> int:
        """The run's number of ranks per replica: the first replica to join sets it to ``ranks``."""
        return int(self.store.compare_set(self.RANKS_KEY, "", str(ranks)).decode())

    def claim_layout(self, layout: str) -> str:
        """The run's replica layout (:meth:`ReplicaGroup.layout
        <lightning_commstrats.replicas.ReplicaGroup.layout>`): the first replica to join sets it to
        ``layout``."""
        return self.store.compare_set(self.LAYOUT_KEY, "", layout).decode()

    def join_timeout_ms(self) -> int | None:
        """The Lighthouse's ``--join-timeout-ms`` (``None`` when the store does not say)."""
        try:
            if self.store.check([self.JOIN_TIMEOUT_KEY]):
                return int(self.store.get(self.JOIN_TIMEOUT_KEY).decode())
        except Exception:
            return None
        return None

    def mark_ended(self, what: str) -> None:
        try:
            self.store.set(self.KEY, what)
        except Exception as err:
            log.warning("could not record the end of the run in the run store: %s", err)


def run_attempts(
    attempts: int, attempt: Callable[[int], bool], what: str, on_failure: Callable[[], None] | None = None
) -> None:
    """Call ``attempt(i)`` until it returns True, at most ``attempts`` times; ``on_failure`` after each
    failed one. Raises ``RuntimeError`` naming ``what`` when none succeeded."""
    for i in range(attempts):
        if attempt(i):
            return
        if on_failure is not None:
            on_failure()
    raise RuntimeError(
        f"{what} failed {attempts} times in a row (fault_tolerance.max_sync_attempts={attempts}); see the"
        " torchft log lines above for why each attempt did not commit"
    )


LIGHTHOUSE_BIND = "127.0.0.1"
"""Where ``commstrats-lighthouse`` listens by default: the loopback interface, which replicas on the
same machine reach and nothing else does. Anyone who reaches the Lighthouse can join the run as a
replica, or end it (the run store takes any writer); listening on a network is a choice to make with
``--bind``, for replicas on several machines, not a default."""


def lighthouse_parser() -> argparse.ArgumentParser:
    """The command line of ``commstrats-lighthouse``."""
    parser = argparse.ArgumentParser(
        prog="commstrats-lighthouse",
        description="Start the torchft Lighthouse that forms the quorums of a fault-tolerant periodic run,"
        " and the run's store (at its port + 1).",
    )
    parser.add_argument("--port", type=int, default=29510, help="port to listen on (0: any free port)")
    parser.add_argument(
        "--bind",
        default=LIGHTHOUSE_BIND,
        metavar="ADDRESS",
        help=f"address to listen on, for the Lighthouse and the run store (default {LIGHTHOUSE_BIND}: this"
        " machine only). Replicas on other machines need an address they reach: this machine's address"
        " on their network, or 0.0.0.0 (every IPv4 interface) or :: (every interface)",
    )
    parser.add_argument("--min-replicas", type=int, default=1, help="fewest replicas a quorum may have")
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=5000,
        # above FaultTolerance.quorum_renew_interval (2 s by default), which a waiting replica renews
        # its request at: the join timeout counts from the oldest pending request
        help="how long a quorum waits for more replicas once min-replicas have joined, ms (default 5000)",
    )
    parser.add_argument(
        "--store-port", type=int, default=None, help="port of the run's store (default: the Lighthouse's port + 1)"
    )
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="how often quorums are computed, ms")
    parser.add_argument(
        "--heartbeat-timeout-ms", type=int, default=5000, help="a replica silent this long counts as dead, ms"
    )
    return parser


EVERY_INTERFACE = ("0.0.0.0", "::")


def bind_host(value: str) -> str:
    """``--bind`` as a host: brackets of an IPv6 address dropped (``[::]`` is ``::``); ``ValueError``
    for an empty value or one with a port (the port is ``--port``)."""
    host = value.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif host.count(":") == 1:
        raise ValueError("give the address without a port (the port is --port)")
    if not host:
        raise ValueError("give an address, such as 127.0.0.1, 0.0.0.0 or this machine's address")
    return host


def _with_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening at ``host:port`` (``::`` takes IPv4 too); the run store serves on it, so
    that the store listens where the Lighthouse does."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    dual = family == socket.AF_INET6 and host == "::" and socket.has_dualstack_ipv6()
    return socket.create_server((host, port), family=family, dualstack_ipv6=dual)


def lighthouse_main(argv: list[str] | None = None) -> int:
    """``commstrats-lighthouse --port P --min-replicas K [--bind ADDRESS]``: run torchft's Lighthouse,
    and the run store at port P + 1, both listening at ``--bind`` (default :data:`LIGHTHOUSE_BIND`),
    until interrupted (Ctrl-C or SIGTERM: it then stops and exits with status 0)."""
    parser = lighthouse_parser()
    args = parser.parse_args(argv)
    if args.min_replicas < 1:
        parser.error(f"--min-replicas must be >= 1, got {args.min_replicas}")
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    try:
        host = bind_host(args.bind)
        socket.getaddrinfo(host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (ValueError, OSError) as err:
        parser.error(f"--bind {args.bind!r}: {err}")
    import_torchft()
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=_with_port(host, args.port),
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    port = int(server.address().rsplit(":", 1)[1])
    # the run's store (RunStore): where the replicas that finish the run say so. TCPStore listens on
    # every interface unless it is handed a socket, so it gets one listening where the Lighthouse does.
    # The socket is kept open for as long as the store serves on it.
    listener = listen_socket(host, args.store_port if args.store_port is not None else port + 1)
    store = TCPStore(
        "127.0.0.1" if host in EVERY_INTERFACE else host,  # where this process reaches its own store
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    store.set(RunStore.JOIN_TIMEOUT_KEY, str(args.join_timeout_ms))  # the replicas pace their renewals by it
    # torchft prints this machine's name, which replicas elsewhere may reach on the wrong interface
    address = server.address() if host in EVERY_INTERFACE else f"http://{_with_port(host, port)}"
    if threading.current_thread() is threading.main_thread():  # Python handles signals there only
        # SIGTERM (`kill PID`, a scheduler ending the job) stops it as Ctrl-C does; set before the
        # address is printed, which is when anyone can know whom to signal
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        print(
            f"commstrats-lighthouse: listening at {address} (min replicas {args.min_replicas});"
            f" run store at port {store.port}",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        listener.close()
    return 0
