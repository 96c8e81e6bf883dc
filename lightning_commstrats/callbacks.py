"""Communication statistics to Lightning loggers and the progress bar (CNTK's ``syncPerfStats``)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_commstrats.comm import CommSnapshot, CommStats, delta
from lightning_commstrats.sharding import format_memory, format_ranks_peaks
from lightning_commstrats.sharding.traffic import FSDP_TAGS

log = logging.getLogger(__name__)

MB = 1e6


class CommStatsMonitor(Callback):
    """Logs what each training batch cost in communication, on this rank.

    Logged every batch (subject to the Trainer's ``log_every_n_steps``), from rank 0's figures:

    - ``comm/bytes``: bytes sent in the batch; ``comm/MB`` also goes to the progress bar;
    - ``comm/seconds`` and ``comm/compute_seconds``: the seconds the training loop waited for
      communication in the batch, and the rest of its wall time (on CUDA a batch is charged the
      collectives that had completed on the device by its end, so that logging never makes the
      host wait for the device; the summaries are exact);
    - ``comm/background_seconds``: seconds collectives ran beside the loop, on other threads (a
      background exchange on the wire while the batch computed): not waiting, not in the above;
    - ``comm/calls``: collectives issued;
    - ``comm/<tag>_bytes``: the bytes split by kind of traffic (``grad``, ``weights``...).

    The summary and the saved figures are taken when fit has ended, after the strategy's own end of
    fit (the periodic schemes' final sync), so they hold every byte of the run.

    With a strategy that does not count its communication (Lightning's ``ddp``, ``fsdp``, a single
    device...), bytes and seconds in collectives are not known: it warns once and measures what it
    can itself, the optimizer steps and the wall time (``comm/wall_seconds`` per batch; the
    summary gives seconds per step), so that a config runs unchanged against ``ddp`` for comparison.

    Args:
        summary_every_n_steps: also print a one-line summary of the cumulative figures every this
            many optimizer steps (``None``: never), like CNTK's ``syncPerfStats``.
        summary_at_end: print the summary when fit ends.
        prog_bar: show MB per batch in the progress bar.
        save_dir: when set, every rank writes its cumulative figures to
            ``<save_dir>/comm_stats.rank<r>.json`` when fit ends.
    """

    def __init__(
        self,
        summary_every_n_steps: int | None = None,
        summary_at_end: bool = True,
        prog_bar: bool = True,
        save_dir: str | None = None,
    ) -> None:
        if summary_every_n_steps is not None and summary_every_n_steps <= 0:
            raise ValueError(f"summary_every_n_steps must be a positive int or None, got {summary_every_n_steps}")
        self.summary_every_n_steps = summary_every_n_steps
        self.summary_at_end = summary_at_end
        self.prog_bar = prog_bar
        self.save_dir = save_dir
        self._start: CommSnapshot | None = None
        self._last_summary_step = 0
        self._stats: CommStats | None = None  # the strategy's; None when it counts nothing (then the clock below)
        self._warned = False
        self._clock_start = 0.0
        self._steps_start = 0
        self._batch_start: float | None = None

    @staticmethod
    def stats(trainer: pl.Trainer) -> CommStats | None:
        """The strategy's communication statistics; ``None`` for a strategy that keeps none."""
        stats = getattr(trainer.strategy, "comm_stats", None)
        return stats if isinstance(stats, CommStats) else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stats = self.stats(trainer)
        if self._stats is None and stage == "fit" and not self._warned:
            self._warned = True
            rank_zero_warn(
                f"CommStatsMonitor: {type(trainer.strategy).__name__} does not count its communication, so bytes"
                " and seconds in collectives are not known; logging optimizer steps and wall time only."
                " The strategies of lightning_commstrats count them ('allreduce' is the counterpart of 'ddp')."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock_start = time.perf_counter()
        if self._stats is None:  # a resumed fit starts at its checkpoint's step
            self._steps_start = self._last_summary_step = trainer.global_step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._stats is None:
            self._batch_start = time.perf_counter()
        else:
            self._start = self._stats.snapshot(wait=False)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stats is None:
            self._own_batch_end(trainer, pl_module)
            return
        stats = self._stats
        if self._start is None:
            return
        d = delta(stats.snapshot(wait=False), self._start)
        metrics = {
            "comm/bytes": float(d.bytes_sent),
            "comm/seconds": d.comm_seconds,
            "comm/compute_seconds": d.compute_seconds,
            "comm/background_seconds": d.background_seconds,
            "comm/calls": float(d.calls),
        }
        metrics.update({f"comm/{tag}_bytes": float(c.bytes_sent) for tag, c in d.by_tag.items()})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        pl_module.log(
            "comm/MB", d.bytes_sent / MB, on_step=True, on_epoch=False, prog_bar=self.prog_bar, rank_zero_only=True
        )
        n = self.summary_every_n_steps
        if n is not None and stats.steps - self._last_summary_step >= n:
            self._last_summary_step = stats.steps
            say_beside_bar(trainer, format_summary(stats.snapshot()))

    def _own_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A strategy that counts nothing: the batch's wall seconds, and the summary from the Trainer's steps."""
        if self._batch_start is None:
            return
        seconds = time.perf_counter() - self._batch_start
        pl_module.log("comm/wall_seconds", seconds, on_step=True, on_epoch=False, rank_zero_only=True)
        n = self.summary_every_n_steps
        if n is not None and trainer.global_step - self._last_summary_step >= n:
            self._last_summary_step = trainer.global_step
            say_beside_bar(trainer, format_steps_summary(type(trainer.strategy).__name__, **self._own_figures(trainer)))

    def _own_figures(self, trainer: pl.Trainer) -> dict[str, Any]:
        return {
            "steps": trainer.global_step - self._steps_start,
            "wall_seconds": time.perf_counter() - self._clock_start,
        }

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not on_train_end: the Trainer calls the callbacks' on_train_end before the strategy's, which
        # is where the periodic schemes sync the last time.
        if self._stats is None:
            figures = self._own_figures(trainer)
            summary = format_steps_summary(type(trainer.strategy).__name__, **figures)
        else:
            memory = getattr(trainer.strategy, "memory_stats", None)
            # what the process held at its peak, as the operating system and the device count it
            process = getattr(trainer.strategy, "process_memory_stats", None)
            held = process() if memory is not None and process is not None else None
            # every rank's peaks, gathered before the counters are read: the gather's bytes are in the figures
            every = gather_process_memory(trainer, held) if memory is not None and self.summary_at_end else None
            snapshot = self._stats.snapshot()
            figures = snapshot.as_dict()
            summary = format_summary(snapshot)
            if memory is not None:  # what this rank holds, by kind, from the tensors' storages
                figures["memory"] = memory()
                if held is not None:
                    figures["process_memory"] = held
                shown = format_memory(figures["memory"], held)
                summary += f"\n[memory] rank {trainer.global_rank}: held at the end of fit: {shown}"
                if every:
                    summary += f"\n[memory] {format_ranks_peaks(every)}"
            replicas = getattr(trainer.strategy, "replica_summary", None)
            ft = replicas() if replicas is not None else None
            if ft is not None:  # a fault-tolerant replica: what it went through
                summary += f"\n{ft[0]}"
                figures["replicas"] = ft[1]
        if self.summary_at_end:
            rank_zero_info(summary)
        if self.save_dir is not None:
            out = Path(self.save_dir)
            out.mkdir(parents=True, exist_ok=True)
            record = {
                "rank": trainer.global_rank,
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
                **figures,
            }
            (out / f"comm_stats.rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


def gather_process_memory(trainer: pl.Trainer, mine: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """Collective (every rank calls it at the end of fit, as the callbacks' hooks run on every rank):
    every rank's process memory figures in rank order, or None on one rank or where the strategy does
    not measure them. Through the strategy's control channel: one small object per rank, once a fit."""
    comm = getattr(trainer.strategy, "host_comm", None)
    if mine is None or trainer.world_size == 1 or comm is None:
        return None
    return comm.all_gather_object(mine, tag="control")


def say_beside_bar(trainer: pl.Trainer, line: str) -> None:
    """Rank 0 prints ``line`` during training: through the progress bar when one is drawing (it
    clears its line, prints, and draws itself again below, instead of the line landing in the
    middle of the bar's), else to the log."""
    bar = trainer.progress_bar_callback
    if bar is not None and getattr(bar, "is_enabled", False):  # drawing: rank 0's bar only
        bar.print(line)
        return
    rank_zero_info(line)


def format_summary(s: CommSnapshot) -> str:
    """One line: steps, MB sent (per step in the steady state, the one-time setup apart), the
    seconds the loop waited for communication and its share of wall time, compute, and the seconds
    background exchanges were on the wire."""
    share = s.comm_seconds / s.wall_seconds if s.wall_seconds > 0 else 0.0
    tags = ", ".join(f"{t} {c.bytes_sent / MB:.3f} MB" for t, c in sorted(s.by_tag.items()))
    setup = f" + {s.setup_bytes / MB:.3f} MB once at setup" if s.setup_bytes else ""
    background = f"; background exchanges {s.background_seconds:.2f}s on the wire" if s.background_seconds else ""
    inside = sum(c.bytes_sent for t, c in s.by_tag.items() if t in FSDP_TAGS)
    inside_text = f", {inside / MB:.3f} MB of it FSDP2's inside the groups" if inside else ""
    across = ""
    if s.grouped:  # the slow link's share first: what a run across sites pays for
        once = s.across_setup_bytes
        once_text = f" + {once / MB:.3f} MB once at setup" if once else ""
        across = (
            f"between {s.across_label} {s.across_bytes / MB:.3f} MB ({s.across_steady_bytes_per_step / MB:.4f} MB/step"
            f"{once_text}); in all "
        )
    return (
        f"[comm] steps {s.steps}: {across}sent {s.bytes_sent / MB:.3f} MB"
        f" ({s.steady_bytes_per_step / MB:.4f} MB/step{setup}{inside_text})"
        f" in {s.calls} calls; waited {s.comm_seconds:.2f}s for communication"
        f" ({100 * share:.0f}% of wall time), compute {s.compute_seconds:.2f}s{background}"
        + (f"; by kind: {tags}" if tags else "")
    )


def format_steps_summary(strategy: str, steps: int, wall_seconds: float) -> str:
    """One line for a strategy that does not count its communication: steps and wall time only."""
    per_step = f" ({wall_seconds / steps:.4f} s/step)" if steps else ""
    return f"[comm] steps {steps}: wall {wall_seconds:.2f}s{per_step}; bytes not known ({strategy} does not count them)"
