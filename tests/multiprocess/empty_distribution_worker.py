"""One rank of the test that a model built empty is the model built whole, in distribution (started by
``tests/harness.py``).

Usage: ``empty_distribution_worker.py SPEC_JSON OUT_DIR``. SPEC is ``{"scenarios": {name: scenario}}``;
scenario keys: ``strategy``, ``kwargs``, ``build`` (``"whole"`` or ``"empty"``:
``Trainer.init_module(empty_init=True)``). The model holds a layer of every kind the package and its
clients build: an ``nn.Embedding`` with ``padding_idx=0``, a ``LayerNorm``, a ``Linear``, an MoE layer
(experts and a router, a child ``Linear`` with its own std) and a buffer drawn by ``nn.init`` in
``__init__``. When training starts (after set-up and the initial broadcast) this rank saves, per scenario:

- ``dense``: every parameter that is not an expert, whole (a sharded one gathered);
- ``experts``: ``{global expert index: {name: tensor}}`` of the experts this rank holds;
- ``buffers``: every buffer; ``ep_rank``: this rank's expert-parallel rank (0 without expert parallelism).
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
from torch.utils.data import DataLoader, Dataset

import lightning_commstrats  # noqa: F401 - registers the names
from lightning_commstrats.moe import MoELayer
from lightning_commstrats.sharding import is_dtensor

VOCAB, DIM, EXPERTS, SEQ = 64, 32, 4, 8
PROJ_STD = 0.5
ROUTER_STD = 0.02


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.norm = nn.LayerNorm(DIM)
        self.lin = nn.Linear(DIM, DIM)
        self.moe = MoELayer(DIM, 2 * DIM, EXPERTS, router_init_std=ROUTER_STD)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("proj", torch.empty(DIM, DIM))
        nn.init.normal_(self.proj, std=PROJ_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(x)) @ self.proj
        h = h + self.moe(torch.tanh(self.lin(h)))
        return self.head(h)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Zoo()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Batches(Dataset):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * i + self.rank)
        tokens = torch.randint(VOCAB, (4, SEQ), generator=g)
        return tokens, tokens


class Capture(L.Callback):
    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layer = next(m for m in pl_module.modules() if isinstance(m, MoELayer))
        expert_ids = {id(p) for p in layer.experts.parameters()}
        dense = {}
        for name, p in pl_module.named_parameters():  # every rank gathers the same tensors in the same order
            if id(p) not in expert_ids:
                dense[name] = (p.full_tensor() if is_dtensor(p) else p).detach().clone()
        whole = {n: (t.full_tensor() if is_dtensor(t) else t).detach() for n, t in layer.experts.named_parameters()}
        first = layer.experts.first
        experts = {first + i: {n: t[i].clone() for n, t in whole.items()} for i in range(layer.experts.count)}
        ep_comm = getattr(trainer.strategy, "ep_comm", None)
        self.out = {
            "dense": dense,
            "experts": experts,
            "buffers": {n: b.detach().clone() for n, b in pl_module.named_buffers()},
            "ep_rank": ep_comm.rank if ep_comm is not None else 0,
        }


def run(sc: dict[str, Any], rank_hint: int) -> tuple[int, dict[str, Any]]:
    strategy = L.pytorch.strategies.StrategyRegistry[sc["strategy"]]["strategy"](**sc.get("kwargs", {}))
    capture = Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[capture],
    )
    if sc["build"] == "empty":
        with trainer.init_module(empty_init=True):
            model = Module()
    else:
        model = Module()
    trainer.fit(model, train_dataloaders=DataLoader(Batches(rank_hint), batch_size=None))
    return trainer.global_rank, capture.out


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    rank_hint = int(os.environ.get("LOCAL_RANK", "0"))
    results, rank = {}, 0
    for name, sc in spec["scenarios"].items():
        L.seed_everything(sc.get("seed", 5), verbose=False)
        rank, results[name] = run(sc, rank_hint)
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
