"""How many values of a pseudo-gradient travel: a density schedule for SparseLoCo's tiles, and the dense
statistical codec (every value, in 2 bits on the published statistical grid, with error feedback).

With few syncs, sparse error feedback never delivers most of the progress: at 64 of 4096 values per
tile a value waits on average 64 syncs for its turn, and a run of 192 steps at ``H = 16`` has 12.
Issue #36 measured an independent implementation of the published form on the recipe's LSTM (4 ranks,
12 syncs) at perplexity 300.7 keeping 64 values per tile, 181.3 keeping 512 and 151.9 keeping every
value (fp32 DiLoCo: 153.0). Two ways to use that:

- :class:`DensitySchedule`: the values kept per tile follow the number of syncs that have run, dense
  first and sparser later (``"geometric"``: every value at the first sync, then a quarter as many at
  each sync down to the final ``k``; ``"run"``: the same steps, each held for longer on a longer
  run, so that the denser steps take the first quarter of the syncs the run will have), or an
  explicit list. Every rank computes the same ``k`` from the same count, so the payloads of a sync
  have the same size on every rank and a plain all-gather carries them; their size changes from one
  sync to the next, and each sync is charged what it sent.
- :class:`StatisticalAllGather`: every value of every tensor in ``bits`` bits on the statistical grid
  of :class:`~lightning_commstrats.compression.sparse_tiles.StatisticalQuantizer` (``2^bits`` bins over
  ``sigmas`` standard deviations around the tensor's mean, each decoded as the mean of its values: a
  lookup of ``2^bits`` float32 per tensor), with decayed error feedback ``e = beta e + G``,
  ``e -= Q(e)``; all-gathered (every rank's lookup differs, so codes do not add up in an all-reduce).
  It is the published form with every tile kept whole, which sends no positions. Wire: per rank and
  sync ``16 T + ceil(2 n / 8)`` bytes at 2 bits for ``T`` tensors of ``n`` values in all, 16 times
  fewer than float32.

No Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.sparse_tiles import TiledSparseAllGather

SCHEDULES = ("geometric", "run")
STATISTICAL_BITS = (2, 4, 8)
SHRINK = 4  # the kept count falls by this factor at each step of a named schedule


def check_schedule(schedule: object, final: int, full: int, *, name: str = "topk_schedule") -> None:
    """Construction-time checks of a density schedule: ``None``, one of :data:`SCHEDULES`, or a non-empty
    list of ints in ``[1, full]`` (values kept per tile at the first syncs); ``final`` is the kept count
    the schedule ends at, ``full`` a whole tile's values."""
    if schedule is None or schedule in SCHEDULES:
        return
    if isinstance(schedule, str):
        raise ValueError(
            f"{name}={schedule!r} is not supported; choose one of {SCHEDULES}, a list of values kept per tile"
            " at the first syncs, or None"
        )
    if (
        not isinstance(schedule, Sequence)
        or not schedule
        or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= full for k in schedule)
    ):
        raise ValueError(
            f"{name} must be None, one of {SCHEDULES}, or a non-empty list of ints in [1, {full}] (values kept"
            f" per tile at the first syncs, then {final}), got {schedule!r}"
        )


class DensitySchedule:
    """The values kept per tile at each sync.

    Args:
        schedule: ``None`` (``final`` at every sync); ``"geometric"`` (``max(final, full / 4^p)`` at sync
            ``p``: every value first, then a quarter as many each sync); ``"run"`` (the same steps, each
            held for ``max(1, S // (4 m))`` syncs, where ``S`` is the number of syncs the run will have
            and ``m`` the number of steps above ``final``: the denser steps take the first quarter of
            the run); or a list ``[k_0, k_1, ...]`` (``k_p`` at sync ``p``, then ``final``).
        final: the kept count after the schedule (``topk_per_chunk``).
        full: the values of a whole tile (``topk_tile^2``).
    """

    def __init__(self, schedule: str | Sequence[int] | None, final: int, full: int) -> None:
        check_schedule(schedule, final, full)
        self.schedule = schedule if schedule is None or isinstance(schedule, str) else [int(k) for k in schedule]
        self.final, self.full = final, full
        self.steps = 0  # steps of the named schedules above ``final``
        k = full
        while k > final:
            self.steps += 1
            k //= SHRINK

    def hold(self, run_syncs: float | None) -> int:
        """Syncs each step of the schedule lasts (1 but for ``"run"`` on a run of known length)."""
        if self.schedule != "run" or run_syncs is None or not math.isfinite(run_syncs) or not self.steps:
            return 1
        return max(1, int(run_syncs) // (SHRINK * self.steps))

    def kept(self, sync: int, run_syncs: float | None = None) -> int:
        """Values kept per tile at sync ``sync`` (0: the first) of a run of ``run_syncs`` syncs (``None``:
        not known)."""
        if self.schedule is None:
            return self.final
        if isinstance(self.schedule, list):
            return self.schedule[sync] if sync < len(self.schedule) else self.final
        step = sync // self.hold(run_syncs)
        return max(self.final, self.full // SHRINK**step) if step < 64 else self.final

    def dense_syncs(self, run_syncs: float | None = None) -> int:
        """How many of the first syncs keep more than ``final`` (0 without a schedule)."""
        if self.schedule is None:
            return 0
        if isinstance(self.schedule, list):
            return sum(1 for k in self.schedule if k > self.final)
        return self.steps * self.hold(run_syncs)


class StatisticalAllGather(TiledSparseAllGather):
    """Average named tensors over ranks from every value of each rank's error feedback in ``bits`` bits on
    the statistical grid with a per-tensor lookup (see the module docstring): the dense 2-bit codec.

    Args:
        comm: the ranks' communicator.
        bits: 2 (default), 4 or 8.
        sigmas: the grid's width in standard deviations (6).
        tag: the traffic tag for :class:`~lightning_commstrats.comm.CommStats`.
        decay: ``beta``, the error-feedback decay (0.95 takes the place of outer momentum, as in
            SparseLoCo; 1: plain error feedback).
        tile: how the tensors are cut in memory; every tile is kept whole, so it changes neither the
            values nor the bytes (64).
    """

    form = "statistical"  # a checkpoint's error feedback names it: the sparse forms refuse it

    def __init__(
        self,
        comm: Communicator,
        *,
        bits: int = 2,
        sigmas: float = 6.0,
        tag: str = "weights_statistical",
        decay: float = 1.0,
        tile: int = 64,
    ) -> None:
        if isinstance(bits, bool) or bits not in STATISTICAL_BITS:
            raise ValueError(
                f"bits={bits!r} is not supported by the statistical codec; choose one of {STATISTICAL_BITS}"
            )
        super().__init__(comm, tile=tile, k=tile * tile, bits=bits, sigmas=sigmas, tag=tag, decay=decay)
