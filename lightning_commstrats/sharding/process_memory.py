"""Memory as the operating system and the device count it: what this process holds at its peak, over the
whole run and within named phases (training, the sync), and the allocator setting that makes it follow
the live tensors on the host.

:func:`~lightning_commstrats.sharding.memory.memory_by_kind` counts the tensors of the training state.
What a rank runs out of is more: activations, FSDP2's gathered units, buffers of an exchange in flight
and the allocator's slack. Counters (bytes):

- ``rss``: the process's resident set on Linux (``VmRSS`` now, ``VmHWM`` the kernel's peak, from
  ``/proc/self/status``); elsewhere only the peak, from ``getrusage``;
- ``allocated`` / ``reserved``: on a CUDA device, ``torch.cuda.max_memory_allocated`` (tensors) and
  ``max_memory_reserved`` (what the caching allocator took from the driver).

A phase's peak is measured in one of two ways (``phases=``):

- ``True`` (the default), sampled, leaving the counters alone: while a phase is open, a thread reads
  ``VmRSS`` (and CUDA's ``memory_allocated`` / ``memory_reserved``) every ``interval`` seconds (5 ms),
  and each boundary reads them too. Where the kernel's peak (``VmHWM``; CUDA's
  ``max_memory_allocated``) rose while the phase was open, the phase's peak is that new high, exactly;
  otherwise it is the largest sample (a block held for less than the interval, below the process's
  earlier high, can be missed). Nothing else that reads the counters (``/usr/bin/time``, ``getrusage``'s
  ``ru_maxrss``, a profiler, ``torch.cuda.max_memory_allocated``) is disturbed.
- ``"reset"``, exact: each phase's start resets the counters' peaks (``clear_refs``: writing ``5`` to
  ``/proc/self/clear_refs`` sets ``VmHWM`` to the resident set now, Linux 4.0+;
  ``torch.cuda.reset_peak_memory_stats``). This is process-wide: anything else reading them sees the
  peak since the last boundary only. Where ``clear_refs`` cannot be written (another kernel, a
  read-only ``/proc``), the phases' ``rss`` figures are ``None``, with the reason in
  :attr:`ProcessMemory.phase_note`.

Every reading first folds the peak so far into the run's peak and into every phase still open, so the
run's peak is never lost (to a reset either) and an outer phase keeps the peak of an inner one.

Cost: a boundary is a read or two of ``/proc/self/status`` (about 1.5 kB; 25 to 90 microseconds
measured here, on two shared, loaded cores), plus a one-byte write to ``clear_refs`` with ``"reset"``
(which walks no page tables: ``5`` only resets the counter). The sampler's thread costs one such read
every interval while a phase is open (under 1% of a core at 5 ms); it runs only while a phase is open.
The files are opened each time: a descriptor kept open would read the parent's counts in a forked child.

On the host, glibc's defaults keep freed memory: after the process frees a block larger than the mmap
threshold (128 KiB at start), glibc raises the threshold to that size (up to 32 MiB), so later tensors
of up to that size come from the heap, and a heap block freed below one still in use stays resident.
The peak then tracks the most ever held rather than the live tensors. :func:`fix_mmap_threshold`
fixes the threshold in a running process (as ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment does
at start). It is not free: every block of 128 KiB or more is then mapped afresh and faulted in page by
page (``benchmarks/memory.py --os``: 2.9x to 5.5x the minor page faults of a fit, and about twice its
seconds, on a 75M-parameter model on CPU). No Lightning here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

COUNTERS = ("rss", "allocated", "reserved")
LABELS = {"rss": "peak RSS", "allocated": "peak allocated", "reserved": "peak reserved"}  # as the lines print them
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
DEFAULT_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value
SAMPLE_INTERVAL = 0.005  # seconds between the sampler's readings while a phase is open
PHASE_MODES = (True, "reset", False)  # sampled (the counters left alone), exact by resets, none


def check_phases(phases: Any, name: str = "phases") -> None:
    """``ValueError`` naming ``name`` unless ``phases`` is one of :data:`PHASE_MODES`."""
    if not (phases is True or phases is False or phases == "reset"):
        raise ValueError(
            f"{name} must be True (sampled; the process's peak counters are left alone), 'reset' (exact;"
            f" resets them at each phase) or False (no phases), got {phases!r}"
        )


def _status() -> dict[str, int] | None:
    """``VmRSS`` and ``VmHWM`` in bytes, or None without ``/proc/self/status``."""
    # unbuffered, and the two fields found rather than every line split: a third of the time
    try:
        fd = os.open(_STATUS, os.O_RDONLY)
    except OSError:
        return None
    try:
        text = os.read(fd, 1 << 16)
    except OSError:
        return None
    finally:
        os.close(fd)
    found = {}
    for key in ("VmRSS", "VmHWM"):
        at = text.find(key.encode() + b":")
        if at < 0:
            return None
        found[key] = int(text[at + 6 : text.index(b"kB", at)]) * 1024  # the kernel writes kB
    return found


def _rusage_peak() -> int | None:
    """The process's peak resident set from ``getrusage`` (kB on Linux, bytes on macOS)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_kernel_peak() -> str | None:
    """Reset ``VmHWM`` to the resident set now; the reason it cannot be, or None."""
    try:
        fd = os.open(_CLEAR_REFS, os.O_WRONLY)
        try:
            os.write(fd, b"5")
        finally:
            os.close(fd)
    except OSError as e:
        return f"the kernel's peak cannot be reset ({_CLEAR_REFS}: {e.strerror or e})"
    return None


class ProcessMemory:
    """The peak memory this process holds on the host (``rss``) and on a CUDA ``device`` (``allocated``,
    ``reserved``), over the run and within named phases (see the module docstring).

    Phases nest: :meth:`begin` / :meth:`end`, or :meth:`phase` as a context manager. A phase entered
    again keeps the largest peak of all its entries. Call it from the training loop's thread (memory
    taken by another thread still counts, in whichever phase is open then).

    Args:
        device: the rank's device; a CUDA device adds the caching allocator's counters. None: the host.
        phases: how a phase's peak is measured: ``True`` (default) sampled, the process's peak counters
            left alone for every other reader; ``"reset"`` exact, resetting them at each phase's start
            (``/usr/bin/time``, ``ru_maxrss`` and CUDA's peak statistics then read the peak since the
            last boundary); ``False`` no phases, the run's peak only.
        interval: seconds between the sampler's readings (``phases=True``).
    """

    def __init__(
        self, device: torch.device | str | None = None, phases: bool | str = True, interval: float = SAMPLE_INTERVAL
    ) -> None:
        check_phases(phases)
        if not (isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval > 0):
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        if self._cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        status = _status()
        self._linux = status is not None
        self.phase_note: str | None = None
        """Why the phases' ``rss`` peaks are not known (None: they are)."""
        self._phases = phases is not False
        self._reset_mode = phases == "reset"
        self.interval = float(interval)
        self.method = "reset" if self._reset_mode else "sampled" if self._phases else None
        """How the phases' peaks were measured: ``"reset"``, ``"sampled"`` or None (no phases)."""
        if not self._phases:
            self.phase_note = "phases are off: the counters are never reset, so only the run's peak is known"
        elif not self._linux:
            self.phase_note = f"{_STATUS} cannot be read on this system"
        self._lock = threading.Lock()
        self._sampler: tuple[threading.Thread, threading.Event] | None = None
        self.start: dict[str, int | None] = self._now()
        """The counters when the tracker was made (bytes)."""
        self.peak: dict[str, int] = {}
        """The largest value of each counter seen so far, from the start of the process (bytes)."""
        self.phase_peaks: dict[str, dict[str, int | None]] = {}
        """Per phase name, the largest value of each counter within any of its entries (bytes)."""
        # per open phase: its name, its peaks so far, and (sampled) the counters' peaks at its start
        self._open: list[tuple[str, dict[str, int], dict[str, int]]] = []
        self._fold()

    def _counters(self) -> tuple[str, ...]:
        return COUNTERS if self._cuda else COUNTERS[:1]

    def _read(self) -> tuple[dict[str, int | None], dict[str, int]]:
        """The counters now and their peaks since their last reset, from one read of the kernel's
        figures (bytes)."""
        status = _status()
        now: dict[str, int | None] = {"rss": status["VmRSS"] if status else None}
        peak = status["VmHWM"] if status else _rusage_peak()
        highs = {} if peak is None else {"rss": peak}
        if self._cuda:
            now["allocated"] = torch.cuda.memory_allocated(self.device)
            now["reserved"] = torch.cuda.memory_reserved(self.device)
            highs["allocated"] = torch.cuda.max_memory_allocated(self.device)
            highs["reserved"] = torch.cuda.max_memory_reserved(self.device)
        return now, highs

    def _now(self) -> dict[str, int | None]:
        return self._read()[0]

    def _fold(self) -> tuple[dict[str, int | None], dict[str, int]]:
        """Fold the counters' peaks since their last reset into the run's and into every open phase's
        (``"reset"``); sampled, into an open phase only where the peak rose while it was open, beside
        the counters now. Returns what it read: the counters now and their peaks."""
        now, highs = self._read()
        with self._lock:
            for counter, value in highs.items():
                self.peak[counter] = max(self.peak.get(counter, 0), value)
            if not self._reset_mode:
                self._take(now)  # the kernel updates its peak lazily: the resident set can be above it
            for _, peaks, at_start in self._open:
                for counter, value in highs.items():
                    if self._reset_mode or value > at_start.get(counter, value):
                        peaks[counter] = max(peaks.get(counter, 0), value)
        return now, highs

    def _take(self, now: dict[str, int | None]) -> None:
        """The counters ``now`` into the run's peak and every open phase's (under the lock)."""
        for counter, value in now.items():
            if value is None:
                continue
            if counter in self.peak:
                self.peak[counter] = max(self.peak[counter], value)
            for _, peaks, _ in self._open:
                peaks[counter] = max(peaks.get(counter, 0), value)

    def _reset(self) -> None:
        if not self._reset_mode:
            return
        if self.phase_note is None:
            self.phase_note = _reset_kernel_peak()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _sample(self, stop: threading.Event) -> None:
        """The sampler's loop: the counters now into every open phase, every interval, until stopped."""
        while not stop.wait(self.interval):
            now = self._now()
            with self._lock:
                self._take(now)

    def _start_sampler(self) -> None:
        if self._sampler is None and self._phases and not self._reset_mode:
            stop = threading.Event()
            thread = threading.Thread(target=self._sample, args=(stop,), name="commstrats-memory", daemon=True)
            self._sampler = (thread, stop)
            thread.start()

    def _stop_sampler(self) -> None:
        if self._sampler is not None:
            thread, stop = self._sampler
            self._sampler = None
            stop.set()
            thread.join(timeout=1.0)  # at most one reading of the counters away: no thread outlives its phases

    def begin(self, name: str) -> None:
        """Start phase ``name``: fold; with ``"reset"``, reset the peaks, so that what follows is the
        phase's own; sampled, note the counters' peaks now and start the sampler."""
        if any(open_name == name for open_name, _, _ in self._open):
            raise ValueError(f"phase {name!r} is already open; end it first (open: {self.open_phases})")
        now, highs = self._fold()
        self._reset()
        if self._reset_mode:
            entry: tuple[str, dict[str, int], dict[str, int]] = (name, {}, {})
        else:  # its peaks start at the counters now; the kernel's peak now tells whether it sets a new one
            entry = (name, {k: v for k, v in now.items() if v is not None}, highs)
        with self._lock:
            self._open.append(entry)
        self.phase_peaks.setdefault(name, {})  # phases are reported in the order they first began
        self._start_sampler()

    def end(self, name: str) -> None:
        """End phase ``name`` (the innermost open one) and keep its peak."""
        if not self._open or self._open[-1][0] != name:
            raise ValueError(f"phase {name!r} is not the innermost open phase (open: {self.open_phases})")
        self._fold()
        with self._lock:
            _, peaks, _ = self._open.pop()
        if not self._open:
            self._stop_sampler()
        self._keep(name, peaks)

    def close(self) -> None:
        """End every open phase (innermost first): at teardown, or after a phase that raised."""
        while self._open:
            self.end(self._open[-1][0])

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with tracker.phase("sync"): ...``: :meth:`begin` and :meth:`end` around the block."""
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    @property
    def open_phases(self) -> list[str]:
        """The phases begun and not ended, outermost first."""
        return [name for name, _, _ in self._open]

    def _phase_unknown(self, counter: str) -> bool:
        """Whether the phases' peaks of ``counter`` are not known: no phases (``phases=False``), or the
        kernel's counters cannot be read or reset (``rss``; see :attr:`phase_note`)."""
        return not self._phases or (counter == "rss" and self.phase_note is not None)

    def _keep(self, name: str, peaks: dict[str, int]) -> None:
        kept = self.phase_peaks.setdefault(name, {})
        for counter in self._counters():
            if self._phase_unknown(counter):
                kept[counter] = None
                continue
            value = peaks.get(counter)
            old = kept.get(counter)
            kept[counter] = value if old is None else max(old, value or 0)

    def stats(self) -> dict[str, dict[str, Any]]:
        """``{counter: {"device", "start", "now", "peak", "phases": {name: bytes or None}}}`` (bytes;
        ``rss`` on the host, ``allocated`` and ``reserved`` on a CUDA device). A phase still open
        counts with its peak so far. Where the phases' ``rss`` is not known, ``rss`` has a ``"note"``;
        where they are, every counter has ``"method"``: ``"sampled"`` or ``"reset"``."""
        now, _ = self._fold()
        phases = {name: dict(peaks) for name, peaks in self.phase_peaks.items()}
        with self._lock:
            still_open = [(name, dict(peaks)) for name, peaks, _ in self._open]
        for name, open_peaks in still_open:
            kept = phases.setdefault(name, {})
            for counter in self._counters():
                value = None if self._phase_unknown(counter) else open_peaks.get(counter)
                old = kept.get(counter)
                kept[counter] = value if old is None or value is None else max(old, value)
        out: dict[str, dict[str, Any]] = {}
        for counter in self._counters():
            if counter not in self.peak:  # no count of the host's memory on this system
                continue
            out[counter] = {
                "device": "cpu" if counter == "rss" else str(self.device),
                "start": self.start.get(counter),
                "now": now.get(counter),
                "peak": self.peak[counter],
                "phases": {name: peaks.get(counter) for name, peaks in phases.items()},
            }
            if self._phase_unknown(counter):
                out[counter]["note"] = self.phase_note
            elif self.method is not None and phases:
                out[counter]["method"] = self.method
        return out


# The allocators people preload in glibc's place, by the stem of their shared library's name.
PRELOADED_ALLOCATORS = {"jemalloc": "libjemalloc.so", "tcmalloc": "libtcmalloc"}


class _DlInfo(ctypes.Structure):
    _fields_ = [  # the layout of dlfcn.h's Dl_info
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _malloc_library() -> str | None:
    """The file of the shared object whose ``malloc`` this process calls (the dynamic linker's answer:
    a preloaded allocator's library, or the C library), or None where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None)
        address = ctypes.cast(libc.malloc, ctypes.c_void_p).value
        info = _DlInfo()
        if not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
            return None
        return info.dli_fname.decode(errors="replace")
    except (AttributeError, OSError, TypeError):
        return None


def host_allocator() -> str:
    """The allocator this process's ``malloc`` is: ``"jemalloc"`` or ``"tcmalloc"`` (preloaded with
    ``LD_PRELOAD``, or linked), ``"glibc"``, or ``"unknown"`` (another C library, another allocator,
    one linked into the executable). Asked of the dynamic linker: the shared object that holds the
    ``malloc`` this process calls (a preload that failed leaves glibc's in place silently: this says
    which one runs)."""
    library = _malloc_library()
    if library is None:
        return "unknown"
    name = os.path.basename(library)
    for allocator, stem in PRELOADED_ALLOCATORS.items():
        if name.startswith(stem):
            return allocator
    return "glibc" if _glibc_version() is not None and name.startswith("libc.so") else "unknown"


def _glibc_version() -> str | None:
    """``"glibc 2.36"`` where the C library is glibc, else None."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    return version if version and version.startswith("glibc") else None


def fix_mmap_threshold(threshold: int = DEFAULT_MMAP_THRESHOLD, *, trim: bool = True) -> tuple[bool, str]:
    """Fix glibc's mmap threshold in this running process, so that freed blocks above ``threshold``
    bytes go back to the system and the resident set follows the live tensors (see the module
    docstring). Setting it also turns off glibc's raising of the threshold after large frees. As
    ``MALLOC_MMAP_THRESHOLD_=<threshold>`` in the environment at start; applies to every thread. It
    trades time for memory: each larger block is mapped and faulted in afresh (see the module docstring).
    Call it early, before the heap has grown: blocks already free in the heap are still reused first
    and stay resident when freed again (``trim`` hands back only what is free at the call).

    Args:
        threshold: blocks of at least this many bytes are mapped on their own (glibc caps it at 32 MiB
            on 64-bit systems).
        trim: also hand back at once what the heap already holds free (``malloc_trim(0)``).

    Returns:
        ``(applied, why)``: False with the reason where ``malloc`` is not glibc's (another C library, or
        jemalloc or tcmalloc preloaded: :func:`host_allocator`); nothing is done there.
    """
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold <= 0:
        raise ValueError(f"threshold must be a positive number of bytes, got {threshold!r}")
    allocator = host_allocator()
    if allocator != "glibc":
        return False, f"malloc is not glibc's ({allocator}): glibc's mmap threshold does not apply (see its settings)"
    version = _glibc_version()
    libc = ctypes.CDLL(None)
    if libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)) != 1:
        return False, f"{version} refused mallopt(M_MMAP_THRESHOLD, {threshold})"
    if trim:
        libc.malloc_trim(ctypes.c_size_t(0))
    return True, f"{version}: mmap threshold fixed at {threshold} bytes"


def format_bytes(n: int | None) -> str:
    """``n`` bytes for a person: MiB below a GiB, else GiB; ``"?"`` for None."""
    if n is None:
        return "?"
    if abs(n) < 2**30:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**30:.2f} GiB"


def format_process_memory(stats: dict[str, dict[str, Any]]) -> str:
    """One line from :meth:`ProcessMemory.stats`: ``peak RSS 1.20 GiB (training 1.10 GiB, sync
    912.0 MiB); cuda:0 peak allocated ..., reserved ...``."""
    parts = []
    for counter in COUNTERS:
        figures = stats.get(counter)
        if figures is None:
            continue
        label = LABELS[counter] if counter == "rss" else f"{figures['device']} {LABELS[counter]}"
        phases = figures.get("phases") or {}
        if figures.get("note"):
            within = f" (phases not measured: {figures['note']})" if phases else ""
        else:
            within = ", ".join(f"{name} {format_bytes(b)}" for name, b in phases.items())
            if within and figures.get("method") == "sampled":  # a lower bound where no new high was set
                within += ", sampled"
            within = f" ({within})" if within else ""
        parts.append(f"{label} {format_bytes(figures['peak'])}{within}")
    return "; ".join(parts)


def format_ranks_peaks(per_rank: list[dict[str, dict[str, Any]]]) -> str:
    """One line over every rank's :meth:`ProcessMemory.stats` (in rank order): for each counter, the
    largest peak and its rank, the smallest and its rank: ``peak RSS over 4 ranks: largest 1.31 GiB
    (rank 2), smallest 1.10 GiB (rank 0)``. The line a run's memory is judged by: rank 0 is not always
    the largest."""
    parts = []
    for counter in COUNTERS:
        peaks = [(stats[counter]["peak"], rank) for rank, stats in enumerate(per_rank) if counter in stats]
        if not peaks:
            continue
        (top, top_rank), (low, low_rank) = max(peaks), min(peaks)
        parts.append(
            f"{LABELS[counter]} over {len(peaks)} ranks: largest {format_bytes(top)} (rank {top_rank}),"
            f" smallest {format_bytes(low)} (rank {low_rank})"
        )
    return "; ".join(parts)
