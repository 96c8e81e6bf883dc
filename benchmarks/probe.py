"""A callback that records what the benchmarks measure, for any strategy (this package's or not).

Per rank it writes ``<out>/probe.rank<r>.json`` when training ends: the wall time of every training
batch, the validation perplexity with the samples and wall seconds at which it was measured, the
bytes the network interface sent during training (the kernel's ``tx_bytes`` counter of
``$BENCH_IFACE``, default ``eth0`` inside an emulated host, ``lo`` otherwise), and, under this
package's strategies, the ``comm_stats`` figures.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L


def tx_bytes(iface: str) -> int | None:
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except OSError:
        return None


class BenchProbe(L.Callback):
    """Step times, validation curve, interface bytes and communication statistics of one rank.

    Args:
        out: folder for ``probe.rank<r>.json``.
        samples_per_step: samples per optimizer step over all ranks, for the perplexity-vs-samples curve.
    """

    def __init__(self, out: str, samples_per_step: int = 0) -> None:
        self.out = out
        self.samples_per_step = samples_per_step
        self.iface = os.environ.get("BENCH_IFACE", "eth0" if Path("/sys/class/net/eth0").exists() else "lo")
        self.step_seconds: list[float] = []
        self.curve: list[dict[str, float]] = []
        self._t0 = 0.0
        self._batch_start = 0.0
        self._tx0: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = time.perf_counter()
        self._tx0 = tx_bytes(self.iface)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.step_seconds.append(time.perf_counter() - self._batch_start)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ppl = trainer.callback_metrics.get("val/ppl")
        if ppl is None or trainer.sanity_checking:
            return
        self.curve.append(
            {
                "step": trainer.global_step,
                "samples": trainer.global_step * self.samples_per_step,
                "wall_seconds": time.perf_counter() - self._t0,
                "val_ppl": float(ppl),
            }
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tx = tx_bytes(self.iface)
        stats = getattr(trainer.strategy, "comm_stats", None)
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "steps": trainer.global_step,
            "train_seconds": time.perf_counter() - self._t0,
            "step_seconds": self.step_seconds,
            "curve": self.curve,
            "iface": self.iface,
            "tx_bytes": None if tx is None or self._tx0 is None else tx - self._tx0,
            "comm_stats": None if stats is None else stats.snapshot().as_dict(),
            "param_shapes": [list(p.shape) for p in {id(p): p for p in pl_module.parameters()}.values()],
        }
        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"probe.rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
