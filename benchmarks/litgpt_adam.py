"""1-bit Adam and 0/1 Adam on a third-party model: LitGPT's pythia-14m (untied embeddings, a padded
vocabulary of 50,304) on the Brown corpus at word level, 2 CPU ranks, AdamW as LitGPT pretrains
(betas 0.9/0.95, weight decay 0.1, lr 1e-3): issue 45's first report, measured again.

Needs the ``[litgpt]`` extra (``pip install -e ".[litgpt]"``, in an environment of its own if you like:
LitGPT pins its own ``jsonargparse``). One run per call; from the repository root::

    python benchmarks/litgpt_adam.py --scheme allreduce --seed 0
    python benchmarks/litgpt_adam.py --scheme onebit_adam --seed 0 --kwargs '{"freeze_step": 40}'
    python benchmarks/litgpt_adam.py --scheme onebit_adam --seed 0 \\
        --kwargs '{"freeze_step": 40, "variance_floor": 0.0, "compress_after_preconditioner": false}'

Brown's word vocabulary (49,139 words with the package's tokenizer, at most 50,304) fills the first
rows of pythia's 50,304: the rest never occur, and with untied embeddings their input rows never get a
gradient (the case the fix is for). Every scheme sees the same batches (equal samples): 2 ranks x
``--batch-size`` sequences of ``--seq-len`` words per step.

It prints one JSON line (rank 0): the mean training loss over the last 20 steps (rank 0's batches, the
issue's figure), the validation loss and perplexity on ``--val-batches`` held-out batches at the end,
rank 0's bytes sent over the run and per step after ``--freeze`` (the schemes' ``comm_stats``), and the
warnings the strategy gave.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from common import quiet_trainer
from train_litgpt import LitGPTModule
from variance_settling import VarianceSettling

import lightning_commstrats  # noqa: F401  (registers the strategies)
from lightning_commstrats.data import LMDataModule


class Evaluated(LitGPTModule):
    """LitGPT's module with a validation loss."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("val_loss", loss, sync_dist=True)


class Bytes(L.Callback):
    """Rank 0's bytes sent when step ``at`` ends and at the end of training."""

    def __init__(self, at: int) -> None:
        self.at, self.at_freeze = at, None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.at_freeze = trainer.strategy.comm_stats.bytes_sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="allreduce")
    parser.add_argument("--kwargs", default="{}", help="the strategy's settings, as JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="pythia-14m")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--freeze", type=int, default=40, help="the step after which bytes are counted apart")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--settling", action="store_true", help="print how sqrt(v) settles every 10 steps")
    args = parser.parse_args()

    L.seed_everything(args.seed, verbose=False)
    data = LMDataModule(max_vocab_size=50304, seq_len=args.seq_len, batch_size=args.batch_size)
    module = Evaluated(args.model, lr=args.lr, block_size=args.seq_len)
    module.init_weights()  # LitGPT's pretraining initialisation (every rank alike: the same seed)
    strategy = L.pytorch.strategies.StrategyRegistry[args.scheme]["strategy"](**json.loads(args.kwargs))
    counter = Bytes(args.freeze)
    trainer = quiet_trainer(
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=-1,
        limit_val_batches=args.val_batches,
        val_check_interval=args.steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[counter, *([VarianceSettling()] if args.settling else [])],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    if trainer.global_rank != 0:
        return
    val = float(trainer.callback_metrics["val_loss"])
    total = strategy.comm_stats.bytes_sent
    after = None if counter.at_freeze is None else (total - counter.at_freeze) / (args.steps - args.freeze)
    said = [str(w.message)[:160] for w in caught if "commstrats" in str(w.filename) or "adam" in str(w.message)]
    print(
        json.dumps(
            {
                "scheme": args.scheme,
                "kwargs": json.loads(args.kwargs),
                "seed": args.seed,
                "vocabulary": data.vocab_size,
                "train_loss_last20": sum(module.losses[-20:]) / len(module.losses[-20:]),
                "val_loss": val,
                "val_ppl": math.exp(val),
                "bytes_run": total,
                "bytes_per_step_after_freeze": after,
                "warnings": said,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
