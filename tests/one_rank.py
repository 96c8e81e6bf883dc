"""One-rank fits shared by the Adam schemes' tests: a model whose optimizer the test makes, and the
Trainer that fits it on the CPU without logging, checkpoints or validation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel


class Optimized(BoringModel):
    """Lightning's boring model with the optimizer ``make(parameters)``."""

    def __init__(self, make: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self.parameters())


def one_rank_trainer(strategy: Any, steps: int) -> L.Trainer:
    """A CPU Trainer of one device that runs ``steps`` optimizer steps with ``strategy``."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
