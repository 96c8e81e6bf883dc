"""One rank of the Fabric front end's tests (started by ``tests/harness.py``).

Usage: ``fabric_worker.py SPEC_JSON OUT_DIR``. Each scenario trains the same two-layer regression
(fixed data, the same initial weights) either with the Trainer (``"front": "trainer"``) or with a
plain Fabric loop (``"front": "fabric"``), and this rank saves ``OUT_DIR/rank<r>.pt`` with, per
scenario, the final parameters, the communication statistics and the losses.

Scenario keys: ``front``, ``strategy`` (a registry name), ``kwargs`` (its settings), ``instance``
(Fabric only: pass ``FabricStrategy(<class>(**kwargs))`` instead of the name), ``max_steps``,
``save_at`` (Fabric: ``fabric.save`` at that step, to ``OUT_DIR/<scenario>.ckpt``), ``resume``
(Fabric: ``[scenario, step]``, load that scenario's checkpoint and go on from that step),
``finish`` (Fabric: call ``fabric.strategy.finish()`` at the end, default true), ``evaluate``
(Fabric: the flat weights seen inside ``fabric.strategy.global_model()`` at the end, before finish).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_commstrats
from lightning_commstrats.comm import destroy_process_group
from lightning_commstrats.fabric import FabricStrategy, scheme_class


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 32, generator=g)
    return TensorDataset(x, x[:, :2].tanh())


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 2))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(), batch_size=4, shuffle=False)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def run_trainer(sc: dict[str, Any]) -> dict[str, Any]:
    L.seed_everything(7, verbose=False)
    model = Regression()
    strategy = scheme_class(sc["strategy"])(**sc.get("kwargs", {}))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=sc.get("max_steps", 8),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model)
    return {
        "rank": trainer.global_rank,
        "params": flat(model),
        "losses": model.losses,
        "stats": strategy.comm_stats.snapshot().as_dict(),
    }


def run_fabric(name: str, sc: dict[str, Any], out: Path) -> dict[str, Any]:
    L.seed_everything(7, verbose=False)
    model = Regression()
    kwargs = sc.get("kwargs", {})
    strategy: Any = FabricStrategy(scheme_class(sc["strategy"])(**kwargs)) if sc.get("instance") else sc["strategy"]
    if not sc.get("instance") and kwargs:
        strategy = FabricStrategy(sc["strategy"], **kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    # the Trainer always shuffles a training set's distributed sampler (seeded by the global seed):
    # so does this loop, for the same batches
    loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=4, shuffle=True))
    start = 0
    if sc.get("resume"):
        source, start = sc["resume"]
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(out / f"{source}.ckpt", state)
        assert state["step"] == start, state["step"]
    losses = []
    result: dict[str, Any] = {"rank": fabric.global_rank}
    for step, (x, y) in enumerate(loader):
        if step < start:
            continue
        if step == sc.get("max_steps", 8):
            break
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == sc.get("save_at"):
            fabric.save(out / f"{name}.ckpt", {"model": model, "optimizer": optimizer, "step": step + 1})
            result["files"] = sorted(p.name for p in out.glob(f"{name}.ckpt*"))
    if sc.get("evaluate"):
        result["local"] = flat(model)
        with fabric.strategy.global_model():
            result["evaluated"] = flat(model)
        result["after_evaluation"] = flat(model)
    if sc.get("finish", True):
        fabric.strategy.finish()
    result.update(
        params=flat(model),
        losses=losses,
        stats=fabric.strategy.comm_stats.snapshot().as_dict(),
        strategy=repr(fabric.strategy),
    )
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    assert "bmuf" in L.fabric.strategies.STRATEGY_REGISTRY, lightning_commstrats.__name__
    results = {}
    rank = 0
    # one process group for every scenario, as Lightning keeps it between fits (the Trainer and Fabric
    # both find it initialised): destroying it between scenarios and making a new one on the same
    # port hung about one full-suite run in four (rank 0 never reached the next scenario's first
    # collective, where its peer waited)
    for name, sc in spec["scenarios"].items():
        result = run_trainer(sc) if sc["front"] == "trainer" else run_fabric(name, sc, out)
        rank = result["rank"]
        results[name] = result
    torch.save(results, out / f"rank{rank}.pt")
    destroy_process_group()


if __name__ == "__main__":
    main()
