"""The replicas of a fault-tolerant periodic run, as a component the periodic strategy holds.

A *replica* is one Lightning job of ``S`` ranks. Every rank of it runs a torchft ``Manager``
(:class:`~lightning_commstrats.fault_tolerance.ReplicaSync`): the replica's rank 0 hosts the
Manager server that speaks to the Lighthouse for the whole replica, and torchft makes the quorum
and the commit decisions of all ``S`` ranks together (a quorum forms once every rank asked; a sync
commits only if every rank's part of it succeeded). Rank ``i`` of every replica shares a process
group of its own across replicas, so that all ``S`` links of a replica carry the exchange:

- with ``shard="fsdp"`` rank ``i`` holds the ``i``-th FSDP2 shard of the model and exchanges that;
- unsharded, every rank of the replica holds the same pseudo-gradient (gradients are averaged
  inside the replica at every step); rank ``i`` exchanges its ``1/S`` slice of it (whole
  parameter tensors, cut into ``S`` runs of about equal size) and the slices are gathered inside
  the replica afterwards. The bytes per link fall by ``S``.

A healing rank receives its state from the same rank of a replica at the highest committed step
(torchft chooses the source), so a sharded replica heals shard by shard. torchft offsets each rank's
source by the rank, so the ranks of one replica can heal from different replicas; where those hold
different models (the case :meth:`~ReplicaGroup.reconcile` exists for), the replica holds a mix of
them until the quorum's reconcile gives it one replica's state, rank by rank (a replica that holds
a mix is never the model the others copy).

A rank that dies takes its replica out of the run within seconds: the replica's other ranks watch
its heartbeat (:class:`PeerWatch`), stop their Managers (rank 0's stops answering the Lighthouse)
and raise at their next step across replicas; the replica is restarted as a whole and heals.

The interface (:class:`ReplicaGroup`): :meth:`~ReplicaGroup.join`, :meth:`~ReplicaGroup.first_quorum`,
:meth:`~ReplicaGroup.average`, the heal state out (:meth:`~ReplicaGroup.offer`, read by torchft) and
in (the ``healed`` state the strategy adopts), :meth:`~ReplicaGroup.state_dict` for checkpoints,
and :meth:`~ReplicaGroup.leave`. What it needs of the strategy is :class:`ReplicaHost`.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed import TCPStore

from lightning_commstrats.buckets import flatten, unflatten_into
from lightning_commstrats.comm import Communicator
from lightning_commstrats.comm.base import CollectiveError
from lightning_commstrats.comm.stats import CommStats
from lightning_commstrats.comm.torch_dist import LivenessWatch
from lightning_commstrats.compression.exchange import TensorExchange
from lightning_commstrats.fault_tolerance import (
    EVERY_INTERFACE,
    FaultTolerance,
    Quorum,
    ReplicaMismatch,
    ReplicaSummary,
    ReplicaSync,
    RunEnded,
    bind_host,
    layout_mismatch_message,
    listen_socket,
    mismatch_message,
    run_attempts,
)
from lightning_commstrats.sharding.memory import tensors_in

log = logging.getLogger(__name__)

FINGERPRINT_CHUNK = 1 << 22  # values per pass of the global model's fingerprint (48 MiB of scratch)
SOURCE_KEY = "healed_from"  # in the state a healing peer receives: the replica that sent it


class ReplicaHost(Protocol):
    """What :class:`ReplicaGroup` needs of the strategy that holds it (the periodic strategy)."""

    def replica_state(self, pending: Any | None) -> dict[str, Any]:
        """A snapshot of the state every replica shares (what a healing peer of this rank receives)."""

    def adopt(self, state: dict[str, Any]) -> None:
        """Take the run's shared state (received from a peer) in place of this rank's."""

    def join_sync(self, state: dict[str, Any]) -> Any:
        """After adopting ``state`` of a peer that is inside a sync: the exchange this rank takes part in."""

    def retarget(self, pending: Any, sync: tuple[int, int, int]) -> Tensor:
        """Point ``pending`` at the sync the run is in; returns its (zero) pseudo-gradient."""

    def bind_exchange(self, comm: Communicator) -> TensorExchange:
        """The exchange, over ``comm`` (one quorum's process group)."""

    def named_views(self, fragment: int, flat: Tensor) -> dict[str, Tensor]:
        """``flat`` (a fragment's pseudo-gradient) as named views, one per parameter (its local shard)."""

    def global_tensors(self, state: dict[str, Any] | None) -> list[Tensor]:
        """The global model this rank holds (its shard when sharded), or the one in ``state``."""


class PeerWatch:
    """Watches the heartbeats of the replica's other ranks from a thread; when one stops (killed, out
    of memory, exited on an error) calls ``on_stop`` once with what happened.

    Args:
        heartbeat: the replica's heartbeat counters (:class:`~lightning_commstrats.comm.torch_dist.Heartbeat`).
        on_stop: called from the watch's thread.
        after: seconds without a beat after which a rank counts as stopped.
    """

    def __init__(self, heartbeat: Any, on_stop: Callable[[str], None], after: float = 4.0) -> None:
        self._watch = LivenessWatch(heartbeat, after=after)
        self._on_stop = on_stop
        self._every = heartbeat.interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commstrats-peer-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            stopped = self._watch.stopped()
            if stopped is None:
                self._on_stop("the replica's rank 0 (which hosts its rendezvous store) is gone")
                return
            if stopped:
                self._on_stop(
                    f"rank(s) {stopped} of the replica stopped (killed, out of memory, or exited on an error)"
                )
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def replica_store(config: FaultTolerance) -> tuple[TCPStore, tuple[str, int]]:
    """The replica's rendezvous store (its rank 0 hosts it), listening at ``config.store_bind`` (by
    default the address the replica advertises), and the address its ranks and the quorum's replicas
    reach it at."""
    advertised = config.hostname or socket.gethostname()
    # TCPStore listens on every interface unless it is handed a socket: the Lighthouse listens on
    # loopback by default because whoever reaches it joins the run, and whoever reaches this store
    # can rendezvous into the replicas' process groups
    bind = bind_host(config.store_bind) if config.store_bind is not None else advertised
    try:
        listener = listen_socket(bind, 0)
    except OSError as err:
        raise OSError(
            f"the replica's store cannot listen at {bind!r} ({err}): set fault_tolerance.store_bind to an address"
            " of this machine that the other replicas reach (0.0.0.0 for every IPv4 interface, :: for every one)"
        ) from err
    try:
        store = TCPStore(
            "127.0.0.1" if bind in EVERY_INTERFACE else bind,  # where this process reaches its own store
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=config.timeout),
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now (and closes it when it is deleted)
    return store, (advertised, store.port)


def slice_bounds(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut tensors of ``sizes`` (in order) into ``parts`` contiguous runs of whole tensors, of about
    equal total size; a run may be empty (fewer tensors than parts). Returns ``[begin, end)`` pairs."""
    total, bounds, begin, acc = sum(sizes), [], 0, 0
    for k in range(parts):
        target = total * (k + 1) / parts
        end = begin
        while end < len(sizes) and (k == parts - 1 or abs(acc + sizes[end] - target) <= abs(acc - target)):
            acc += sizes[end]
            end += 1
        bounds.append((begin, end))
        begin = end
    return bounds


def fingerprint(tensors: list[Tensor]) -> Tensor:
    """Two int64 checksums of the bits of float32 ``tensors``: their sum, and their sum weighted by
    position. Integer sums are exact and do not depend on the order of summation, so equal tensors
    give equal checksums on any device; two different models colliding is not a practical concern."""
    sums = torch.zeros(2, dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    position = 0
    for t in tensors:
        flat = t.detach().float().contiguous().view(torch.int32).flatten()
        for chunk in flat.split(FINGERPRINT_CHUNK):  # bounded scratch memory, whatever the model's size
            bits = chunk.to(torch.int64)
            weight = torch.arange(position, position + bits.numel(), device=bits.device) % 65521 + 1
            sums[0] += bits.sum()
            sums[1] += (bits * weight).sum()
            position += bits.numel()
    return sums


class ReplicaGroup:
    """This rank's membership in a fault-tolerant run (see the module's docstring).

    Args:
        config: the settings.
    """

    def __init__(self, config: FaultTolerance) -> None:
        self.config = config
        self.sync: ReplicaSync | None = None
        self.comm: Communicator | None = None  # the replica's ranks (main thread)
        self.relay: Communicator | None = None  # the replica's ranks, for the exchange's thread
        self.holders: Communicator | None = None  # the replica's ranks that hold the same tensors as this one
        self.shared: dict[str, Any] | None = None  # what a healing peer of this rank receives
        self._shared_ready: torch.cuda.Event | None = None  # on CUDA: when the main stream has made it
        self._restored: dict[str, int] | None = None  # the Manager's counters from a checkpoint
        self._watch: PeerWatch | None = None
        self._failure: str | None = None  # why this replica left the run (a rank of it stopped)
        self._layout: tuple[int, str] | None = None  # (checksum, description): see layout()
        # the replica's ranks healed from different replicas and it has not agreed on one model since
        self._mixed = False
        self.summary = ReplicaSummary()
        """What this replica went through in the fit (its rank's view): the ``[ft]`` line at the end."""

    # ------------------------------------------------------------------ join and leave

    def join(
        self,
        comm: Communicator,
        relay: Communicator,
        holders: Communicator,
        device: torch.device,
        stats: CommStats,
        *,
        host: bool,
    ) -> None:
        """Collective over the replica's ranks: every rank starts its torchft Manager (rank 0 hosts the
        replica's store and Manager server); all learn whether every rank managed to, so none waits
        for ever.

        Args:
            comm: the replica's ranks. relay: the same ranks, for the exchange's thread (``comm`` when
            there is none). holders: the ranks of the replica that hold the same tensors (all of them
            unsharded; with ``shard="fsdp"`` rank ``i`` of each group). device: the exchange's tensors'.
            stats: what the cross-replica collectives charge. host: exchange through host memory.
        """
        if self.sync is not None:
            return
        self.comm, self.relay, self.holders = comm, relay, holders
        failure, sync, address = None, None, None
        if comm.rank == 0:  # the replica's own rendezvous store for torchft (its Manager server's address...)
            try:
                self._store, address = replica_store(self.config)
            except (OSError, RuntimeError) as err:
                failure = f"{type(err).__name__}: {err}"
        address, failure = comm.broadcast_object((address, failure), 0)
        if failure is None:
            try:
                sync = ReplicaSync(
                    self.config,
                    device,
                    self.offer,
                    stats,
                    host=host,
                    rank=comm.rank,
                    world_size=comm.world_size,
                    store=address,
                )
            except Exception as err:  # every rank of the replica learns it: none waits for the others
                failure = f"rank {comm.rank}: {type(err).__name__}: {err}"
        failures = [f for f in comm.all_gather_object(failure) if f is not None]
        if failures:
            if sync is not None:
                sync.shutdown()
            raise ConnectionError(f"replica {self.config.replica_id!r} could not join the run: {failures[0]}")
        assert sync is not None
        self.sync = sync
        sync.summary = self.summary
        if self._restored is not None:
            sync.manager.load_state_dict(self._restored)
        heartbeat = getattr(comm, "heartbeat", None)
        if comm.world_size > 1 and heartbeat is not None:
            self._watch = PeerWatch(heartbeat, self._peer_stopped, after=self.config.peer_timeout)

    def _peer_stopped(self, what: str) -> None:
        """The watch's thread: a rank of this replica stopped. The replica leaves the run now (rank 0's
        Manager server stops answering the Lighthouse, which drops the replica from the next quorum);
        this rank raises at its next step across replicas."""
        self._failure = what
        log.error("replica %r leaves the run: %s", self.config.replica_id, what)
        if self.sync is not None:
            self.sync.shutdown()

    def check_alive(self) -> None:
        """Raise when a rank of this replica stopped (the replica must be restarted as a whole)."""
        if self._failure is not None:
            raise CollectiveError(
                f"replica {self.config.replica_id!r} left the run: {self._failure}; restart the replica as a whole,"
                " it heals from the others"
            )

    def finish(self, what: str) -> None:
        """The run ended here (every replica at the same step): say so in the run's store, so that a
        replica started from now on exits at once instead of waiting for a quorum."""
        if self.sync is not None and self.sync.run_store is not None and self.comm is not None and self.comm.rank == 0:
            self.sync.run_store.mark_ended(what)

    def leave(self) -> None:
        """Stop the watch and the Manager (the replica leaves the quorums)."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self.sync is not None:
            self.sync.shutdown()
            self.sync = None

    # ------------------------------------------------------------------ checkpoints and heals

    def state_dict(self) -> dict[str, int] | None:
        """The Manager's counters (committed step, committed batches): a restarted run continues from
        the replica with the most committed progress."""
        if self.sync is not None:
            return {"step": self.sync.step, "batches_committed": self.sync.batches_committed}
        return self._restored

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        self._restored = None if state is None else {k: int(v) for k, v in state.items()}
        if self.sync is not None and self._restored is not None:
            self.sync.manager.load_state_dict(self._restored)

    def offer(self) -> dict[str, Any]:
        """What a healing peer receives (torchft calls this in its quorum thread): the snapshot
        :meth:`set_offer` was given when this sync began. On CUDA it waits for the stream that made it."""
        assert self.shared is not None, "a peer asked to heal from a replica that has not synced"
        event = self._shared_ready
        if event is not None:  # torchft reads the tensors on its own stream: after the main stream made them
            torch.cuda.current_stream().wait_event(event)
        # the healing replica's ranks learn whether they all healed from the same replica
        return {**self.shared, SOURCE_KEY: self.config.replica_id}

    def set_offer(self, state: dict[str, Any]) -> None:
        """The state a healing peer receives from now on (a snapshot nobody changes until the sync ends)."""
        cuda = any(t.is_cuda for t in tensors_in(state))
        self._shared_ready = torch.cuda.current_stream().record_event() if cuda else None
        self.shared = state

    # ------------------------------------------------------------------ syncs

    def _quorum(self) -> Quorum:
        """The next quorum, the same on every rank of the replica: a rank whose quorum failed makes
        every rank raise its error (none waits in a collective for it)."""
        assert self.sync is not None and self.relay is not None
        self.check_alive()
        try:
            quorum, failure = self.sync.quorum(), None
        except Exception as err:  # no quorum within quorum_timeout, or the Manager is gone
            quorum, failure = None, err
        self.check_alive()
        source = None if quorum is None or quorum.healed is None else quorum.healed.get(SOURCE_KEY, "")
        said = self.relay.all_gather_object(
            (None if failure is None else (type(failure).__name__, str(failure)), source)
        )
        first = next((f for f, _ in said if f is not None), None)
        if first is not None:
            self.check_alive()
            if first[0] == RunEnded.__name__:
                raise RunEnded(first[1]) from failure
            raise TimeoutError(first[1]) from failure
        assert quorum is not None
        sources = sorted({s for _, s in said if s is not None})
        if len(sources) > 1:
            # torchft offsets each rank's source by the rank: this replica now holds a mix of their models
            # (harmless where they hold the same); the reconcile that follows gives it one replica's
            self._mixed = True
            log.warning(
                "replica %r: its ranks healed from different replicas (%s); it takes one replica's state",
                self.config.replica_id,
                ", ".join(sources),
            )
        return quorum

    def _commit(self, ok: bool, error: BaseException | None) -> bool:
        """torchft's decision, the same on every rank of the replica (its Manager server collects every
        rank's vote); raises when this replica has left the run."""
        assert self.sync is not None
        try:
            return self.sync.commit(ok, error)
        except Exception:
            self.check_alive()
            raise

    def _agree_received(self, received: dict[str, Any] | None) -> None:
        """Every rank of the replica holds a peer's state, or none: a heal that reached some ranks only
        (its source died inside it) leaves a replica that cannot continue; it is restarted and heals."""
        assert self.relay is not None
        count = int(self.relay.all_reduce(torch.tensor([1 if received is not None else 0]), tag="control").item())
        if 0 < count < self.relay.world_size:
            raise RuntimeError(
                f"replica {self.config.replica_id!r}: {count} of its {self.relay.world_size} ranks received a peer's"
                " state and the others did not (the source failed inside the heal); restart the replica, it heals"
            )

    def layout(self, host: ReplicaHost) -> tuple[int, str]:
        """This replica's layout, the same on each of its ranks (a collective over them): a description
        (its ranks, sharded or not) and a checksum of what each rank exchanges across replicas (the
        shapes of its part of every fragment). Replicas of one run must have the same: rank
        ``i`` of each exchanges with rank ``i`` of the others, tensors of the same sizes."""
        assert self.comm is not None and self.holders is not None
        ranks, groups = self.comm.world_size, self.holders.world_size
        if getattr(host, "sharding", None) is None:
            described = f"{ranks} ranks, unsharded"
        else:
            described = f"{ranks} ranks, shard='fsdp' in groups of {ranks // groups}"
        mine = []
        for f, weights in enumerate(host.global_tensors(None)):
            views = host.named_views(f, weights)
            begin, end = slice_bounds([v.numel() for v in views.values()], groups)[self.holders.rank]
            # shapes, not names: a replica that names its parameters otherwise (a compiled module) exchanges alike
            mine.append([tuple(v.shape) for v in list(views.values())[begin:end]])
        everyone = self.comm.all_gather_object(repr(mine))
        return zlib.crc32("\n".join(everyone).encode()), described

    def _claim_layout(self, host: ReplicaHost) -> None:
        """Refuse to join a run whose replicas have another layout (the run's store keeps the first
        replica's), before any collective with them: their sizes would not match."""
        assert self.sync is not None
        self._layout = self.layout(host)
        if self.sync.run_store is None:  # no store: the quorum's replicas compare layouts (reconcile)
            return
        value = f"{self._layout[0]}|{self._layout[1]}"
        theirs = self.sync.run_store.claim_layout(value)
        if theirs != value:
            raise ReplicaMismatch(
                layout_mismatch_message(self.config.replica_id, self._layout[1], theirs.partition("|")[2])
            )

    def first_quorum(self, host: ReplicaHost) -> None:
        """At the start of fit: agree with the replicas alive on the run's state. Replicas behind the
        quorum's highest committed step heal (torchft: a full restart continues from the replica with
        the most committed progress); replicas at the same step that hold different models take the
        one with the most committed batches (the run's first quorum: the lowest rank's, as a
        broadcast). A replica that joins a running run heals and takes part in the sync it found."""
        assert self.sync is not None
        self._claim_layout(host)
        self.set_offer(host.replica_state(None))  # a peer may heal from this replica in this very quorum
        received: dict[str, Any] | None = None  # a heal survives a failed attempt: torchft will not send it again

        def attempt(_: int) -> bool:
            nonlocal received
            quorum = self._quorum()
            self._agree_received(quorum.healed)
            received = quorum.healed or received
            if received is not None and received["sync"] is not None:
                # the others are inside a sync: adopt the run's state, then take part in that sync
                host.adopt(received)
                pending = host.join_sync(received)
                self.set_offer(host.replica_state(pending))
                pending.nonfinite = self.average(pending, host, first=Quorum(quorum.comm, quorum.step, None))
                return True
            ok, err, state = True, None, None
            try:
                state = self.reconcile(quorum, received, host)
            except ReplicaMismatch:
                raise
            except Exception as e:  # a peer died in the agreement: a new quorum
                ok, err = False, e
            committed = self._commit(ok, err)
            if committed:
                self._mixed = False
                state = state or received
                self._agree_received(state)
                if state is not None:
                    host.adopt(state)
                self.set_offer(host.replica_state(None))
            return committed

        run_attempts(self.config.max_sync_attempts, attempt, "joining the run")

    def average(self, pending: Any, host: ReplicaHost, first: Quorum | None = None) -> list[str]:
        """Average ``pending``'s pseudo-gradient (and, when it carries them, the module's buffers) over
        the replicas of a quorum, retried over a new quorum until it commits; every rank of the
        replica calls it (main thread, or the exchange's with a delay). Returns the names whose
        average is not finite.

        A replica whose state is not the run's (torchft healed it: it was behind; or the quorum found
        it holding another global model at the same step) takes the run's state, adopted when the
        sync is applied (``pending.healed``), and sends zeros that are not counted in the mean."""
        assert self.sync is not None and self.relay is not None and self.holders is not None
        backup = pending.grad.clone()  # the block's pseudo-gradient, for a retry after a failed exchange
        buffers_backup = None if pending.buffers is None else pending.buffers.clone()
        nonfinite: list[str] = []
        received: dict[str, Any] | None = None  # the run's state, once this replica learned it is behind

        def attempt(_: int) -> bool:
            nonlocal first, nonfinite, received, backup, buffers_backup
            quorum, first = first or self._quorum(), None
            if quorum.healed is not None:
                received = quorum.healed
            self._agree_received(quorum.healed)
            ok, err = True, None
            exchange = None
            try:
                received = self.reconcile(quorum, received, host) or received
                if received is not None:
                    # until it is adopted, the run's state is what this rank would heal a peer with
                    self.set_offer(received)
                    pending.contributes = False
                    if received["sync"] is not None and received["sync"][:2] != (pending.fragment, pending.started_at):
                        # behind by a whole sync (its own failed): join the one the run is in
                        host.retarget(pending, received["sync"])
                        backup = pending.grad.clone()
                        buffers_backup = None if pending.buffers is None else pending.buffers.clone()
                    pending.grad.zero_()
                    backup.zero_()
                exchange = host.bind_exchange(quorum.comm)
                if received is not None:
                    exchange.reset()
                nonfinite = exchange.average(self._my_slice(pending, host), commit=False)
                # what each replica says: whether its block counts, whether it asks to stop (a callback,
                # a time limit), and the step at which its own limits end its fit
                said = [1.0 if pending.contributes else 0.0, 1.0 if pending.stop else 0.0, pending.planned_end]
                said.append(float(pending.apply_at))  # (a replica that joined the sync late says 0)
                rows = quorum.comm.all_gather(
                    torch.tensor(said, dtype=torch.float64, device=quorum.comm.device), tag="control"
                ).cpu()
                took_part = float(rows[:, 0].sum())
                # the run ends for every replica at the same step: when this sync lands if one asked to
                # stop, else where the first replica's own limits end it
                end = float(rows[:, 2].min())
                pending.run_end = min(end, float(rows[:, 3].max())) if bool(rows[:, 1].any()) else end
                if took_part > 0 and took_part != quorum.comm.world_size:
                    pending.grad.mul_(quorum.comm.world_size / took_part)  # the mean over those who trained
                if pending.buffers is not None:
                    self._average_buffers(pending, quorum.comm, took_part)
                pending.took_part = int(took_part)
            except ReplicaMismatch:
                raise
            except Exception as e:  # any failure of this attempt (a dead peer, garbage received): retry
                ok, err = False, e
            committed = self._commit(ok, err)
            if committed and exchange is not None:
                exchange.commit()
            elif exchange is not None:
                exchange.discard()
            if not committed:
                pending.grad.copy_(backup)
                if buffers_backup is not None:
                    pending.buffers.copy_(buffers_backup)
                return False
            self._gather_slices(pending, host)
            pending.healed = received
            self._mixed = False
            return True

        run_attempts(self.config.max_sync_attempts, attempt, f"the sync of fragment {pending.fragment}")
        return nonfinite

    def _slice_of(self, pending: Any, host: ReplicaHost) -> tuple[dict[str, Tensor], list[tuple[int, int]]]:
        assert self.holders is not None
        views = host.named_views(pending.fragment, pending.grad)
        names = list(views)
        bounds = slice_bounds([v.numel() for v in views.values()], self.holders.world_size)
        return {n: views[n] for n in names[slice(*bounds[self.holders.rank])]}, _offsets(views, bounds)

    def _my_slice(self, pending: Any, host: ReplicaHost) -> dict[str, Tensor]:
        """The named views of the part of the pseudo-gradient this rank exchanges (all of it when no
        other rank of the replica holds the same tensors)."""
        return self._slice_of(pending, host)[0]

    def _gather_slices(self, pending: Any, host: ReplicaHost) -> None:
        """Every rank of the replica that holds the same tensors gets the others' averaged slices."""
        assert self.holders is not None
        if self.holders.world_size == 1:
            return
        _, offsets = self._slice_of(pending, host)
        longest = max(end - begin for begin, end in offsets)
        begin, end = offsets[self.holders.rank]
        padded = pending.grad.new_zeros(max(longest, 1))
        padded[: end - begin] = pending.grad[begin:end]
        gathered = self.holders.all_gather(padded, tag="gather")  # inside the replica: a tag of its own
        for r, (b, e) in enumerate(offsets):
            pending.grad[b:e] = gathered[r, : e - b]

    def _average_buffers(self, pending: Any, comm: Communicator, took_part: float) -> None:
        """The module's floating-point buffers (BatchNorm's statistics, agreed biases) averaged over the
        replicas that trained the block, as the weights are; a replica that healed sends zeros."""
        buffers = pending.buffers
        if not pending.contributes:
            buffers.zero_()
        comm.all_reduce(buffers, tag="weights")
        buffers.div_(max(took_part, 1.0))

    def reconcile(self, quorum: Quorum, received: dict[str, Any] | None, host: ReplicaHost) -> dict[str, Any] | None:
        """Make sure the quorum's replicas hold one global model before they average into it.

        torchft heals a replica that is behind by committed step; replicas at the same step can still
        hold different models (two that each formed the run's first quorum alone, with
        ``min_replicas`` below the number of replicas; a sync that committed on some replicas and
        failed on others, which then committed a retry among themselves; the run's very first quorum,
        every replica from its own initialisation). Every replica sends a digest of its ranks'
        fingerprints of its global model (exact integer sums of its bits, the same on any hardware;
        rank by rank, so that ranks holding each other's tensors do not cancel out), its count of
        committed batches, and whether it is consistent: its ranks healed from one replica, and
        its ranks that hold the same tensors hold the same values. When the digests differ, the
        state of the consistent replica with the most committed batches (then the model most of them
        hold, then the lowest rank) goes to the others, rank ``i`` to rank ``i``; every rank of a
        replica sends the same, so all decide alike. Returns that state when this rank must take it,
        else ``None``."""
        assert self.sync is not None and self.relay is not None
        mine = fingerprint(host.global_tensors(received)).cpu()
        agree = True  # the replica's ranks that hold the same tensors as this one hold the same values
        if self.holders is not None and self.holders.world_size > 1:
            agree = bool((self.holders.all_gather(mine.clone(), tag="control").cpu() == mine).all())
        said = torch.cat([torch.tensor([self.sync.batches_committed, int(agree)]), mine])
        ranks = self.relay.all_gather(said, tag="control").cpu() if self.relay.world_size > 1 else said[None]
        consistent = not self._mixed and bool(ranks[:, 1].all())
        layout = 0 if self._layout is None else self._layout[0]
        replica = [self.relay.world_size, layout, int(ranks[:, 0].max()), int(consistent), *_digest(ranks[:, 2:])]
        row = torch.tensor(replica, dtype=torch.int64)
        rows = quorum.comm.all_gather(row.to(quorum.comm.device), tag="control").cpu().tolist()
        sizes = sorted({int(r[0]) for r in rows})
        if len(sizes) > 1:
            raise ReplicaMismatch(mismatch_message(self.config.replica_id, self.relay.world_size, sizes))
        if len({int(r[1]) for r in rows}) > 1:  # every replica of the quorum sees it: all say it
            described = "" if self._layout is None else self._layout[1]
            others = quorum.comm.all_gather_object(described, tag="control")
            theirs = ", ".join(sorted({d for d in others if d} - {described})) or described
            raise ReplicaMismatch(layout_mismatch_message(self.config.replica_id, described, theirs))
        rows = [r[2:] for r in rows]  # committed batches, consistent, digest
        if all(r[2:] == rows[0][2:] for r in rows):
            return None
        holders = [sum(r[2:] == rows[i][2:] for r in rows) for i in range(len(rows))]
        # a replica whose ranks hold a mix of models is never the one copied (its lowest rank would win a tie)
        candidates = [i for i, r in enumerate(rows) if r[1]]
        if not candidates:
            log.warning(
                "replica %r: no replica of the quorum holds one model on all its ranks (the sources of a heal"
                " left); the run goes on from the one chosen below",
                self.config.replica_id,
            )
            candidates = list(range(len(rows)))
        canonical = max(candidates, key=lambda i: (rows[i][0], holders[i], -i))
        me = quorum.comm.rank
        log.warning(
            "replica %r: the quorum's replicas hold %d different global models at step %d; taking replica"
            " rank %d's (committed batches, consistent, digest by rank: %s)",
            self.config.replica_id,
            len({tuple(r[2:]) for r in rows}),
            self.sync.step,
            canonical,
            rows,
        )
        state = self.shared if received is None else received
        # on the host: a pickled CUDA tensor would unpickle on its sender's device index
        offer = apply_to_collection(state, Tensor, lambda t: t.detach().cpu()) if me == canonical else None
        taken = quorum.comm.broadcast_object(offer, canonical, tag="weights")
        if rows[me][2:] == rows[canonical][2:]:
            return None
        self.summary.models_taken += 1
        return taken


def _digest(fingerprints: Tensor) -> tuple[int, int]:
    """Two int64 of a digest of the replica's fingerprints, rank by rank (order matters)."""
    raw = hashlib.blake2b(fingerprints.contiguous().numpy().tobytes(), digest_size=16).digest()
    return int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)


def _offsets(views: dict[str, Tensor], bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each slice's ``[begin, end)`` in the flat pseudo-gradient the views are consecutive pieces of."""
    starts, offset = [], 0
    for v in views.values():
        starts.append(offset)
        offset += v.numel()
    starts.append(offset)
    return [(starts[b], starts[e]) for b, e in bounds]


def flat_buffers(buffers: list[Tensor]) -> Tensor | None:
    """The floating-point ``buffers`` as one float32 vector (``None`` when there are none)."""
    floats = [b for b in buffers if b.is_floating_point()]
    return flatten([b.detach().float() for b in floats]) if floats else None


def load_buffers(flat: Tensor, buffers: list[Tensor]) -> None:
    """Write ``flat`` (from :func:`flat_buffers`) back into the floating-point ``buffers``."""
    floats = [b for b in buffers if b.is_floating_point()]
    with torch.no_grad():
        unflatten_into(flat.to(floats[0].device), floats)
