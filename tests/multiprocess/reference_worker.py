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
each rank shards its own build), ``inject_inf`` (``[step, rank, name]``: rank ``rank``'s gradient of
parameter ``name`` at optimizer step ``step``, 0-based, gets an inf as its first value, after backward
and before the strategy's exchange), ``ckpt_every`` (a Lightning checkpoint every that many optimizer
steps, ``OUT_DIR/<scenario>/step=<s>.ckpt``), ``resume`` (``[scenario, step]``: fit starts from that
checkpoint of an earlier scenario of the same spec; ``start`` is then the checkpoint's model, the
global one for a periodic scheme), ``epoch_steps`` (the data set holds that many steps of every rank's
batches, default ``max_steps``: a run resumed from a checkpoint taken at the end of an epoch trains on
the batches the uninterrupted run trained on, whether or not Lightning replays an epoch it resumes
inside).
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


class InjectInf(L.Callback):
    """An inf as the first value of one parameter's gradient, on one rank at one optimizer step."""

    def __init__(self, step: int, rank: int, name: str) -> None:
        self.step, self.rank, self.name = step, rank, name

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            grad = dict(pl_module.named_parameters())[self.name].grad
            assert grad is not None
            grad.view(-1)[0] = float("inf")


def run_scenario(name: str, sc: dict[str, Any], rank_hint: int, world: int, out: Path) -> tuple[int, dict[str, Any]]:
    steps, batch_size = sc.get("max_steps", 8), sc.get("batch_size", 4)
    seed = sc.get("seed", 7)
    L.seed_everything(seed if sc.get("same_seed") else seed + 100 * rank_hint, verbose=False)
    epoch = sc.get("epoch_steps") or steps  # optimizer steps per epoch
    model = Regression(sc.get("optimizer", {"name": "sgd", "lr": 0.1}), batch_size, epoch * batch_size * world)
    built = params(model)
    strategy = L.pytorch.strategies.StrategyRegistry[sc["strategy"]]["strategy"](**sc.get("kwargs", {}))
    record = Record()
    callbacks: list[L.Callback] = [record]
    if sc.get("inject_inf"):
        callbacks.append(InjectInf(*sc["inject_inf"]))
    if sc.get("ckpt_every"):
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=out / name, filename="{step}", every_n_train_steps=sc["ckpt_every"], save_top_k=-1
            )
        )
    ckpt_path = None
    if sc.get("resume"):
        source, step = sc["resume"]
        ckpt_path = out / source / f"step={step}.ckpt"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(sc.get("ckpt_every")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
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
        rank, results[name] = run_scenario(name, sc, rank_hint, world, out)
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
