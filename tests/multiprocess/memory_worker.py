"""One rank of the advisor's memory check (started by ``tests/harness.py``).

Usage: ``memory_worker.py SPEC_JSON OUT_DIR``. SPEC is ``{"scenarios": {name: [registry name, kwargs]},
"steps": N}`` and optionally ``"accelerator"`` (``"cpu"``, or ``"cuda"``: every rank on GPU 0, started as
one rank per node, ``num_nodes=2``); each scenario trains a small MLP (AdamW) for ``steps`` optimizer
steps on two ranks, and after every optimizer step this rank records the bytes its strategy holds, by
device, counted two ways:

- ``stats``: ``strategy.memory_stats()`` (the package's own accounting, by kind);
- ``walked``: every tensor reachable from the strategy object (through the package's objects, dicts,
  lists and optimizers, not through the module), each storage once, less the storages of the
  parameters, their gradients and the inner optimizers' state. It knows nothing of what a scheme
  keeps where, so it also checks that ``memory_stats()`` misses nothing.

Saves ``OUT_DIR/rank<r>.pt``: per scenario, the records and this rank's local parameter shapes.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rank_env import save_and_leave
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_commstrats  # noqa: F401 - registers the strategy names
from lightning_commstrats.sharding import local


class Shapes(L.LightningModule):
    """Two matrices above the 1024 values a quantized exchange needs, one below, three biases."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(30, 50), nn.Tanh(), nn.Linear(50, 33), nn.Tanh(), nn.Linear(33, 4))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 30, generator=g), torch.randn(64, 4, generator=g))
        return DataLoader(data, batch_size=4)


# Not scheme state: the SIGTERM agreement's 4-byte flag, which every strategy holds alike.
SKIPPED = ("stop_agreement",)


def _key(t: Tensor) -> tuple[str, int]:
    t = local(t)
    return str(t.device), t.untyped_storage().data_ptr()


def walked_scheme_tensors(strategy: Any) -> dict[str, tuple[str, int]]:
    """Every storage the strategy reaches that is not a parameter, gradient or inner optimizer state:
    ``{path to the first reference found: (device, bytes)}``."""
    found: dict[tuple[str, int], tuple[str, int]] = {}
    seen: set[int] = set()

    def visit(o: Any, path: str) -> None:
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool, nn.Module, L.Trainer)):
            return
        seen.add(id(o))
        if isinstance(o, Tensor):
            t = local(o)
            if t.untyped_storage().nbytes():
                found.setdefault(_key(t), (path, (str(t.device), t.untyped_storage().nbytes())))
        elif isinstance(o, dict):
            for i, (k, v) in enumerate(list(o.items())):  # an optimizer's state is keyed by parameters
                visit(v, f"{path}[{k!r}]" if isinstance(k, (str, int)) else f"{path}[#{i}]")
        elif isinstance(o, (list, tuple, set, frozenset, deque)):
            for i, v in enumerate(list(o)):
                visit(v, f"{path}[{i}]")
        elif isinstance(o, torch.optim.Optimizer):
            visit(o.state, f"{path}.state")
            visit(o.param_groups, f"{path}.param_groups")
        elif type(o).__module__.startswith("lightning_commstrats") and hasattr(o, "__dict__"):
            for k, v in list(vars(o).items()):
                if k not in SKIPPED:
                    visit(v, f"{path}.{k}")

    visit(strategy, "strategy")
    module = strategy.lightning_module
    own = {_key(p) for p in module.parameters()}
    own |= {_key(p.grad) for p in module.parameters() if p.grad is not None}
    own |= {
        _key(v)
        for opt in strategy.optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, Tensor)
    }
    return dict(item for key, item in found.items() if key not in own)


class Record(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        by_device = strategy.memory_stats()
        stats = {kind: sum(held.values()) for kind, held in by_device.items()}
        walked = walked_scheme_tensors(strategy)
        walked_by_device: dict[str, int] = {}
        for device, nbytes in walked.values():
            walked_by_device[device] = walked_by_device.get(device, 0) + nbytes
        self.steps.append(
            {
                "step": trainer.global_step,
                "stats": stats,
                "by_device": by_device,
                "walked": sum(walked_by_device.values()),
                "walked_by_device": walked_by_device,
                "what": walked,
            }
        )


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    results: dict[str, Any] = {}
    rank = 0
    for name, (scheme, kwargs) in spec["scenarios"].items():
        L.seed_everything(0, verbose=False)
        model = Shapes()
        strategy = L.pytorch.strategies.StrategyRegistry[scheme]["strategy"](**kwargs)
        record = Record()
        cuda = spec.get("accelerator", "cpu") == "cuda"
        trainer = L.Trainer(
            accelerator=spec.get("accelerator", "cpu"),
            devices=1 if cuda else 2,
            num_nodes=2 if cuda else 1,
            strategy=strategy,
            max_steps=spec["steps"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[record],
        )
        trainer.fit(model)
        rank = trainer.global_rank
        results[name] = {"steps": record.steps, "shapes": [tuple(local(p).shape) for p in model.parameters()]}
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
