"""One rank of a test of models built without their memory (started by ``tests/harness.py``).

Usage: ``empty_init_worker.py SPEC_JSON OUT_DIR``. SPEC is ``{"scenarios": {name: scenario}}``; each
scenario (``build_by_rank``, {rank: build}, builds some ranks otherwise; ``expect_error`` records a
refusal's message instead of the run) trains :class:`Blocks` (an embedding tied to the output layer,
residual ``Linear`` blocks with a ``LayerNorm`` each) and this rank saves ``OUT_DIR/rank<r>.pt`` holding, per scenario:

- ``start`` / ``final``: this rank's local part of every parameter when training starts and once
  fit ends (``record_weights``, default true);
- ``full_numel`` / ``local_numel`` / ``sharded`` / ``tied``; ``losses``; ``init_calls``: the
  initialisers the strategy logged;
- ``rss``: the kernel's count for this process, in bytes: ``start`` (VmRSS before the model is
  built), ``build_peak`` (VmHWM from just before the build to the first batch: the kernel's peak is
  reset by writing 5 to ``/proc/self/clear_refs``), ``train_peak`` (VmHWM from the first batch to
  the end of fit, reset likewise), ``end`` (VmRSS when training ends, the state in place: Trainer
  only), ``model_bytes`` (the whole model in fp32); ``memory``: the strategy's ``memory_stats()`` then.

glibc's mmap threshold is fixed at 128 KiB in this process (``mallopt``, as ``MALLOC_MMAP_THRESHOLD_``
does), so freed blocks go back to the system and the peak follows the live tensors.

Scenario keys: ``front`` (``"trainer"`` or ``"fabric"``), ``build`` (``"whole"``: built as usual;
``"empty"``: ``init_module(empty_init=True)``; ``"meta"``: ``configure_model`` builds it under
``torch.device("meta")``; ``"wrapped"``: as LitGPT's clients do, the network is ``self.model``,
built on meta in ``configure_model``, which shards its blocks, ``self.model`` and ``self`` itself, and
the steps call ``self.model(x)``), ``strategy``, ``kwargs``, ``devices``, ``max_steps``, ``dims``
(``vocab``, ``dim``, ``blocks``, ``moe``: a mixture-of-experts layer in every block), ``optimizer``
(``"sgd"`` or ``"sgd_plain"``: no momentum), ``record_weights``, ``seed``, ``clip``
(``gradient_clip_val``), ``inf_at`` ([step, rank]: an inf in that rank's shard of the first
block's Linear gradient), ``precision`` (``LayeredMixedPrecision``'s arguments; Trainer only).
``whole`` holds every parameter whole at the end, ``stats`` the run's communication statistics.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rank_env import save_and_leave
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_commstrats
from lightning_commstrats.models.base import declare
from lightning_commstrats.moe import MoELayer
from lightning_commstrats.sharding import is_dtensor, local

SEQ = 8


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Net(nn.Module):
    """Roles declared for LayeredMixedPrecision: the blocks' ``Linear`` layers are FFNs (half under
    ``layered``), their ``LayerNorm`` and the embedding stay float32."""

    def __init__(self, vocab: int, dim: int, blocks: int) -> None:
        super().__init__()
        self.emb = declare(nn.Embedding(vocab, dim), "embedding")
        self.blocks = nn.ModuleList(
            nn.Sequential(declare(nn.LayerNorm(dim), "norm"), declare(nn.Linear(dim, dim), "ffn"))
            for _ in range(blocks)
        )
        self.head = declare(nn.Linear(dim, vocab, bias=False), "output")
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


class MoENet(nn.Module):
    """The same shape with a mixture-of-experts layer (4 experts, top-1, dropless) in every block."""

    def __init__(self, vocab: int, dim: int, blocks: int) -> None:
        super().__init__()
        self.emb = declare(nn.Embedding(vocab, dim), "embedding")
        self.blocks = nn.ModuleList(
            nn.Sequential(declare(nn.LayerNorm(dim), "norm"), MoELayer(dim, 2 * dim, 4)) for _ in range(blocks)
        )
        self.head = declare(nn.Linear(dim, vocab, bias=False), "output")
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class Blocks(L.LightningModule):
    def __init__(
        self, build: str, optimizer: str, vocab: int = 64, dim: int = 32, blocks: int = 2, moe: bool = False
    ) -> None:
        super().__init__()
        self.build, self.optimizer, self.dims = build, optimizer, (vocab, dim, blocks)
        self.net = MoENet if moe else Net
        self.losses: list[float] = []
        if build in ("whole", "empty"):
            self.model = self.net(*self.dims)

    def configure_model(self) -> None:
        if self.build not in ("meta", "wrapped") or hasattr(self, "model"):
            return
        with torch.device("meta"):
            self.model = self.net(*self.dims)
        if self.build == "wrapped":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["shard"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.optimizer, self.parameters())


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.0 if kind == "sgd_plain" else 0.5)


class Batches(Dataset):
    def __init__(self, rank: int, steps: int, vocab: int) -> None:
        self.rank, self.steps, self.vocab = rank, steps, vocab

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * i + self.rank)
        tokens = torch.randint(self.vocab, (4, SEQ), generator=g)
        return tokens, (tokens * 7 + 3) % self.vocab  # a learnable map of the input


class InfAt(L.Callback):
    """An inf in this rank's shard of one gradient at one step (``inf_at``: [step, rank])."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            local(pl_module.model.blocks[0][1].weight.grad).view(-1)[0] = float("inf")


class Calls(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Watch(L.Callback):
    def __init__(self, record_weights: bool) -> None:
        self.record_weights = record_weights
        self.start: dict[str, torch.Tensor] | None = None
        self.build_peak = 0
        self.end_rss = 0
        self.memory: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.end_rss = _status("VmRSS")  # what the process holds with its state in place
        self.memory = trainer.strategy.memory_stats()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.start is None:
            self.build_peak = _status("VmHWM")
            _reset_peak()
            self.start = snapshot(pl_module) if self.record_weights else {}


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: local(p).detach().clone() for n, p in module.named_parameters()}


def result(model: nn.Module, strategy: Any, losses: list[float], start: Any, rss: dict, sc: dict) -> dict:
    record = sc.get("record_weights", True)
    return {
        "start": start,
        "final": snapshot(model) if record else {},
        "full_numel": {n: p.numel() for n, p in model.named_parameters()},
        "local_numel": {n: local(p).numel() for n, p in model.named_parameters()},
        "sharded": all(is_dtensor(p) for p in model.parameters()),
        "losses": losses,
        "rss": rss,
        "tied": model.model.head.weight is model.model.emb.weight if hasattr(model, "model") else None,
        "whole": {n: (p.full_tensor() if is_dtensor(p) else p).detach().clone() for n, p in model.named_parameters()}
        if record
        else {},
        "stats": strategy.comm_stats.snapshot().as_dict(),
    }


def run_trainer(sc: dict[str, Any], rank_hint: int, calls: Calls) -> tuple[int, dict[str, Any]]:
    dims = sc.get("dims", {})
    strategy = L.pytorch.strategies.StrategyRegistry[sc["strategy"]]["strategy"](**sc.get("kwargs", {}))
    watch = Watch(sc.get("record_weights", True))
    steps = sc.get("max_steps", 6)
    plugins = [lightning_commstrats.LayeredMixedPrecision(**sc["precision"])] if sc.get("precision") else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=sc.get("devices", 4),
        strategy=strategy,
        plugins=plugins,
        gradient_clip_val=sc.get("clip"),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[watch, *([InfAt(*sc["inf_at"])] if sc.get("inf_at") else [])],
    )
    rss = {"start": _status("VmRSS")}
    _reset_peak()
    build = sc.get("build_by_rank", {}).get(str(rank_hint), sc.get("build", "whole"))
    if build == "empty":
        with trainer.init_module(empty_init=True):
            model = Blocks(build, sc.get("optimizer", "sgd"), **dims)
    else:
        model = Blocks(build, sc.get("optimizer", "sgd"), **dims)
    loader = DataLoader(Batches(rank_hint, steps, dims.get("vocab", 64)), batch_size=None, shuffle=False)
    if sc.get("expect_error"):  # a refusal: its message, on every rank
        try:
            trainer.fit(model, train_dataloaders=loader)
        except ValueError as err:
            return trainer.global_rank, {"error": str(err)}
        return trainer.global_rank, {"error": None}
    trainer.fit(model, train_dataloaders=loader)
    rss.update(build_peak=watch.build_peak, train_peak=_status("VmHWM"), end=watch.end_rss)
    rss["model_bytes"] = 4 * sum(p.numel() for p in model.parameters())
    out = result(model, strategy, model.losses, watch.start, rss, sc)
    out["init_calls"] = [m for m in calls.messages if "initialised by" in m]
    out["optimizer_steps"] = strategy.optimizer_steps
    out["memory"] = watch.memory
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    group = getattr(layers[0].comm, "group", None) if layers else None
    # the global ranks the MoE layers' all-to-all runs over (None: one rank or none)
    out["all_to_all_ranks"] = torch.distributed.get_process_group_ranks(group) if group is not None else None
    out["tokens_bytes"] = out["stats"].get("tokens/bytes_sent", 0)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    out["scale"] = None if scaler is None else scaler.scale
    return trainer.global_rank, out


def run_fabric(sc: dict[str, Any], rank_hint: int, calls: Calls) -> tuple[int, dict[str, Any]]:
    from lightning_commstrats.fabric import FabricStrategy

    dims = sc.get("dims", {})
    strategy = FabricStrategy(sc["strategy"], **sc.get("kwargs", {}))
    fabric = L.Fabric(accelerator="cpu", devices=sc.get("devices", 4), strategy=strategy)
    fabric.launch()
    rss = {"start": _status("VmRSS")}
    _reset_peak()
    with fabric.init_module(empty_init=sc.get("build") == "empty"):
        raw = Blocks("whole", sc.get("optimizer", "sgd"), **dims)
    model = fabric.setup_module(raw)
    rss["build_peak"] = _status("VmHWM")
    start = snapshot(raw) if sc.get("record_weights", True) else {}
    _reset_peak()
    optimizer = fabric.setup_optimizers(make_optimizer(sc.get("optimizer", "sgd"), raw.parameters()))
    data = Batches(rank_hint, sc.get("max_steps", 6), dims.get("vocab", 64))
    losses = []
    for step in range(sc.get("max_steps", 6)):
        x, y = data[step]
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        losses.append(loss.item())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.strategy.finish()
    rss["train_peak"] = _status("VmHWM")
    rss["model_bytes"] = 4 * sum(p.numel() for p in raw.parameters())
    out = result(raw, strategy, losses, start, rss, sc)
    out["init_calls"] = [m for m in calls.messages if "initialised by" in m]
    return fabric.global_rank, out


def main() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: freed blocks go back to the system
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    rank_hint = int(os.environ.get("LOCAL_RANK", "0"))
    calls = Calls()
    logging.getLogger("lightning_commstrats").addHandler(calls)
    logging.getLogger("lightning_commstrats").setLevel(logging.INFO)
    results, rank = {}, 0
    for name, sc in spec["scenarios"].items():
        L.seed_everything(sc.get("seed", 3), verbose=False)
        calls.messages.clear()
        run = run_fabric if sc.get("front") == "fabric" else run_trainer
        rank, results[name] = run(sc, rank_hint, calls)
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
