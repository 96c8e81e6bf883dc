"""Communication statistics: what one rank sent, how often, and how long it waited.

Two kinds of seconds are kept apart. ``comm_seconds`` are the seconds the training loop waited for
communication: collectives issued from the loop's thread, and the loop's waits for work in the
background (the result of a flag round, a background exchange joined back). ``background_seconds``
are the seconds collectives ran on other threads (a streaming exchange on the wire while the loop
trains): they overlap compute and are not waiting. Compute is wall time minus ``comm_seconds``.

A :class:`CommStats` is owned by a :class:`~lightning_commstrats.comm.Communicator`; every
collective adds to it. Strategies mark optimizer steps with :meth:`CommStats.mark_step`, which
closes a per-step delta (:attr:`CommStats.last_step`), in the spirit of CNTK's ``syncPerfStats``.

Seconds of a collective on CUDA tensors are measured on the device, between two CUDA events around
it (:class:`CudaInterval`), and read only when they are asked for: no collective waits for the
device just to be timed. Bytes and calls are booked at once; the seconds once the collective has
completed on the device (see :meth:`CommStats.snapshot`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch

# pending device timings beyond which record() books those already complete (without waiting)
_SETTLE_EVERY = 256

#: traffic that happens once per fit, not per step (``CommSnapshot.setup_bytes``)
ONE_TIME_TAGS = frozenset({"setup", "bandwidth_probe"})


class PendingSeconds(Protocol):
    """The duration of a collective that may still be running on a device."""

    def done(self) -> bool:
        """Whether the duration is known without waiting."""
        ...

    def seconds(self) -> float:
        """The duration in seconds (waits until the collective has completed)."""
        ...


class CudaInterval:
    """Seconds between two CUDA events on the stream current for ``device`` when it is made: one
    recorded now, one by :meth:`stop`. The events are enqueued, never waited for, until
    :meth:`seconds` is called; the interval then covers the collective as the stream sees it (from
    the stream reaching it, through waiting for the peers, to the result being in place)."""

    __slots__ = ("_end", "_start", "_stream")

    def __init__(self, device: torch.device) -> None:
        # the stream of the tensor's device, not of the thread's current device: a background
        # thread's current device is cuda:0 whatever device its tensors are on
        self._stream = torch.cuda.current_stream(device)
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._start.record(self._stream)

    def stop(self) -> CudaInterval:
        self._end.record(self._stream)
        return self

    def done(self) -> bool:
        return self._end.query()

    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


@dataclass
class CommCounters:
    """Counters for one kind of traffic (a *tag*, e.g. ``"grad"``) or for all of it.

    Attributes:
        bytes_sent: bytes this rank put on the wire (see :mod:`lightning_commstrats.comm.wire`).
        calls: number of collectives.
        comm_seconds: seconds the training loop waited for communication (collectives issued from
            its thread, the peers' lateness included, and its waits for background work): wall
            seconds on CPU, device seconds between CUDA events on CUDA.
        background_seconds: seconds collectives ran on other threads, overlapping the loop's
            compute (a background exchange on the wire).
    """

    bytes_sent: int = 0
    calls: int = 0
    comm_seconds: float = 0.0
    background_seconds: float = 0.0

    def add(self, nbytes: int, seconds: float, background: bool = False, calls: int = 1) -> None:
        self.bytes_sent += nbytes
        self.calls += calls
        if background:
            self.background_seconds += seconds
        else:
            self.comm_seconds += seconds

    def __sub__(self, other: CommCounters) -> CommCounters:
        return CommCounters(
            self.bytes_sent - other.bytes_sent,
            self.calls - other.calls,
            self.comm_seconds - other.comm_seconds,
            self.background_seconds - other.background_seconds,
        )

    def copy(self) -> CommCounters:
        return CommCounters(self.bytes_sent, self.calls, self.comm_seconds, self.background_seconds)


@dataclass
class CommSnapshot:
    """Figures over an interval: the whole run (cumulative) or one step (a delta).

    Attributes:
        bytes_sent: bytes this rank sent.
        calls: collectives issued.
        comm_seconds: seconds the training loop waited for communication (see :class:`CommCounters`).
        wall_seconds: wall seconds of the interval (between step marks).
        steps: optimizer steps in the interval.
        by_tag: the same counters split by traffic kind (``"grad"``, ``"weights"``, ``"control"``...).
        background_seconds: seconds collectives ran beside the loop, on other threads.
        across_by_tag: per tag, the bytes this rank sent on channels that join ranks of different
            groups (sites; see :meth:`CommStats.set_groups`) or replicas: the slow link's share.
        grouped: whether the run's ranks are in groups (or replicas), so that ``across`` means
            something.
    """

    bytes_sent: int = 0
    calls: int = 0
    comm_seconds: float = 0.0
    wall_seconds: float = 0.0
    steps: int = 0
    by_tag: dict[str, CommCounters] = field(default_factory=dict)
    background_seconds: float = 0.0
    across_by_tag: dict[str, int] = field(default_factory=dict)
    grouped: bool = False
    across_label: str = "groups"  # what ``across`` is between: "groups" (sites), or "replicas" alone

    @property
    def across_bytes(self) -> int:
        """Bytes this rank sent between groups (or replicas), one-time traffic included."""
        return sum(self.across_by_tag.values())

    @property
    def across_setup_bytes(self) -> int:
        """Of :attr:`across_bytes`, the one-time traffic (tags in :data:`ONE_TIME_TAGS`)."""
        return sum(b for t, b in self.across_by_tag.items() if t in ONE_TIME_TAGS)

    @property
    def across_steady_bytes_per_step(self) -> float:
        """Bytes per optimizer step this rank sent between groups, without the one-time traffic."""
        return (self.across_bytes - self.across_setup_bytes) / self.steps if self.steps else 0.0

    @property
    def compute_seconds(self) -> float:
        """Wall seconds the loop did not wait for communication (forward, backward, optimizer, data
        loading; background exchanges overlap these)."""
        return max(self.wall_seconds - self.comm_seconds, 0.0)

    @property
    def setup_bytes(self) -> int:
        """Bytes of the one-time traffic (tags in :data:`ONE_TIME_TAGS`: the initial broadcast of
        the model, a bandwidth probe), which does not recur with the steps."""
        return sum(c.bytes_sent for t, c in self.by_tag.items() if t in ONE_TIME_TAGS)

    @property
    def steady_bytes_per_step(self) -> float:
        """Bytes per optimizer step without the one-time traffic: what every further step costs."""
        return (self.bytes_sent - self.setup_bytes) / self.steps if self.steps else 0.0

    @property
    def bytes_per_step(self) -> float:
        """All bytes over the steps, the one-time traffic included (see :attr:`steady_bytes_per_step`)."""
        return self.bytes_sent / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat dictionary, e.g. for loggers or JSON; per-tag entries as ``"<tag>/bytes_sent"``."""
        out: dict[str, float] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("by_tag", "across_by_tag", "grouped", "across_label")
        }
        out["compute_seconds"] = self.compute_seconds
        out["setup_bytes"] = self.setup_bytes
        out["steady_bytes_per_step"] = self.steady_bytes_per_step
        if self.grouped:
            out["across/bytes_sent"] = self.across_bytes
            out["across/steady_bytes_per_step"] = self.across_steady_bytes_per_step
            for tag, nbytes in sorted(self.across_by_tag.items()):
                out[f"across/{tag}/bytes_sent"] = nbytes
        for tag, counters in sorted(self.by_tag.items()):
            for f in fields(counters):
                out[f"{tag}/{f.name}"] = getattr(counters, f.name)
        return out


class CommStats:
    """Cumulative communication statistics of one rank, with per-step deltas.

    Attributes read by users: ``bytes_sent``, ``calls``, ``comm_seconds`` (the loop's waiting),
    ``background_seconds``, ``steps``, ``wall_seconds``, ``compute_seconds``, ``by_tag`` and
    ``last_step`` (a :class:`CommSnapshot` of the most recent step).

    The training loop's thread is the one that made the statistics, or the last to call
    :meth:`start_clock`; a collective recorded from any other thread is background work.

    Collectives on CUDA charge their seconds late (:class:`PendingSeconds`): ``comm_seconds``,
    ``by_tag``, ``snapshot()`` and ``repr`` wait for the collectives issued so far and are exact;
    ``mark_step()``, called by the strategies every step, never waits, so a step's
    ``last_step.comm_seconds`` holds the collectives that had completed on the device by its mark
    (the others go to the step in which they complete; the totals lose nothing).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._settling = threading.Lock()  # one thread books pending seconds at a time
        self._total = CommCounters()
        self._by_tag: dict[str, CommCounters] = {}
        self._pending: list[tuple[str, PendingSeconds, bool]] = []
        self._across: dict[str, int] = {}
        self.group_size: int | None = None
        """Ranks per group (site) when the run's ranks are in several groups, else None."""
        self._spans: dict[tuple[int, ...], bool] = {}
        self._loop_thread = threading.get_ident()
        self.steps = 0
        self._clock_start = time.perf_counter()
        self._mark = self._now()
        self._step_start = self._mark  # the mark the last step started at
        self.last_step = CommSnapshot()

    def set_groups(self, group_size: int | None) -> None:
        """The run's ranks are in groups of ``group_size`` consecutive ranks (sites on slow links
        between them; None: no groups): a collective on a channel that joins ranks of different
        groups is charged to the ``across`` figures too."""
        self.group_size = group_size
        self._spans.clear()

    def spans_groups(self, ranks: tuple[int, ...] | None) -> bool:
        """Whether a channel over the run's ``ranks`` joins ranks of different groups."""
        if self.group_size is None or ranks is None:
            return False
        spans = self._spans.get(ranks)
        if spans is None:
            spans = self._spans[ranks] = len({r // self.group_size for r in ranks}) > 1
        return spans

    def record(
        self,
        tag: str,
        nbytes: int,
        seconds: float | PendingSeconds,
        *,
        background: bool | None = None,
        across: bool = False,
    ) -> None:
        """Charge one collective of ``nbytes`` sent bytes and ``seconds`` (a number, or a
        :class:`PendingSeconds` read when the statistics are) to ``tag``; ``across``: it went over
        a channel between groups (or replicas), charged to the ``across`` figures too.

        The seconds are the loop's waiting when the collective was issued from the training loop's
        thread, background seconds otherwise; ``background`` overrides that."""
        if background is None:
            background = threading.get_ident() != self._loop_thread
        pending = not isinstance(seconds, (int, float))
        with self._lock:  # a background exchange records from its own thread
            now = 0.0 if pending else seconds
            self._total.add(nbytes, now, background)
            self._by_tag.setdefault(tag, CommCounters()).add(nbytes, now, background)
            if across:
                self._across[tag] = self._across.get(tag, 0) + nbytes
            if pending:
                self._pending.append((tag, seconds, background))
            crowded = len(self._pending) >= _SETTLE_EVERY
        if crowded:  # nobody has read the stats for a while: book what is done, keep the list short
            self._settle(wait=False)

    def record_wait(self, tag: str, seconds: float, *, background: bool | None = False) -> None:
        """Charge ``seconds`` the training loop waited for communication in the background (a
        background exchange joined back, a flag round read) to ``tag``: no bytes, no call (the
        collectives themselves were recorded where they ran).

        ``background=None``: a wait that is not a collective (a fault-tolerant replica waiting for its
        quorum or commit) charged by the thread it happened in, as :meth:`record` does: the loop's
        waiting from the loop's thread, background seconds from another (whose wait the loop is
        charged for where it joins that thread)."""
        if background is None:
            background = threading.get_ident() != self._loop_thread
        with self._lock:
            self._total.add(0, seconds, background, calls=0)
            self._by_tag.setdefault(tag, CommCounters()).add(0, seconds, background, calls=0)

    def _settle(self, wait: bool) -> None:
        """Book the pending seconds that are known (all of them with ``wait``, waiting for the device).

        Without ``wait`` it never blocks: when another thread is booking, it leaves the work to it.
        """
        if not self._pending or not self._settling.acquire(blocking=wait):
            return
        try:
            with self._lock:
                pending, self._pending = self._pending, []
            booked: list[tuple[str, float, bool]] = []
            kept: list[tuple[str, PendingSeconds, bool]] = []
            for tag, p, background in pending:  # read outside the lock: waiting for the device must not stop recording
                if wait or p.done():
                    booked.append((tag, p.seconds(), background))
                else:
                    kept.append((tag, p, background))
            with self._lock:
                self._pending[:0] = kept
                for tag, s, background in booked:
                    self._total.add(0, s, background, calls=0)
                    self._by_tag[tag].add(0, s, background, calls=0)
        finally:
            self._settling.release()

    @property
    def bytes_sent(self) -> int:
        return self._total.bytes_sent

    @property
    def calls(self) -> int:
        return self._total.calls

    @property
    def comm_seconds(self) -> float:
        self._settle(wait=True)
        return self._total.comm_seconds

    @property
    def wall_seconds(self) -> float:
        return time.perf_counter() - self._clock_start

    @property
    def background_seconds(self) -> float:
        self._settle(wait=True)
        return self._total.background_seconds

    @property
    def compute_seconds(self) -> float:
        return max(self.wall_seconds - self.comm_seconds, 0.0)

    @property
    def by_tag(self) -> dict[str, CommCounters]:
        self._settle(wait=True)
        with self._lock:
            return {tag: c.copy() for tag, c in self._by_tag.items()}

    def start_clock(self) -> None:
        """Restart the wall clock (at the start of training) without touching the counters; the
        calling thread is the training loop's from now on."""
        self._loop_thread = threading.get_ident()
        self._clock_start = time.perf_counter()
        self._mark = self._step_start = self._now()

    def snapshot(self, wait: bool = True) -> CommSnapshot:
        """Cumulative figures since the stats were created.

        Args:
            wait: wait for the collectives still running on a CUDA device, so that their seconds
                are in (default); ``False`` takes only those already complete and never blocks.
        """
        return self._now(wait)

    def mark_step(self) -> CommSnapshot:
        """Count one optimizer step and return the figures of the interval since the previous mark
        (without waiting for the device: see the class notes)."""
        self.steps += 1
        now = self._now(wait=False)
        self._step_start, self._mark = self._mark, now
        self.last_step = delta(now, self._step_start)
        return self.last_step

    def extend_last_step(self) -> CommSnapshot:
        """Add what was sent since the last mark to the last step, without counting a step (the
        end-of-fit synchronisation of a periodic scheme belongs to the run's last step)."""
        now = self._now(wait=False)
        self._mark = now
        self.last_step = delta(now, self._step_start)
        return self.last_step

    def _now(self, wait: bool = True) -> CommSnapshot:
        self._settle(wait)
        with self._lock:
            total = self._total.copy()
            tags = {tag: c.copy() for tag, c in self._by_tag.items()}
            across = dict(self._across)
        return CommSnapshot(
            bytes_sent=total.bytes_sent,
            calls=total.calls,
            comm_seconds=total.comm_seconds,
            wall_seconds=self.wall_seconds,
            steps=self.steps,
            by_tag=tags,
            background_seconds=total.background_seconds,
            across_by_tag=across,
            grouped=self.group_size is not None or bool(across),
            across_label="groups" if self.group_size is not None else "replicas",
        )

    def __repr__(self) -> str:
        return (
            f"CommStats(bytes_sent={self.bytes_sent}, calls={self.calls}, "
            f"comm_seconds={self.comm_seconds:.3f}, steps={self.steps})"
        )


def delta(later: CommSnapshot, earlier: CommSnapshot) -> CommSnapshot:
    """Figures of the interval between two snapshots of the same stats."""
    tags = set(later.by_tag) | set(earlier.by_tag)
    return CommSnapshot(
        bytes_sent=later.bytes_sent - earlier.bytes_sent,
        calls=later.calls - earlier.calls,
        comm_seconds=later.comm_seconds - earlier.comm_seconds,
        wall_seconds=later.wall_seconds - earlier.wall_seconds,
        steps=later.steps - earlier.steps,
        by_tag={t: later.by_tag.get(t, CommCounters()) - earlier.by_tag.get(t, CommCounters()) for t in tags},
        background_seconds=later.background_seconds - earlier.background_seconds,
        across_by_tag={
            t: later.across_by_tag.get(t, 0) - earlier.across_by_tag.get(t, 0)
            for t in set(later.across_by_tag) | set(earlier.across_by_tag)
        },
        grouped=later.grouped,
        across_label=later.across_label,
    )
