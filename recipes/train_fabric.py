"""Train the package's LSTM language model on Brown with a plain Lightning Fabric loop and any scheme.

    python recipes/train_fabric.py --strategy bmuf --devices 2
    python recipes/train_fabric.py --strategy diloco \
        --scheme-args '{"sync_period": 16, "sync_period_unit": "steps", "pseudo_grad_bits": 4}'
    python recipes/train_fabric.py --strategy onebit_sgd --devices 4 --max-steps 400

The loop is the one a Fabric user writes; the scheme does its exchange inside ``optimizer.step()``.
Validation runs on the model every rank agrees on (``fabric.strategy.global_model()``: the global
weights of the periodic schemes), and ``fabric.strategy.finish()`` ends the run as the Trainer ends a
fit. The communication figures come from ``fabric.strategy.comm_stats``, as with the Trainer. Both
final figures are taken after ``finish()``: a periodic scheme's last sync happens there, so the bytes
include it and the last perplexity is that of the model the run ends with.
"""

from __future__ import annotations

import argparse
import json
import math

import lightning as L
import torch

from lightning_commstrats import FabricStrategy, PeriodicSyncStrategy
from lightning_commstrats._registry import package_strategy_names, unknown_strategy_message
from lightning_commstrats.data import LMDataModule
from lightning_commstrats.models import LanguageModel
from lightning_commstrats.models.module import lm_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="diloco", help="a scheme's name: allreduce, onebit_sgd, bmuf, diloco...")
    parser.add_argument("--scheme-args", default="{}", help="the scheme's settings as JSON")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--val-every", type=int, default=40, help="optimizer steps between validations")
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=35)
    parser.add_argument("--max-vocab-size", type=int, default=10000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.strategy not in package_strategy_names():
        parser.error(unknown_strategy_message("--strategy", args.strategy, package_strategy_names()))
    return args


def validate(fabric: L.Fabric, model: torch.nn.Module, loader: torch.utils.data.DataLoader, batches: int) -> float:
    """Mean validation loss over every rank's first ``batches`` batches, on the agreed model."""
    total = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with fabric.strategy.global_model(), torch.no_grad():
        for i, (x, y) in enumerate(loader):
            if i == batches:
                break
            total += torch.tensor([lm_loss(model(x), y).item(), 1.0], dtype=torch.float64)
    model.train()
    total = fabric.all_reduce(total, reduce_op="sum")
    return float(total[0] / total[1])


def scheme_settings(args: argparse.Namespace) -> dict:
    """The scheme's settings from ``--scheme-args``; a periodic scheme given no ``sync_period`` syncs
    every ``val_every / 4`` steps, so that this short run learns between its validations (its own
    defaults, 500 steps for ``diloco``, 120,000 samples per worker for ``bmuf``, are for long runs)."""
    settings = json.loads(args.scheme_args)
    cls = L.pytorch.strategies.StrategyRegistry[args.strategy]["strategy"]
    if issubclass(cls, PeriodicSyncStrategy) and "sync_period" not in settings:
        settings["sync_period"] = max(args.val_every // 4, 1)
        if args.strategy != "local_sgd":  # local_sgd counts steps only
            settings.setdefault("sync_period_unit", "steps")
    return settings


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = scheme_settings(args)
    strategy = FabricStrategy(args.strategy, **settings)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(args.seed)

    data = LMDataModule(max_vocab_size=args.max_vocab_size, seq_len=args.seq_len, batch_size=args.batch_size)
    data.prepare_data()
    data.setup("fit")
    model = LanguageModel(
        arch="lstm", vocab_size=data.vocab_size, embed_dim=args.hidden, hidden_dim=args.hidden, tie_weights=True
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    train, val = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())

    step = 0
    while step < args.max_steps:
        for x, y in train:
            loss = lm_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.max_steps:
                break
            if step % args.val_every == 0:
                val_loss = validate(fabric, model, val, args.val_batches)
                fabric.print(f"step {step}: train loss {loss.item():.3f}, val ppl {math.exp(val_loss):.1f}")
    fabric.strategy.finish()
    fabric.print(f"{fabric.strategy!r}, {fabric.world_size} ranks: {fabric.strategy.comm_stats!r}")
    val_loss = validate(fabric, model, val, args.val_batches)
    fabric.print(f"step {step} (the final model): train loss {loss.item():.3f}, val ppl {math.exp(val_loss):.1f}")


if __name__ == "__main__":
    main()
