"""Quickstart: two CPU ranks train a small MLP with the ``allreduce`` strategy and print what
the communication cost, next to the ring all-reduce formula.

Run: ``python recipes/quickstart.py`` (Lightning starts the second rank itself), or with any
registered scheme: ``python recipes/quickstart.py --strategy allreduce --devices 2 --steps 50``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_commstrats
from lightning_commstrats import CommStatsMonitor
from lightning_commstrats._registry import is_registered_strategy, unknown_strategy_message
from lightning_commstrats.comm import wire


class Regressor(L.LightningModule):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8192, 64, generator=g)
        y = torch.sin(x[:, :8].sum(-1))
        return DataLoader(TensorDataset(x, y), batch_size=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="allreduce", help="a registered strategy name")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if not is_registered_strategy(args.strategy):
        parser.error(unknown_strategy_message("--strategy", args.strategy))

    L.seed_everything(0)
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[CommStatsMonitor(summary_every_n_steps=max(args.steps // 4, 1))],
    )
    trainer.fit(model)

    stats = trainer.strategy.comm_stats
    grad = stats.by_tag.get("grad")
    grad_per_step = grad.bytes_sent / stats.steps if grad and stats.steps else 0.0
    numel = sum(p.numel() for p in model.parameters())
    formula = wire.all_reduce_bytes(numel, 4, trainer.world_size)
    # every rank prints its own line: the bytes are per rank
    print(
        f"rank {trainer.global_rank}/{trainer.world_size} ({lightning_commstrats.__name__}, {args.strategy}):"
        f" {stats.steps} steps, {stats.bytes_sent / 1e6:.3f} MB sent in {stats.calls} calls;"
        f" gradients {grad_per_step:.0f} B/step (ring formula for {numel} fp32 values: {formula} B);"
        f" waited {stats.comm_seconds:.2f}s for communication, {stats.compute_seconds:.2f}s computing",
        flush=True,
    )


if __name__ == "__main__":
    main()
