"""One rank of an AutoAdjust run (started by ``tests/harness.py`` with ``script=`` this file).

Usage: ``autoadjust_worker.py SPEC_JSON OUT_DIR``; SPEC is ``{"scenarios": {name: scenario}}`` with
keys ``strategy`` (a registry name), ``kwargs`` (its arguments), ``auto`` (AutoAdjust's arguments),
``epochs``, ``batch_size``, ``samples`` (the dataset's size), ``optimizer`` ("sgd" with momentum, the
default, or "adam"), ``seed`` and ``gate`` (hold the background exchanges, see :class:`Probe`).

The model is a small MLP (momentum SGD, a dropout so every step draws random numbers) on a dataset
whose sample ``i`` carries ``i``, so the worker knows which samples each step trained on. Around
every search it keeps this rank's state just before, at the end of each trial (before it is put
back) and once the trials are rolled back, before the chosen size applies: parameters and buffers,
gradients, optimizer state, the strategy's ``state_dict`` / ``rank_state_dict`` and counters, the
torch generator and the batch sampler's position. It saves ``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rank_env import save_and_leave
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_commstrats
from lightning_commstrats import AutoAdjust
from lightning_commstrats.batching import in_trial, resize


class Numbered(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Mlp(L.LightningModule):
    def __init__(self, batch_size: int, samples: int, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer = optimizer
        self.net = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Dropout(0.1), nn.Linear(48, 2))
        self.bs, self.samples = batch_size, samples
        self.trained: list[list[int]] = []  # per epoch, the samples the epoch trained on
        self.tried: list[list[int]] = []  # per trial, the samples it trained on

    def train_dataloader(self):
        return DataLoader(Numbered(self.samples), batch_size=self.bs, shuffle=True)

    def on_train_epoch_start(self) -> None:
        self.trained.append([])

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        if in_trial(self.trainer):
            if batch_idx == 0:
                self.tried.append([])
            self.tried[-1].extend(i.tolist())
        else:
            self.trained[-1].extend(i.tolist())
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return copy.deepcopy(obj)


def capture(trainer: L.Trainer, scheme: bool = True) -> dict[str, Any]:
    """This rank's state; ``scheme=False`` leaves out the strategy's two state dicts, whose reading
    waits for an exchange in flight (a probe that waits would hide a rollback that does not)."""
    strategy = trainer.strategy
    module = trainer.lightning_module
    sampler = resize._state(trainer).sampler
    state = {
        "model": clone(module.state_dict()),
        "grads": [clone(p.grad) for p in module.parameters()],
        "optimizer": clone(trainer.optimizers[0].state_dict()),
        "counters": {k: v for k, v in vars(strategy).items() if type(v) in (int, float, bool)},
        "rng": torch.get_rng_state(),
        "position": None if sampler is None else (sampler.position, sampler.batches, sampler.size),
    }
    if scheme:
        state["strategy"] = clone(strategy.state_dict())
        state["rank_state"] = clone(strategy.rank_state_dict())
    return state


def in_flight(strategy: Any) -> bool:
    pending = getattr(strategy, "_inflight", None)
    return pending is not None and pending.future is not None


def gate_exchanges(strategy: Any) -> None:
    """Hold every background exchange until this rank lets it go: when the strategy waits for it, or
    when a ``load_state_dict`` replaced it without waiting (then it lands after the state was put back,
    deterministically, instead of only when the thread happens to be slow)."""
    permits = threading.Semaphore(0)
    exchange_on, wait, load = strategy._exchange_on, strategy.wait_for_exchange, strategy.load_state_dict

    def gated_exchange_on(*args: Any) -> Any:
        if not permits.acquire(timeout=120):
            raise RuntimeError("a gated exchange was never waited for nor dropped")
        return exchange_on(*args)

    def gated_wait() -> None:
        if in_flight(strategy):
            permits.release()
        wait()

    def gated_load(state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        dropped = in_flight(strategy)
        load(state, rank_state)
        if dropped and not in_flight(strategy):  # the exchange was replaced without a wait: let it land now
            permits.release()

    strategy._exchange_on, strategy.wait_for_exchange, strategy.load_state_dict = (
        gated_exchange_on,
        gated_wait,
        gated_load,
    )


def drain(strategy: Any) -> None:
    """Let the strategy's exchange thread finish what it was given (an exchange dropped without a wait)."""
    runner = getattr(strategy, "_runner", None)
    if runner is not None:
        runner.drain()


class Probe(AutoAdjust):
    """AutoAdjust that keeps this rank's state around each search and at the end of each trial.

    With ``gate=True`` the strategy's background exchanges are gated (:func:`gate_exchanges`), the
    end of a trial is read without waiting for the exchange in flight, and the state after the
    search once the exchange thread has finished whatever it still held."""

    def __init__(self, gate: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate
        self.searched: list[dict[str, Any]] = []

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        if self.gate:
            gate_exchanges(trainer.strategy)

    def on_train_epoch_start(self, trainer, pl_module):
        before = capture(trainer)
        self._ends: list[dict[str, Any]] = []
        n = len(self.history)
        super().on_train_epoch_start(trainer, pl_module)
        if len(self.history) > n:
            sampler = resize._state(trainer).sampler
            order = list(sampler.sampler)  # this epoch's order for this rank (seed and epoch fix it)
            self.searched.append(
                {"epoch": trainer.current_epoch, "before": before, "after": self._after, "trial_ends": self._ends}
            )
            self.searched[-1]["order"] = order

    def _choose(self, trainer, size, epoch, trials, spent):
        if self.gate:
            drain(trainer.strategy)
        self._after = capture(trainer)  # the trials rolled back, before the chosen size applies
        super()._choose(trainer, size, epoch, trials, spent)

    def _trial(self, trainer, pl_module, snapshot, indices, size):
        loss = super()._trial(trainer, pl_module, snapshot, indices, size)
        end = capture(trainer, scheme=not self.gate)
        end["in_flight"] = in_flight(trainer.strategy)
        self._ends.append(end)
        return loss


def run_scenario(sc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    L.seed_everything(sc.get("seed", 7), verbose=False)
    model = Mlp(sc.get("batch_size", 4), sc.get("samples", 128), sc.get("optimizer", "sgd"))
    strategy = L.pytorch.strategies.StrategyRegistry[sc["strategy"]]["strategy"](**sc.get("kwargs", {}))
    probe = Probe(gate=sc.get("gate", False), **sc.get("auto", {}))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=sc.get("epochs", 2),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    trainer.fit(model)
    return trainer.global_rank, {
        "history": probe.history,
        "searched": probe.searched,
        "trained": model.trained,
        "tried": model.tried,
        "final": clone(model.state_dict()),
        "batch_size": resize.current_batch_size(trainer),
        "logged": float(trainer.callback_metrics.get("train/batch_size", -1)),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    assert lightning_commstrats.AutoAdjust is AutoAdjust
    results, rank = {}, 0
    for name, scenario in spec["scenarios"].items():
        rank, results[name] = run_scenario(scenario)
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
