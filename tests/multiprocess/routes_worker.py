"""One rank of the reduction-route tests: which tensors cross the slow hop, under which key, exactly or not.

Usage: ``routes_worker.py SPEC_JSON OUT_DIR`` with SPEC ``{"scenarios": {name: scenario}}``. A scenario
trains :class:`TwinMlp` (two hidden layers of one shape, one of them never used, a BatchNorm whose
statistics differ per rank) with ``strategy`` and ``kwargs`` for ``steps`` steps, and keeps:

- ``init`` and ``final``: the parameters (this rank's local shards under ``shard="fsdp"``) by name;
- ``own_buffers``: this rank's buffers as its own training left them, before the strategy's
  end-of-fit sync (a callback runs first), and ``buffers``: after it;
- with ``inject_inf`` ``[step, rank]``: an inf in the first hidden layer's gradient on that rank at
  that step, and ``hop_before``/``hop_after``: the slow hop's residuals around that step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from rank_env import save_and_leave
from torch import nn
from torch.utils.data import DataLoader

import lightning_commstrats
from lightning_commstrats.sharding import local


class TwinMlp(L.LightningModule):
    """``used`` and ``spare`` have one shape; ``spare`` is never called, so its gradient is exactly
    zero on every rank. Each rank's data is shifted by its rank, so BatchNorm statistics differ."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.used = nn.Linear(width, width)
        self.spare = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.used(torch.tanh(self.inp(x))))))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch), batch[:, :2])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(11)
        rank = self.trainer.global_rank
        data = torch.randn(256, 16, generator=g) * (1 + rank) + 2.0 * rank
        return DataLoader(data, batch_size=8, shuffle=False)


class Observe(L.Callback):
    """The buffers before the strategy's end-of-fit sync, and the slow hop's residuals around one step."""

    def __init__(self, inject: list[int] | None) -> None:
        self.inject = inject
        self.own_buffers: dict[str, torch.Tensor] = {}
        self.hop_before: dict[str, Any] = {}
        self.hop_after: dict[str, Any] = {}

    def _hop(self, trainer: L.Trainer) -> dict[str, Any]:
        hop = trainer.strategy.two_level
        return {} if hop is None else clone(hop.state_dict())

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.inject and trainer.global_step == self.inject[0]:
            self.hop_before = self._hop(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.inject and trainer.global_step == self.inject[0] + 1:
            self.hop_after = self._hop(trainer)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.inject and trainer.global_step == self.inject[0] and trainer.global_rank == self.inject[1]:
            local(pl_module.used.weight.grad).view(-1)[0] = float("inf")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.own_buffers = {k: v.detach().clone() for k, v in pl_module.named_buffers()}


def clone(value: Any) -> Any:
    return apply_to_collection(value, torch.Tensor, lambda t: t.detach().clone())


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: local(p).detach().clone() for n, p in module.named_parameters()}


def run(sc: dict[str, Any]) -> dict[str, Any]:
    L.seed_everything(3, verbose=False)
    model = TwinMlp()
    strategy = L.pytorch.strategies.StrategyRegistry[sc["strategy"]]["strategy"](**sc.get("kwargs", {}))
    observe = Observe(sc.get("inject_inf"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=sc.get("devices", 2),
        strategy=strategy,
        max_steps=sc.get("steps", 6),
        callbacks=[observe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    init: dict[str, torch.Tensor] = {}

    class Start(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            init.update(params(pl_module))

    trainer.callbacks.append(Start())
    trainer.fit(model)
    return {
        "init": init,
        "final": params(model),
        "own_buffers": observe.own_buffers,
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "hop_before": observe.hop_before,
        "hop_after": observe.hop_after,
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    assert "allreduce" in L.pytorch.strategies.StrategyRegistry, lightning_commstrats.__name__
    results = {name: run(sc) for name, sc in spec["scenarios"].items()}
    save_and_leave(results, out, torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)


if __name__ == "__main__":
    main()
