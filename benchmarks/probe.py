"""A callback that records what the benchmarks measure, for any strategy (this package's or not), and
that ends a run when it wins or loses the race.

Per rank it writes ``<out>/probe.rank<r>.json`` when training ends: the wall time of every training
batch, the validation perplexity with the samples, training seconds and wall seconds at which it was
measured, the bytes the network interface sent during training (the kernel's ``tx_bytes`` counter
of ``$BENCH_IFACE``, default ``eth0`` inside an emulated host, ``lo`` otherwise), and, under this
package's strategies, the ``comm_stats`` figures.

Training time excludes validation: the clock runs from the end of one training batch to the end of
the next, and the stretch from the last batch before a validation to the end of that validation
(the stop decision included) is booked as validation time. A background exchange still in flight
when a validation is due is waited for before that batch ends, so its time and bytes count as
training (the overlap it gets is only with training compute). Bytes and ``comm_stats`` sent during
validation (metric synchronisation, the decision broadcast) are booked there too, so the figures
per step are those of training alone.

The race: with ``target_ppl`` and/or ``budget_seconds``, rank 0 decides after every validation
whether the run is over (validation perplexity at or below the target, or training seconds at or
past the budget), broadcasts the decision through ``trainer.strategy.broadcast`` (torch.distributed
under Lightning's ``ddp`` and the torch-hook peers, this package's communicator under its
strategies) and every rank sets ``trainer.should_stop``. Deciding on one rank and broadcasting is
what keeps a multi-rank job from hanging: a rank that stopped alone would leave the others waiting
in their next collective. The decision is taken only at validations, so a run overshoots the budget
by at most ``val_check_interval`` steps.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import lightning as L

# comm_stats counters booked per phase (training vs validation)
_COUNTERS = ("bytes_sent", "calls", "comm_seconds")


def tx_bytes(iface: str) -> int | None:
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except OSError:
        return None


class BenchProbe(L.Callback):
    """Step times, validation curve, interface bytes, communication statistics and the race's stop.

    Args:
        out: folder for ``probe.rank<r>.json``.
        samples_per_step: samples per optimizer step over all ranks, for the perplexity-vs-samples curve.
        target_ppl: stop once the validation perplexity is at or below this (default None: no target).
        budget_seconds: stop at the first validation at or past this many training seconds
            (validation excluded; default None: no budget).
    """

    def __init__(
        self,
        out: str,
        samples_per_step: int = 0,
        target_ppl: float | None = None,
        budget_seconds: float | None = None,
    ) -> None:
        if target_ppl is not None and not target_ppl > 0:
            raise ValueError(f"target_ppl must be > 0, got {target_ppl}")
        if budget_seconds is not None and not budget_seconds > 0:
            raise ValueError(f"budget_seconds must be > 0, got {budget_seconds}")
        self.out = out
        self.samples_per_step = samples_per_step
        self.target_ppl = target_ppl
        self.budget_seconds = budget_seconds
        self.iface = os.environ.get("BENCH_IFACE", "eth0" if Path("/sys/class/net/eth0").exists() else "lo")
        self.step_seconds: list[float] = []
        self.curve: list[dict[str, float]] = []
        self.stop_reason: str | None = None
        self.train_seconds = 0.0
        self.val_seconds = 0.0
        self._t0 = 0.0
        self._mark = 0.0
        self._batch_start = 0.0
        self._tx0: int | None = None
        self._tx_val = 0
        self._tx_val_start: int | None = None
        self._cs0: dict[str, float] = {}
        self._cs_val = dict.fromkeys(_COUNTERS, 0.0)
        self._cs_val_start: dict[str, float] = {}

    def _comm(self, trainer: L.Trainer) -> dict[str, float]:
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is None:
            return {}
        snap = stats.snapshot().as_dict()
        return {k: snap[k] for k in _COUNTERS}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = self._mark = time.perf_counter()
        self._t0_unix = time.time()  # to place training on a clock read outside the job (switch counters)
        self._tx0 = tx_bytes(self.iface)
        self._cs0 = self._comm(trainer)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        every = getattr(trainer, "val_check_batch", None)
        if isinstance(every, (int, float)) and math.isfinite(every) and trainer.global_step % max(int(every), 1) == 0:
            # A validation follows. An exchange still running in the background (streaming_diloco)
            # would finish during it, its seconds and bytes booked to validation: wait for it here,
            # so that it counts as training and never hides behind the validation pause.
            wait = getattr(trainer.strategy, "wait_for_exchange", None)
            if wait is not None:
                wait()
        now = time.perf_counter()
        self.step_seconds.append(now - self._batch_start)
        self.train_seconds += now - self._mark
        self._mark = now

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._tx_val_start = tx_bytes(self.iface)
        self._cs_val_start = self._comm(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        ppl = trainer.callback_metrics.get("val/ppl")
        if ppl is not None:
            self.curve.append(
                {
                    "step": trainer.global_step,
                    "samples": trainer.global_step * self.samples_per_step,
                    "train_seconds": self.train_seconds,
                    "wall_seconds": time.perf_counter() - self._t0,
                    "val_ppl": float(ppl),
                }
            )
        if self.target_ppl is not None or self.budget_seconds is not None:
            decision = self._decide(ppl) if trainer.global_rank == 0 else None
            decision = trainer.strategy.broadcast(decision, 0)
            if decision is not None:
                self.stop_reason = decision
                trainer.should_stop = True
        now = time.perf_counter()
        self.val_seconds += now - self._mark
        self._mark = now
        tx = tx_bytes(self.iface)
        if tx is not None and self._tx_val_start is not None:
            self._tx_val += tx - self._tx_val_start
        cs = self._comm(trainer)
        for k in cs:
            self._cs_val[k] += cs[k] - self._cs_val_start.get(k, cs[k])

    def _decide(self, ppl: Any) -> str | None:
        if self.target_ppl is not None and ppl is not None and float(ppl) <= self.target_ppl:
            return "target"
        if self.budget_seconds is not None and self.train_seconds >= self.budget_seconds:
            return "budget"
        return None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tx = tx_bytes(self.iface)
        stats = getattr(trainer.strategy, "comm_stats", None)
        cs = self._comm(trainer)
        training_comm = {k: cs[k] - self._cs0.get(k, 0.0) - self._cs_val[k] for k in cs} if cs else None
        # the plain-torch peers that time their own collectives (peers.DiLoCoDDP) expose comm_seconds
        peer_comm = None if stats is not None else getattr(trainer.strategy, "comm_seconds", None)
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "steps": trainer.global_step,
            "stop_reason": self.stop_reason or ("max_steps" if trainer.global_step >= trainer.max_steps > 0 else None),
            "target_ppl": self.target_ppl,
            "budget_seconds": self.budget_seconds,
            "train_seconds": self.train_seconds,
            "val_seconds": self.val_seconds,
            "wall_seconds": time.perf_counter() - self._t0,
            "train_start_unix": self._t0_unix,
            "step_seconds": self.step_seconds,
            "curve": self.curve,
            "iface": self.iface,
            "tx_bytes": None if tx is None or self._tx0 is None else tx - self._tx0 - self._tx_val,
            "tx_bytes_validation": self._tx_val,
            "training_comm": training_comm,
            "peer_comm_seconds": peer_comm,
            "peer_syncs": None if stats is not None else getattr(trainer.strategy, "syncs", None),
            "comm_stats": None if stats is None else stats.snapshot().as_dict(),
            "param_shapes": [list(p.shape) for p in {id(p): p for p in pl_module.parameters()}.values()],
        }
        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"probe.rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
