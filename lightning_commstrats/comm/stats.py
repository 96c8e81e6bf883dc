"""Communication statistics: what one rank sent, how often, and how long it waited.

A :class:`CommStats` is owned by a :class:`~lightning_commstrats.comm.Communicator`; every
collective adds to it. Strategies mark optimizer steps with :meth:`CommStats.mark_step`, which
closes a per-step delta (:attr:`CommStats.last_step`), in the spirit of CNTK's ``syncPerfStats``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields


@dataclass
class CommCounters:
    """Counters for one kind of traffic (a *tag*, e.g. ``"grad"``) or for all of it.

    Attributes:
        bytes_sent: bytes this rank put on the wire (see :mod:`lightning_commstrats.comm.wire`).
        calls: number of collectives.
        comm_seconds: wall seconds spent inside collectives (waiting included).
    """

    bytes_sent: int = 0
    calls: int = 0
    comm_seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes_sent += nbytes
        self.calls += 1
        self.comm_seconds += seconds

    def __sub__(self, other: CommCounters) -> CommCounters:
        return CommCounters(
            self.bytes_sent - other.bytes_sent, self.calls - other.calls, self.comm_seconds - other.comm_seconds
        )

    def copy(self) -> CommCounters:
        return CommCounters(self.bytes_sent, self.calls, self.comm_seconds)


@dataclass
class CommSnapshot:
    """Figures over an interval: the whole run (cumulative) or one step (a delta).

    Attributes:
        bytes_sent: bytes this rank sent.
        calls: collectives issued.
        comm_seconds: wall seconds inside collectives.
        wall_seconds: wall seconds of the interval (between step marks).
        steps: optimizer steps in the interval.
        by_tag: the same counters split by traffic kind (``"grad"``, ``"weights"``, ``"control"``...).
    """

    bytes_sent: int = 0
    calls: int = 0
    comm_seconds: float = 0.0
    wall_seconds: float = 0.0
    steps: int = 0
    by_tag: dict[str, CommCounters] = field(default_factory=dict)

    @property
    def compute_seconds(self) -> float:
        """Wall seconds not spent in collectives (forward, backward, optimizer, data loading)."""
        return max(self.wall_seconds - self.comm_seconds, 0.0)

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat dictionary, e.g. for loggers or JSON; per-tag entries as ``"<tag>/bytes_sent"``."""
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "by_tag"}
        out["compute_seconds"] = self.compute_seconds
        for tag, counters in sorted(self.by_tag.items()):
            for f in fields(counters):
                out[f"{tag}/{f.name}"] = getattr(counters, f.name)
        return out


class CommStats:
    """Cumulative communication statistics of one rank, with per-step deltas.

    Attributes read by users: ``bytes_sent``, ``calls``, ``comm_seconds``, ``steps``,
    ``wall_seconds``, ``compute_seconds``, ``by_tag`` and ``last_step`` (a :class:`CommSnapshot` of
    the most recent step).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = CommCounters()
        self._by_tag: dict[str, CommCounters] = {}
        self.steps = 0
        self._clock_start = time.perf_counter()
        self._mark = self._now()
        self.last_step = CommSnapshot()

    def record(self, tag: str, nbytes: int, seconds: float) -> None:
        """Charge one collective of ``nbytes`` sent bytes and ``seconds`` of waiting to ``tag``."""
        with self._lock:  # a background exchange records from its own thread
            self._total.add(nbytes, seconds)
            self._by_tag.setdefault(tag, CommCounters()).add(nbytes, seconds)

    @property
    def bytes_sent(self) -> int:
        return self._total.bytes_sent

    @property
    def calls(self) -> int:
        return self._total.calls

    @property
    def comm_seconds(self) -> float:
        return self._total.comm_seconds

    @property
    def wall_seconds(self) -> float:
        return time.perf_counter() - self._clock_start

    @property
    def compute_seconds(self) -> float:
        return max(self.wall_seconds - self.comm_seconds, 0.0)

    @property
    def by_tag(self) -> dict[str, CommCounters]:
        with self._lock:
            return {tag: c.copy() for tag, c in self._by_tag.items()}

    def start_clock(self) -> None:
        """Restart the wall clock (at the start of training) without touching the counters."""
        self._clock_start = time.perf_counter()
        self._mark = self._now()

    def snapshot(self) -> CommSnapshot:
        """Cumulative figures since the stats were created."""
        return self._now()

    def mark_step(self) -> CommSnapshot:
        """Count one optimizer step and return the figures of the interval since the previous mark."""
        self.steps += 1
        now = self._now()
        self.last_step = delta(now, self._mark)
        self._mark = now
        return self.last_step

    def _now(self) -> CommSnapshot:
        return CommSnapshot(
            bytes_sent=self.bytes_sent,
            calls=self.calls,
            comm_seconds=self.comm_seconds,
            wall_seconds=self.wall_seconds,
            steps=self.steps,
            by_tag=self.by_tag,
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
    )
