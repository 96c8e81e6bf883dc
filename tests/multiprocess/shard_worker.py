"""One rank of a sharded-run test (started by ``tests/harness.py`` with ``script=``).

Usage: ``shard_worker.py SPEC_JSON OUT_DIR``. SPEC is ``{"scenarios": {name: scenario}}``; each
scenario trains :class:`TiedNet` (a tied input/output embedding and residual blocks) with a package
strategy and this rank saves ``OUT_DIR/rank<r>.pt`` holding, per scenario:

- ``local_numel`` / ``full_numel``: per parameter, this rank's and the whole tensor's values;
- ``syncs``: after every outer step, ``(step, {name: this rank's part of the global model})``;
- ``steps``: after every optimizer step, ``{name: this rank's part of the parameters}`` (``trace``);
- ``final``: the whole parameters once fit ends (gathered inside the group when sharded);
- ``stats``, ``memory``, ``losses``, ``tied`` (input and output embeddings are one tensor).

Scenario keys: ``front`` (``"fabric"``: a plain Fabric loop, see :func:`run_fabric`), ``strategy`` (registry
name), ``kwargs``, ``max_steps``, ``batch_size``, ``merge``
(this rank trains on the batches of ranks ``merge * r .. merge * r + merge - 1`` concatenated: the
unsharded reference of a sharded run whose groups hold ``merge`` ranks), ``optimizer`` ("sgd" or
"adamw"), ``trace``, ``ckpt_every`` / ``resume`` (``[scenario, step]``) / ``ckpt_dir`` / ``resume_dir``,
``nan_at`` ([step, rank]: a NaN in that rank's embedding gradient shard), ``dims``, ``model`` (``"tied"``,
default, ``"gpt2"``: Hugging Face's GPT-2, or ``"moe"``: MoE blocks), ``epoch_steps`` (batches per
epoch: a checkpoint at an epoch's end resumes on the same data), ``val_every`` (validate every that
many batches during fit, on 2 batches of other data; ``validations`` counts how many ran),
``reducer_residuals`` (set the strategy's ``reducer.residuals``: where the slow hop's residuals wait).
Each result also has ``residuals``: per holder of error-feedback residuals (``hop``: the slow hop's,
``exchange``: a gradient compression's), its home and each residual's device and whether it is pinned.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rank_env import save_and_leave
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_commstrats  # noqa: F401  (registers the strategies)
from lightning_commstrats.sharding import is_dtensor, local

VOCAB, DIM, SEQ = 64, 32, 8


class TiedNet(L.LightningModule):
    def __init__(self, optimizer: str = "adamw", blocks: int = 2, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(blocks)])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.optimizer = optimizer
        self.losses: list[float] = []
        self.validations = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten()))
        self.validations += batch_idx == 0

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.5)
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def is_tied(self) -> bool:
        return self.head.weight is self.emb.weight


class HFNet(TiedNet):
    """A Hugging Face GPT-2 (``transformers``, random weights, no dropout) with its ``lm_head`` tied
    to the token embedding, inside a LightningModule (``model: "gpt2"``)."""

    def __init__(self, optimizer: str = "adamw", blocks: int = 2, dim: int = DIM, vocab: int = VOCAB) -> None:
        L.LightningModule.__init__(self)
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=vocab, n_positions=SEQ * 2, n_embd=dim, n_layer=blocks, n_head=2, bos_token_id=0, eos_token_id=0
        )
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        self.gpt = GPT2LMHeadModel(config)
        self.optimizer = optimizer
        self.losses: list[float] = []
        self.validations = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=x).logits

    def is_tied(self) -> bool:
        return self.gpt.lm_head.weight is self.gpt.transformer.wte.weight


class MoETiedNet(TiedNet):
    """``TiedNet`` whose residual blocks are mixture-of-experts layers (4 experts, top-1, dropless)
    (``model: "moe"``)."""

    def __init__(self, optimizer: str = "adamw", blocks: int = 2, dim: int = DIM, vocab: int = VOCAB) -> None:
        L.LightningModule.__init__(self)
        from lightning_commstrats.moe import MoELayer

        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([MoELayer(dim, 2 * dim, 4) for _ in range(blocks)])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.optimizer = optimizer
        self.losses: list[float] = []
        self.validations = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


MODELS = {"tied": TiedNet, "gpt2": HFNet, "moe": MoETiedNet}


class RankBatches(Dataset):
    """Batch ``i`` of global rank ``rank`` (a fixed function of both); with ``merge``, the batches of
    ``merge`` consecutive ranks concatenated, in rank order."""

    def __init__(self, rank: int, batch_size: int, steps: int, merge: int = 1, vocab: int = VOCAB) -> None:
        self.ranks = [merge * rank + k for k in range(merge)]
        self.batch_size, self.steps, self.vocab = batch_size, steps, vocab

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = []
        for r in self.ranks:
            g = torch.Generator().manual_seed(1000 * i + r)
            xs.append(torch.randint(self.vocab, (self.batch_size, SEQ + 1), generator=g))
        tokens = torch.cat(xs)
        return tokens[:, :-1], (tokens[:, 1:] * 7 + 3) % self.vocab  # a learnable map of the input


class Record(L.Callback):
    def __init__(self, trace: bool) -> None:
        self.trace = trace
        self.syncs: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.steps: list[dict[str, torch.Tensor]] = []
        self.seen = 0
        self.start: dict[str, torch.Tensor] | None = None
        self.opt_start: dict[str, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.start is None:  # the weights training starts from (a checkpoint restored by now)
            self.start = {n: full(p) for n, p in pl_module.named_parameters()}
            self.opt_start = moments(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        history = getattr(strategy, "sync_history", [])
        if len(history) > self.seen:
            self.seen = len(history)
            named: dict[str, torch.Tensor] = {}
            for f in range(strategy.num_fragments):
                named.update(strategy.named_views(f, strategy.outer.global_weights(f)))
            self.syncs.append((strategy.optimizer_steps, {k: v.detach().cpu().clone() for k, v in named.items()}))
        if self.trace:
            self.steps.append({n: local(p).detach().cpu().clone() for n, p in pl_module.named_parameters()})


class NaNShard(L.Callback):
    """A NaN in this rank's shard of the embedding's gradient at one step (``nan_at``: [step, rank])."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            local(pl_module.emb.weight.grad).view(-1)[0] = float("nan")


def moments(trainer: L.Trainer, module: L.LightningModule) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name, this rank's part of every tensor of the first optimizer's state for it."""
    opt = trainer.optimizers[0]
    out = {}
    for n, p in module.named_parameters():
        state = opt.state.get(p, {})
        out[n] = {k: local(v).detach().cpu().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if is_dtensor(t) else t).detach().cpu().clone()


def residuals_kept(strategy: Any) -> dict[str, Any]:
    """Where the strategy's error-feedback residuals are held (see the module docstring)."""
    holders = {}
    hop = strategy.two_level
    slow = getattr(hop, "slow", hop)
    if slow is not None and slow.quantized is not None:
        holders["hop"] = slow.quantized
    compression = getattr(strategy, "compression", None)
    if compression is not None and compression.exchange is not None and compression.exchange.quantized is not None:
        holders["exchange"] = compression.exchange.quantized
    out = {}
    for key, q in holders.items():
        tensors = [*q.state_dict()["residuals"].values(), *q.state_dict()["residuals2"].values()]
        out[key] = {
            "home": str(q.home),
            "tensors": [(str(t.device), t.is_pinned()) for t in tensors],
            "bytes": sum(t.numel() * t.element_size() for t in tensors),
        }
    return out


def run_scenario(name: str, sc: dict[str, Any], out: Path, rank_hint: int) -> tuple[int, dict[str, Any]]:
    L.seed_everything(sc.get("seed", 3), verbose=False)
    model = MODELS[sc.get("model", "tied")](sc.get("optimizer", "adamw"), **sc.get("dims", {}))
    strategy = L.pytorch.strategies.StrategyRegistry[sc["strategy"]]["strategy"](**sc.get("kwargs", {}))
    if sc.get("reducer_residuals"):
        strategy.reducer.residuals = sc["reducer_residuals"]
    record = Record(bool(sc.get("trace")))
    callbacks: list[L.Callback] = [record]
    if sc.get("nan_at"):
        callbacks.append(NaNShard(*sc["nan_at"]))
    if sc.get("ckpt_every"):
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=sc.get("ckpt_dir", out / name),
                filename="{step}",
                every_n_train_steps=sc["ckpt_every"],
                save_top_k=-1,
            )
        )
    steps = sc.get("max_steps", 8)
    loader = DataLoader(
        RankBatches(rank_hint, sc.get("batch_size", 4), sc.get("epoch_steps", steps), sc.get("merge", 1)),
        batch_size=None,
        shuffle=False,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=sc.get("devices", 4),
        strategy=strategy,
        max_steps=steps,
        num_sanity_val_steps=0,
        val_check_interval=sc.get("val_every"),
        limit_val_batches=2 if sc.get("val_every") else 0,
        logger=False,
        enable_checkpointing=bool(sc.get("ckpt_every")),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    ckpt_path = None
    if sc.get("resume"):
        source, step = sc["resume"]
        ckpt_path = Path(sc.get("resume_dir", out / source)) / f"step={step}.ckpt"
    val_loader = None
    if sc.get("val_every"):  # other batches than training's (rank ids no training rank has)
        val_loader = DataLoader(RankBatches(rank_hint + 100, sc.get("batch_size", 4), 2), batch_size=None)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=val_loader, ckpt_path=ckpt_path)
    result: dict[str, Any] = {
        "local_numel": {n: local(p).numel() for n, p in model.named_parameters()},
        "full_numel": {n: p.numel() for n, p in model.named_parameters()},
        "final": {n: full(p) for n, p in model.named_parameters()},
        "syncs": record.syncs,
        "start": record.start,
        "opt_start": record.opt_start,  # the first optimizer's state when training starts (and at the end)
        "opt_final": moments(trainer, model),
        "steps": record.steps,
        "losses": model.losses,
        "tied": model.is_tied(),
        "stats": strategy.comm_stats.snapshot().as_dict(),
        "memory": strategy.memory_stats(),
        "sync_history": list(getattr(strategy, "sync_history", [])),
        "optimizer_steps": strategy.optimizer_steps,
        "sharded": all(is_dtensor(p) for p in model.parameters()),
        "validations": model.validations,
        "residuals": residuals_kept(strategy),
    }
    return trainer.global_rank, result


def run_fabric(name: str, sc: dict[str, Any], out: Path, rank_hint: int) -> tuple[int, dict[str, Any]]:
    """The same training as :func:`run_scenario` in a plain Fabric loop: the optimizer is made after
    ``fabric.setup_module`` (over the sharded parameters); ``save_at`` / ``resume`` as ``fabric.save`` /
    ``fabric.load`` of ``OUT_DIR/<scenario>.ckpt``."""
    from lightning_commstrats.fabric import FabricStrategy

    L.seed_everything(sc.get("seed", 3), verbose=False)
    raw = MODELS[sc.get("model", "tied")](sc.get("optimizer", "adamw"), **sc.get("dims", {}))
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=FabricStrategy(sc["strategy"], **sc.get("kwargs", {})))
    fabric.launch()
    model = fabric.setup_module(raw)
    optimizer = fabric.setup_optimizers(raw.configure_optimizers())
    steps = sc.get("max_steps", 8)
    data = RankBatches(rank_hint, sc.get("batch_size", 4), sc.get("epoch_steps", steps), sc.get("merge", 1))
    start = 0
    if sc.get("resume"):
        source, start = sc["resume"]
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(out / f"{source}.ckpt", state)
        assert state["step"] == start, state["step"]
    for step in range(start, steps):
        x, y = data[step % len(data)]
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        raw.losses.append(loss.item())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == sc.get("save_at"):
            fabric.save(out / f"{name}.ckpt", {"model": model, "optimizer": optimizer, "step": step + 1})
    fabric.strategy.finish()
    return fabric.global_rank, {
        "local_numel": {n: local(p).numel() for n, p in raw.named_parameters()},
        "final": {n: full(p) for n, p in raw.named_parameters()},
        "losses": raw.losses,
        "tied": raw.is_tied(),
        "stats": fabric.strategy.comm_stats.snapshot().as_dict(),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    import os

    rank_hint = int(os.environ.get("LOCAL_RANK", "0"))
    results, rank = {}, 0
    for name, scenario in spec["scenarios"].items():
        run = run_fabric if scenario.get("front") == "fabric" else run_scenario
        rank, results[name] = run(name, scenario, out, rank_hint)
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
