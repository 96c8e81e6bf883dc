"""A callback the recipe tests add to a launched run to read its end state without the recipe's help.

Each rank writes ``<out>/rank<r>.json``: its strategy's ``comm_stats`` counters read straight from the
strategy before the strategy's end of fit (``before``: the Trainer calls callbacks' ``on_train_end``
first) and once fit is over (``after``); rank 0 also saves the model it ends with, ``model.pt``.
"""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch


class FinalStateProbe(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.before: dict[str, int] = {}

    @staticmethod
    def counters(trainer: pl.Trainer) -> dict[str, int]:
        stats = trainer.strategy.comm_stats
        return {"bytes_sent": stats.bytes_sent, "calls": stats.calls, "steps": stats.steps}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = self.counters(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"before": self.before, "after": self.counters(trainer)}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
        if trainer.global_rank == 0:
            state = {k: v.detach().cpu() for k, v in pl_module.state_dict().items()}
            torch.save({"hparams": dict(pl_module.hparams), "state_dict": state}, self.out / "model.pt")
