"""One rank of the replay-against-the-reference tests (started by ``tests/harness.py`` with ``script=``).

Usage: ``reference_worker.py SPEC_JSON OUT_DIR``. SPEC is ``{"scenarios": {name: scenario}}``; each
scenario trains a small fp32 MLP (``Linear(IN, HIDDEN)``, ``tanh``, ``Linear(HIDDEN, OUT)``; mean
squared error on a fixed random regression set, split over the ranks by Lightning's distributed
sampler) with a package strategy, and this rank saves ``OUT_DIR/rank<r>.pt`` holding, per scenario,
everything :mod:`reference` needs to replay the run in one process:

- ``built``: the parameters this rank built (before fit; every rank seeds its own, so the initial
  broadcast matters unless ``same_seed``);
- ``start``: the parameters when training starts (after the strategy's set-up and initial broadcast);
- ``batches``: every batch this rank trained on, ``(x, y)`` in order;
- ``steps``: this rank's parameters after every optimizer step (after a sync of that step, if any);
- ``final``: the parameters once fit ends (after the end-of-fit synchronisation);
- ``rank``, ``world_size``, ``sync_history`` (periodic schemes: ``(fragment, started after, applied after)``).

Sharded parameters (``shard="fsdp"``) are gathered whole inside their group.

Scenario keys: ``strategy`` (registry name), ``kwargs`` (strategy arguments), ``max_steps``,
``batch_size``, ``optimizer`` (``{"name": "sgd" | "adamw", **torch arguments}``), ``seed``,
``same_seed`` (every rank builds the model from the same seed; needed with ``shard="fsdp"``, where
each rank shards its own build).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rank_env import save_and_leave
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_commstrats  # noqa: F401 - registers the names
from lightning_commstrats.sharding import is_dtensor

IN, HIDDEN, OUT = 8, 16, 4
DATA_SEED = 1234


class Regression(L.LightningModule):
    def __init__(self, optimizer: dict[str, Any], batch_size: int, samples: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
        self.optimizer_settings = dict(optimizer)
        self.batch_size, self.samples = batch_size, samples

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        settings = dict(self.optimizer_settings)
        kind = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[settings.pop("name")]
        return kind(self.parameters(), **settings)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(DATA_SEED)
        x = torch.randn(self.samples, IN, generator=g)
        y = torch.tanh(x @ torch.randn(IN, OUT, generator=g)) + 0.1 * torch.randn(self.samples, OUT, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if is_dtensor(t) else t).detach().cpu().clone()


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in module.named_parameters()}


class Record(L.Callback):
    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = params(pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        x, y = batch
        self.batches.append((x.detach().cpu().clone(), y.detach().cpu().clone()))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps.append(params(pl_module))


def run_scenario(sc: dict[str, Any], rank_hint: int, world: int) -> tuple[int, dict[str, Any]]:
    steps, batch_size = sc.get("max_steps", 8), sc.get("batch_size", 4)
    seed = sc.get("seed", 7)
    L.seed_everything(seed if sc.get("same_seed") else seed + 100 * rank_hint, verbose=False)
    model = Regression(sc.get("optimizer", {"name": "sgd", "lr": 0.1}), batch_size, steps * batch_size * world)
    built = params(model)
    strategy = L.pytorch.strategies.StrategyRegistry[sc["strategy"]]["strategy"](**sc.get("kwargs", {}))
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(model)
    return trainer.global_rank, {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "built": built,
        "start": record.start,
        "batches": record.batches,
        "steps": record.steps,
        "final": params(model),
        "sync_history": list(getattr(strategy, "sync_history", [])),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    rank_hint = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"])  # read once: a fit's teardown may leave the environment without it
    results, rank = {}, 0
    for name, sc in spec["scenarios"].items():
        rank, results[name] = run_scenario(sc, rank_hint, world)
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
