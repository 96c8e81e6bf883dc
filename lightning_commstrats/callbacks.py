"""Communication statistics to Lightning loggers and the progress bar (CNTK's ``syncPerfStats``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_commstrats.comm import CommSnapshot, CommStats, delta

log = logging.getLogger(__name__)

MB = 1e6


class CommStatsMonitor(Callback):
    """Logs what each training batch cost in communication, on this rank.

    Logged every batch (subject to the Trainer's ``log_every_n_steps``), from rank 0's figures:

    - ``comm/bytes``: bytes sent in the batch; ``comm/MB`` also goes to the progress bar;
    - ``comm/seconds`` and ``comm/compute_seconds``: time inside collectives and the rest (on
      CUDA a batch is charged the collectives that had completed on the device by its end, so that
      logging never makes the host wait for the device; the summaries are exact);
    - ``comm/calls``: collectives issued;
    - ``comm/<tag>_bytes``: the bytes split by kind of traffic (``grad``, ``weights``...).

    Args:
        summary_every_n_steps: also print a one-line summary of the cumulative figures every this
            many optimizer steps (``None``: never), like CNTK's ``syncPerfStats``.
        summary_at_end: print the summary when training ends.
        prog_bar: show MB per batch in the progress bar.
        save_dir: when set, every rank writes its cumulative figures to
            ``<save_dir>/comm_stats.rank<r>.json`` when training ends.
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

    @staticmethod
    def stats(trainer: pl.Trainer) -> CommStats:
        stats = getattr(trainer.strategy, "comm_stats", None)
        if not isinstance(stats, CommStats):
            raise ValueError(
                f"CommStatsMonitor needs a lightning_commstrats strategy, got {type(trainer.strategy).__name__}"
            )
        return stats

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.stats(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = self.stats(trainer).snapshot(wait=False)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = self.stats(trainer)
        if self._start is None:
            return
        d = delta(stats.snapshot(wait=False), self._start)
        metrics = {
            "comm/bytes": float(d.bytes_sent),
            "comm/seconds": d.comm_seconds,
            "comm/compute_seconds": d.compute_seconds,
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
            rank_zero_info(format_summary(stats.snapshot()))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        snapshot = self.stats(trainer).snapshot()
        if self.summary_at_end:
            rank_zero_info(format_summary(snapshot))
        if self.save_dir is not None:
            out = Path(self.save_dir)
            out.mkdir(parents=True, exist_ok=True)
            record = {
                "rank": trainer.global_rank,
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
                **snapshot.as_dict(),
            }
            (out / f"comm_stats.rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


def format_summary(s: CommSnapshot) -> str:
    """One line: steps, MB sent, MB per step, seconds in communication and in compute."""
    share = s.comm_seconds / s.wall_seconds if s.wall_seconds > 0 else 0.0
    tags = ", ".join(f"{t} {c.bytes_sent / MB:.3f} MB" for t, c in sorted(s.by_tag.items()))
    return (
        f"[comm] steps {s.steps}: sent {s.bytes_sent / MB:.3f} MB ({s.bytes_per_step / MB:.4f} MB/step)"
        f" in {s.calls} calls; comm {s.comm_seconds:.2f}s, compute {s.compute_seconds:.2f}s"
        f" ({100 * share:.0f}% of wall time in communication)" + (f"; by kind: {tags}" if tags else "")
    )
