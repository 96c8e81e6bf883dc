"""One rank of ``test_noise_scale_ranks.py`` (started by ``tests/harness.py``).

Usage: ``noise_scale_worker.py SPEC_JSON OUT_DIR``. SPEC is ``{"scenarios": {name: scenario}}`` with
keys ``strategy`` (a registry name), ``kwargs`` (its arguments), ``callback`` (``GradientNoiseScale``
arguments), ``max_steps``, ``batch_size`` (per rank, at the start), ``samples`` (dataset size),
``accumulate`` and ``optimizer`` ("sgd", the default, or "adam"). Each rank saves
``OUT_DIR/rank<r>.pt`` holding, per scenario and optimizer step, its own gradient before the exchange
(``own``), the gradient the optimizer stepped on (``averaged``), what the callbacks logged
during the step (``logged``), the size of every batch it trained on (``batches``) and the steps the callback
measured (``measured``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rank_env import save_and_leave
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_commstrats
from lightning_commstrats.batching.noise_scale import GradientNoiseScale


class Regression(L.LightningModule):
    """A two-layer net fitting a noisy linear target: gradients with both signal and noise."""

    def __init__(self, batch_size: int, samples: int, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.batch_size, self.samples, self.optimizer = batch_size, samples, optimizer
        self.batches: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.batches.append(len(x))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(11)
        x = torch.randn(self.samples, 8, generator=g)
        y = x @ torch.linspace(-1, 1, 8)[:, None] + 0.5 * torch.randn(self.samples, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True)


class Record(L.Callback):
    """Per optimizer step: this rank's gradient as the optimizer sees it (None where a scheme took its
    step at the exchange and cleared it), and what was logged."""

    def __init__(self) -> None:
        self.averaged: list[dict[str, torch.Tensor]] = []
        self.logged: list[dict[str, float]] = []
        self._step: dict[str, float] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # what is logged during the step itself (the trainer's callback_metrics keeps the last
        # value of a name the step did not log)
        log = pl_module.log

        def recorded(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if name.startswith("train/"):
                self._step[name] = float(value)
            log(name, value, *args, **kwargs)

        pl_module.log = recorded

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.averaged.append(
            {n: None if p.grad is None else p.grad.detach().clone() for n, p in pl_module.named_parameters()}
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return
        self.logged.append(self._step)
        self._step = {}


def run_scenario(sc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    L.seed_everything(sc.get("seed", 7), verbose=False)
    model = Regression(sc.get("batch_size", 4), sc.get("samples", 256), sc.get("optimizer", "sgd"))
    strategy = L.pytorch.strategies.StrategyRegistry[sc["strategy"]]["strategy"](**sc.get("kwargs", {}))
    own: list[dict[str, torch.Tensor]] = []
    after_backward = strategy.after_backward

    def recorded(optimizer: Any) -> None:  # this rank's gradient before any exchange
        own.append({n: p.grad.detach().clone() for n, p in strategy.lightning_module.named_parameters()})
        after_backward(optimizer)

    strategy.after_backward = recorded
    noise = GradientNoiseScale(**sc.get("callback", {}))
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=sc.get("max_steps", 6),
        accumulate_grad_batches=sc.get("accumulate", 1),
        callbacks=[noise, record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    result = {
        "own": own,
        "averaged": record.averaged,
        "logged": record.logged,
        "batches": model.batches,
        "mode": noise.mode,
        "measured": noise.estimator.steps,
        "stats": trainer.strategy.comm_stats.snapshot().as_dict(),
    }
    return trainer.global_rank, result


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    assert lightning_commstrats.__name__
    results = {}
    rank = 0
    for name, scenario in spec["scenarios"].items():
        rank, results[name] = run_scenario(scenario)
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
