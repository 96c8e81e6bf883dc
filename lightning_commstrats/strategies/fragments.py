"""The periodic schemes' engine parts: which fragment syncs when, and the exchange on its way.

A periodic scheme cuts the model into ``F`` fragments (contiguous runs of parameters,
:func:`fragment_bounds`) that sync in turn, each every ``H`` units of progress (samples per worker
or optimizer steps). Three parts, each a component the strategy holds:

- :class:`FragmentSchedule`: when each fragment's block began, which fragments are due, the stagger
  that makes them take turns; its state is the block starts.
- :class:`Exchange`: one fragment's pseudo-gradient on its way, from its launch to the step that
  applies it (with a delay, ``fragment_sync_delay`` steps later), and what fault tolerance adds.
- :class:`BackgroundRunner`: the one thread (and, on CUDA, the one side stream) an exchange with a
  delay runs on, so that training overlaps it; joined before its result is used or any state read.

No Lightning here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_commstrats.comm import CommStats


def fragment_bounds(sizes: list[int], num_fragments: int) -> list[tuple[int, int]]:
    """Cut tensors of ``sizes`` (in order) into ``num_fragments`` contiguous non-empty runs of about
    equal total size; returns ``[begin, end)`` index pairs."""
    total = sum(sizes)
    bounds, begin, acc = [], 0, 0
    for k in range(num_fragments - 1):
        target = total * (k + 1) / num_fragments
        end = begin + 1  # at least one tensor
        acc += sizes[begin]
        # grow while the next tensor brings the running total closer to the target, leaving one per later run
        while end < len(sizes) - (num_fragments - 1 - k) and abs(acc + sizes[end] - target) <= abs(acc - target):
            acc += sizes[end]
            end += 1
        bounds.append((begin, end))
        begin = end
    bounds.append((begin, len(sizes)))
    return bounds


class FragmentSchedule:
    """When each of ``num_fragments`` fragments syncs: every ``sync_period`` units of progress after
    its block began, the fragments staggered by ``sync_period / num_fragments``.

    Progress is whatever the strategy counts (samples per worker, agreed by the ranks, or optimizer
    steps): the schedule is told it, it does not read it.
    """

    def __init__(self, sync_period: int, num_fragments: int) -> None:
        self.sync_period = sync_period
        self.num_fragments = num_fragments
        self.block_start: list[int] = []  # progress when each fragment's current block began

    def __repr__(self) -> str:
        every = f"every {self.sync_period}, {self.num_fragments} fragment(s)"
        return f"FragmentSchedule({every}, blocks from {self.block_start})"

    def stagger(self, now: int) -> None:
        """Fragment ``k`` next syncs ``(k + 1) H / F`` units after ``now``, then every ``H``: the
        fragments take turns."""
        h, f = self.sync_period, self.num_fragments
        self.block_start = [now - h + (k + 1) * h // f for k in range(f)]

    def due(self, now: int) -> list[int]:
        """The fragments whose block is complete at ``now``, in order."""
        return [k for k, start in enumerate(self.block_start) if now - start >= self.sync_period]

    def behind(self, now: int) -> list[int]:
        """The fragments that trained since their block began (the end of fit merges them)."""
        return [k for k, start in enumerate(self.block_start) if now - start > 0]

    def launched(self, fragment: int, now: int) -> None:
        """``fragment``'s next block begins at ``now`` (its sync was launched)."""
        self.block_start[fragment] = now

    def state_dict(self) -> dict[str, Any]:
        return {"block_start": list(self.block_start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.block_start = [int(b) for b in state["block_start"]]


@dataclass
class Exchange:
    """A fragment's pseudo-gradient on its way: averaged in place into ``grad`` by ``future``."""

    fragment: int
    started_at: int  # the optimizer step after which the exchange started
    apply_at: int  # the optimizer step after which the result is applied
    grad: Tensor
    future: Future | None = None
    nonfinite: list[str] | None = None  # names whose average is not finite (set when it lands)
    contributes: bool = True  # fault tolerance: False for a replica that healed at this sync (it sends zeros)
    took_part: int = 1  # fault tolerance: replicas whose block the average holds (0: no outer step)
    healed: dict[str, Any] | None = None  # fault tolerance: the shared state received at this sync, to adopt
    launched: Tensor | None = None  # keep_local_progress: this rank's local weights of the fragment at the launch
    buffers: Tensor | None = None  # fault tolerance: the module's float buffers, averaged across replicas too
    stop: bool = False  # fault tolerance: this replica asks the run to stop (a callback, a time limit)
    planned_end: float = math.inf  # fault tolerance: the optimizer step at which this replica's limits end fit
    run_end: float = math.inf  # fault tolerance: the step at which the run ends, agreed at this sync


class BackgroundRunner:
    """One background thread for the exchanges with a delay, and on CUDA one side stream for their
    kernels, so that training kernels queued meanwhile do not wait behind the exchange's collectives
    (nor the main thread's collectives behind them)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._side_stream: torch.cuda.Stream | None = None

    def submit(self, exchange: Exchange, work: Callable[[], list[str]]) -> None:
        """Run ``work`` (the average of ``exchange.grad``, returning the names not finite) in the
        background; ``exchange.future`` holds it until :meth:`join`."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commstrats-exchange")
        grad, side = exchange.grad, None
        if grad.is_cuda:
            # it starts after the work that made ``grad``; join() brings the main stream back after it
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=grad.device)
            side = self._side_stream
            side.wait_stream(torch.cuda.current_stream(grad.device))
            # made on the main stream, used on the side one: its memory is not reused until the side
            # stream is done with it, whichever thread drops the last reference
            grad.record_stream(side)
        exchange.future = self._pool.submit(_on_stream, side, work)

    def join(self, exchange: Exchange | None, stats: CommStats) -> None:
        """Let ``exchange`` land (re-raising its failure here); the loop's wait is charged to ``stats``
        as waiting for ``"weights"`` (its collectives count as background seconds)."""
        if exchange is None or exchange.future is None:
            return
        waiting = time.perf_counter()
        try:
            exchange.nonfinite = exchange.future.result()
        finally:
            stats.record_wait("weights", time.perf_counter() - waiting)
        exchange.future = None
        if self._side_stream is not None:  # everything the thread queued is before this point
            torch.cuda.current_stream(self._side_stream.device).wait_stream(self._side_stream)

    def drain(self) -> None:
        """Wait until the thread has finished whatever it was given (an exchange dropped unjoined)."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _on_stream(stream: torch.cuda.Stream | None, work: Callable[[], list[str]]) -> list[str]:
    """The background thread's work, on ``stream`` when on CUDA."""
    if stream is None:
        return work()
    with torch.cuda.stream(stream):
        return work()
