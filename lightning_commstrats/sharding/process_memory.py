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

A phase's peak needs the counters' peaks reset when it begins: ``clear_refs`` (writing ``5`` to
``/proc/self/clear_refs`` sets ``VmHWM`` to the resident set now; Linux 4.0+) and
``torch.cuda.reset_peak_memory_stats``. Every reading and every reset first folds the peak so far into
the run's peak and into every phase still open, so the run's peak is never lost to a reset and an outer
phase keeps the peak of an inner one. Where ``clear_refs`` cannot be written (another kernel, a
read-only ``/proc``), the run's peak is still known and the phases' ``rss`` figures are ``None``, with
the reason in :attr:`ProcessMemory.phase_note`.

Cost: a phase is two reads of ``/proc/self/status`` (about 1.5 kB each) and a one-byte write to
``clear_refs``; resetting the kernel's peak walks no page tables (``5`` only resets the counter).
Measured here, 25 to 90 microseconds a phase (two shared, loaded cores): cheap enough to wrap every
step's exchange, not every tensor. The files are opened each time: a descriptor kept open would read
the parent's counts in a forked child.

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
from collections.abc import Iterator
from typing import Any

import torch

COUNTERS = ("rss", "allocated", "reserved")
LABELS = {"rss": "peak RSS", "allocated": "peak allocated", "reserved": "peak reserved"}  # as the lines print them
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
DEFAULT_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value


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
    again keeps the largest peak of all its entries. Not thread-safe: call it from the training loop's
    thread (memory taken by another thread still counts, in whichever phase is open then).

    Resetting a counter is process-wide: after a phase boundary, anything else that reads the kernel's
    peak (``VmHWM``, ``getrusage``'s ``ru_maxrss``, ``/usr/bin/time``) or CUDA's sees the peak since
    that boundary only; this tracker keeps the run's. ``phases=False`` never resets them: the run's
    peak only, the phases' figures ``None``.

    Args:
        device: the rank's device; a CUDA device adds the caching allocator's counters. None: the host.
        phases: whether phases reset the counters to measure their own peaks (default True).
    """

    def __init__(self, device: torch.device | str | None = None, phases: bool = True) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        if self._cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        status = _status()
        self._linux = status is not None
        self.phase_note: str | None = None
        """Why the phases' ``rss`` peaks are not known (None: they are)."""
        self._phases = phases
        if not phases:
            self.phase_note = "phases are off: the counters are never reset, so only the run's peak is known"
        elif not self._linux:
            self.phase_note = f"{_STATUS} cannot be read on this system"
        self.start: dict[str, int | None] = self._now()
        """The counters when the tracker was made (bytes)."""
        self.peak: dict[str, int] = {}
        """The largest value of each counter seen so far, from the start of the process (bytes)."""
        self.phase_peaks: dict[str, dict[str, int | None]] = {}
        """Per phase name, the largest value of each counter within any of its entries (bytes)."""
        self._open: list[tuple[str, dict[str, int]]] = []
        self._fold()

    def _counters(self) -> tuple[str, ...]:
        return COUNTERS if self._cuda else COUNTERS[:1]

    def _now(self) -> dict[str, int | None]:
        status = _status()
        now: dict[str, int | None] = {"rss": status["VmRSS"] if status else None}
        if self._cuda:
            now["allocated"] = torch.cuda.memory_allocated(self.device)
            now["reserved"] = torch.cuda.memory_reserved(self.device)
        return now

    def _peaks_since_reset(self) -> dict[str, int]:
        status = _status()
        peak = status["VmHWM"] if status else _rusage_peak()
        peaks = {} if peak is None else {"rss": peak}
        if self._cuda:
            peaks["allocated"] = torch.cuda.max_memory_allocated(self.device)
            peaks["reserved"] = torch.cuda.max_memory_reserved(self.device)
        return peaks

    def _fold(self) -> None:
        """Fold the counters' peaks since their last reset into the run's and every open phase's."""
        for counter, value in self._peaks_since_reset().items():
            self.peak[counter] = max(self.peak.get(counter, 0), value)
            for _, peaks in self._open:
                peaks[counter] = max(peaks.get(counter, 0), value)

    def _reset(self) -> None:
        if not self._phases:
            return
        if self.phase_note is None:
            self.phase_note = _reset_kernel_peak()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def begin(self, name: str) -> None:
        """Start phase ``name``: fold, reset the peaks, so that what follows is the phase's own."""
        if any(open_name == name for open_name, _ in self._open):
            raise ValueError(f"phase {name!r} is already open; end it first (open: {self.open_phases})")
        self._fold()
        self._reset()
        self._open.append((name, {}))
        self.phase_peaks.setdefault(name, {})  # phases are reported in the order they first began

    def end(self, name: str) -> None:
        """End phase ``name`` (the innermost open one) and keep its peak."""
        if not self._open or self._open[-1][0] != name:
            raise ValueError(f"phase {name!r} is not the innermost open phase (open: {self.open_phases})")
        self._fold()
        _, peaks = self._open.pop()
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
        return [name for name, _ in self._open]

    def _phase_unknown(self, counter: str) -> bool:
        """Whether the phases' peaks of ``counter`` are not known: the counters are never reset
        (``phases=False``), or the kernel's peak cannot be reset (``rss``; see :attr:`phase_note`)."""
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
        counts with its peak so far. Where the phases' ``rss`` is not known, ``rss`` has a ``"note"``."""
        self._fold()
        now = self._now()
        phases = {name: dict(peaks) for name, peaks in self.phase_peaks.items()}
        for name, open_peaks in self._open:
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
