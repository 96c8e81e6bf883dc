"""One rank of a multi-process test (started by ``tests/harness.py``).

Usage: ``worker.py SPEC_JSON OUT_DIR``. SPEC is ``{"scenarios": {name: scenario}}``; each scenario is
trained in turn with a fresh model and Trainer, and this rank saves ``OUT_DIR/rank<r>.pt`` holding,
per scenario, the final parameters, the communication statistics and the training losses.

Scenario keys: ``strategy`` ("ddp" or a package registry name), ``kwargs`` (strategy arguments),
``model`` ("mlp" or "manual2": two optimizers under manual optimization), ``devices``,
``accelerator`` ("cpu", the default, or "cuda": one GPU per rank),
``max_steps``, ``accumulate``, ``clip``, ``seed``, ``batch_size``, ``momentum``, ``trace`` (keep
the flat parameters after every step), ``ckpt_every`` (save a checkpoint every that many steps
into ``OUT_DIR/<scenario>``, or ``ckpt_dir``), ``resume`` (``[scenario, step]``: start from that
checkpoint; ``resume_path``: from a checkpoint file of another run),
``val_every`` (validate every that many batches and keep the flat parameters seen by validation),
``model_kwargs`` (model arguments; model "lm" is a small LanguageModel on synthetic tokens, and a
strategy ``word_counts`` of ``"data"`` is replaced by its token counts), ``precision``
(``LayeredMixedPrecision`` arguments), ``inject_inf`` (``[step, rank]``: an inf in one gradient of
that rank at that step), ``perturb`` (``[step, rank]``: 1e-3 added to one parameter of that rank
after that step), ``marker_at`` (touch ``OUT_DIR/running<rank>`` after that step),
``state_trace`` (keep the strategy's state after every step, and its rank state once fit ends),
``slow_rank`` (``[rank, seconds]``: that rank sleeps after every batch, every rank with rank -1;
every rank keeps ``train_seconds``, its training loop's time), ``slow_exchange`` (``[rank,
seconds]``: that rank sleeps before each pseudo-gradient average of a periodic scheme, in the
thread the exchange runs in, so the other ranks' collective waits for it) and
``record_exchange`` (keep every pseudo-gradient a periodic strategy averages: this rank's, then the
average), ``record_gradients`` (keep this rank's own gradients of every step, before any exchange).
The ``mlp`` model takes ``model_kwargs`` ``optimizer`` ("sgd", "adam" or "adamw"), ``lr`` and
``weight_decay``. Models: ``mlp``, ``manual2``, ``lm``, ``moe``, ``bn`` (a BatchNorm, other data per rank),
``uneven`` (rank ``r`` trains on batches of ``batch_size + 2 r``), ``wide`` (16 MiB of weights).
``save_memory``: after fit, save ``OUT_DIR/<scenario>.ckpt`` and keep how far resident memory rose.
``validate_ckpt`` (``[scenario, step]``: validate that checkpoint instead of training), ``validate_after``
(validate once fit ends); both keep ``val/loss`` (and ``validated_metrics``, all that validate returned).
``unit`` (model): one weight, zero at the start, that every optimizer step moves by exactly +1/4
(loss ``-w``, plain SGD at lr 1/4; ``model_kwargs`` ``lr`` changes the step).
``record_pushes``: keep every push of the asynchronous parameter server (``pushes``: this worker's
weights before it, the base its progress is measured from, the progress pushed, the server's reply,
whether it was pipelined, the weights it continued from). ``hold`` (``[rank, other]``): that rank
starts its first batch only once rank ``other`` has ended its training loop.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning_utilities.core.apply_func import apply_to_collection
from rank_env import save_and_leave
from torch import nn
from torch.utils.data import DataLoader

import lightning_commstrats
from lightning_commstrats import CommStatsMonitor
from lightning_commstrats.callbacks import format_summary
from lightning_commstrats.data import StreamWindows
from lightning_commstrats.models import LanguageModel
from lightning_commstrats.sharding import local


class Mlp(BoringModel):
    """Two layers with momentum SGD (or ``optimizer`` "adam"/"adamw" at ``lr`` with ``weight_decay``);
    regresses a random target."""

    def __init__(
        self,
        batch_size: int = 4,
        momentum: float = 0.9,
        optimizer: str = "sgd",
        lr: float = 0.1,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 2))
        self.batch_size = batch_size
        self.momentum = momentum
        self.optimizer, self.lr, self.weight_decay = optimizer, lr, weight_decay
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = self(batch)
        loss = nn.functional.mse_loss(out, batch[:, :2])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer in ("adam", "adamw"):
            kind = torch.optim.Adam if self.optimizer == "adam" else torch.optim.AdamW
            return kind(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 256), batch_size=self.batch_size, shuffle=False)


class ManualTwoOptimizers(Mlp):
    """Manual optimization with one optimizer per layer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt_a, opt_b = self.optimizers()
        loss = nn.functional.mse_loss(self(batch), batch[:, :2])
        self.losses.append(loss.item())
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        return loss

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.layer[0].parameters(), lr=0.1, momentum=self.momentum),
            torch.optim.Adam(self.layer[2].parameters(), lr=0.01),
        )


class TinyLM(LanguageModel):
    """A small word LM on a synthetic Zipf-distributed token stream (``V = 50``)."""

    VOCAB = 50

    def __init__(self, batch_size: int = 4, momentum: float = 0.9, **kwargs: Any) -> None:
        defaults = {"arch": "lstm", "vocab_size": self.VOCAB, "embed_dim": 16, "hidden_dim": 16, "lr": 0.01}
        super().__init__(**{**defaults, **kwargs})
        g = torch.Generator().manual_seed(3)
        zipf = 1.0 / torch.arange(1, self.VOCAB + 1, dtype=torch.float64)
        self.stream = torch.multinomial(zipf / zipf.sum(), 2049, replacement=True, generator=g)
        self.batch_size = batch_size
        self.losses: list[float] = []

    def word_counts(self) -> list[int]:
        return torch.bincount(self.stream, minlength=self.VOCAB).tolist()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StreamWindows(self.stream, 8, pad_id=2), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(StreamWindows(self.stream[:257], 8, pad_id=2), batch_size=self.batch_size)


class TinyMoELM(TinyLM):
    """TinyLM as a two-block Transformer whose second FFN is a mixture of 4 experts."""

    def __init__(self, **kwargs: Any) -> None:
        moe = {
            "arch": "transformer",
            "hidden_dim": 16,
            "num_heads": 2,
            "num_layers": 2,
            "ffn_dim": 32,
            "max_seq_len": 8,
            "dropout": 0.0,
            "num_experts": 4,
            "moe_every": 2,
            "optimizer": "sgd",
            "lr": 0.5,
        }
        super().__init__(**{**moe, **kwargs})


class BatchNormMlp(Mlp):
    """The MLP with a BatchNorm between its layers: running statistics that each rank's data moves."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layer = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))

    def train_dataloader(self) -> DataLoader:  # other data on every rank: shifted by the rank
        data = RandomDataset(32, 256)
        data.data += self.trainer.global_rank
        return DataLoader(data, batch_size=self.batch_size, shuffle=False)


class UnevenMlp(Mlp):
    """The MLP whose rank ``r`` trains on batches of ``batch_size + 2 r`` samples (a custom sampler's doing)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 256), batch_size=self.batch_size + 2 * self.trainer.global_rank)


class UnitSteps(Mlp):
    """One weight, zero at the start, that every optimizer step moves by exactly ``lr`` (1/4: a
    block of four steps moves every worker by one unit): loss ``-w``, plain SGD."""

    def __init__(self, lr: float = 0.25, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layer = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(self.layer.weight)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = -self.layer.weight.sum() + 0.0 * batch.sum()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.0)


class WideMlp(Mlp):
    """The MLP with a 2048 x 2048 hidden layer (16 MiB of weights, as much again of momentum): a
    rank's state large enough that memory measurements of a checkpoint save see it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layer = nn.Sequential(nn.Linear(32, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 2))


def save_peak_memory(trainer: L.Trainer, path: Path) -> dict[str, int]:
    """Save a checkpoint and return how far this process's resident memory rose above where it
    started (the kernel's high-water mark, reset just before), and the rank state's size."""

    def status(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
        return int(line.split()[1]) * 1024

    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(trainer.strategy.rank_state_dict()))
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    before = status("VmRSS:")
    trainer.save_checkpoint(path)
    return {"rise": status("VmHWM:") - before, "rank_state_bytes": state_bytes}


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(value, torch.Tensor, found.append)
    return found


class BuffersAtEnd(L.Callback):
    """The module's buffers when training ends, before the strategy's own end-of-fit hook."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.buffers = {k: v.detach().clone() for k, v in pl_module.named_buffers()}


MODELS = {
    "mlp": Mlp,
    "manual2": ManualTwoOptimizers,
    "lm": TinyLM,
    "moe": TinyMoELM,
    "bn": BatchNormMlp,
    "uneven": UnevenMlp,
    "wide": WideMlp,
    "unit": UnitSteps,
}


class Trace(L.Callback):
    """The flat parameters after every step and when validation starts; sampled_vocab's rows."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []
        self.validated: list[torch.Tensor] = []
        self.rows: list[torch.Tensor | None] = []
        self.step_bytes: list[dict[str, float]] = []  # comm_stats.last_step after every step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps.append(flat(pl_module))
        self.rows.append(getattr(trainer.strategy, "last_rows", None))
        stats = getattr(trainer.strategy, "comm_stats", None)
        self.step_bytes.append(stats.last_step.as_dict() if stats is not None else {})

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if batch_idx == 0:
            self.validated.append(flat(pl_module))


class InjectInf(L.Callback):
    """An inf (or ``value``: "nan") in the gradient of the first parameter (whose name holds
    ``name``) on one rank at one optimizer step."""

    def __init__(self, step: int, rank: int, value: str = "inf", name: str = "") -> None:
        self.step, self.rank, self.value, self.name = step, rank, float(value), name

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            named = pl_module.named_parameters()
            param = next(p for n, p in named if p.grad is not None and self.name in n)
            local(param.grad).view(-1)[0] = self.value  # sharded: into this rank's shard


class ScaleExpertGrads(L.Callback):
    """Multiplies every expert's gradient by ``factor`` after backward (the same on every rank): a
    model whose gradient norm is nearly all dense parameters."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name, p in pl_module.named_parameters():
            if ".experts." in name and p.grad is not None:
                p.grad.mul_(self.factor)


class ClipCheck(L.Callback):
    """Whether the gradients ``optimizer.step`` used are those the strategy left (Lightning's own
    clipping, which runs in between, changed nothing), per step."""

    def __init__(self) -> None:
        self.same: list[bool] = []
        self._before: torch.Tensor | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # the step changed no gradient (SGD), and the next zero_grad is still to come
        now = torch.cat([p.grad.reshape(-1) for p in pl_module.parameters() if p.grad is not None])
        self.same.append(self._before is not None and torch.equal(now, self._before))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._before = torch.cat([p.grad.reshape(-1) for p in pl_module.parameters() if p.grad is not None]).clone()


class Perturb(L.Callback):
    """Adds 1e-3 to the first parameter on one rank after one optimizer step: replicas that diverge."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            with torch.no_grad():
                next(pl_module.parameters()).add_(1e-3)


class Marker(L.Callback):
    """Touches ``<out>/running<rank>`` after one optimizer step: the run is under way."""

    def __init__(self, out: Path, step: int) -> None:
        self.out, self.step = out, step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            (self.out / f"running{trainer.global_rank}").touch()


class Slow(L.Callback):
    """Sleeps after every batch on one rank (a straggler), and times every rank's training loop:
    from the start of training to the end of its last batch."""

    def __init__(self, rank: int | None = None, seconds: float = 0.0) -> None:
        self.rank, self.seconds = rank, seconds
        self.start = self.end = 0.0
        self.first: torch.Tensor | None = None  # the flat parameters when training starts

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = self.end = time.perf_counter()
        self.first = flat(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.rank in (trainer.global_rank, -1):
            time.sleep(self.seconds)
        self.end = time.perf_counter()


class Hold(L.Callback):
    """Rank ``rank`` starts its first batch only once rank ``other`` has ended its training loop (a
    file ``other`` touches when its training ends): one worker of an asynchronous scheme runs all
    its steps before the other starts, an order that does not depend on timing."""

    def __init__(self, flag: Path, rank: int, other: int, timeout: float = 120.0) -> None:
        self.flag, self.rank, self.other, self.timeout = flag, rank, other, timeout
        self.waited = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank != self.rank or self.waited:
            return
        self.waited = True
        deadline = time.monotonic() + self.timeout
        while not self.flag.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: rank {self.other} did not end its training loop")
            time.sleep(0.02)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == self.other:
            self.flag.touch()


class StateTrace(L.Callback):
    """The strategy's own state (shared and rank-local) and the loss scale after every step."""

    def __init__(self) -> None:
        self.states: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.states.append(
            {
                "state": clone(strategy.state_dict()),
                "rank": clone(strategy.rank_state_dict()),
                "scale": scaler.scale if scaler else None,
                "skipped": strategy.last_step_skipped,
            }
        )


def record_pseudo_gradients(strategy: Any, out: list[dict[str, Any]]) -> None:
    """Wrap the strategy's pseudo-gradient averaging: keep, per call, the step, this rank's tensors and the averages."""
    average = strategy.average_pseudo_gradient

    def recorded(named: dict[str, torch.Tensor]) -> None:
        mine = clone(named)
        average(named)
        out.append({"step": strategy.optimizer_steps, "mine": mine, "avg": clone(named)})

    strategy.average_pseudo_gradient = recorded


def record_gradients(strategy: Any, out: list[dict[str, torch.Tensor]]) -> None:
    """Wrap the strategy's ``after_backward``: keep, per step, this rank's own gradients (by name)
    as backward left them, before any exchange."""
    after_backward = strategy.after_backward

    def recorded(optimizer: Any) -> None:
        out.append(
            {
                n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                for n, p in strategy.lightning_module.named_parameters()
            }
        )
        after_backward(optimizer)

    strategy.after_backward = recorded


def slow_exchange(strategy: Any, rank: int, seconds: float) -> None:
    """Wrap the strategy's pseudo-gradient averaging: rank ``rank`` sleeps ``seconds`` before each."""
    average = strategy.average_pseudo_gradient

    def slowed(named: dict[str, torch.Tensor]) -> list[str]:
        if strategy.global_rank == rank:
            time.sleep(seconds)
        return average(named)

    strategy.average_pseudo_gradient = slowed


def record_pushes(strategy: Any, out: list[dict[str, Any]]) -> list[Any]:
    """Wrap the asynchronous parameter server's sync: keep, per push, this worker's weights before it
    (``local``), the ``base`` its progress is measured from, the progress it ``pushed`` (scaled),
    whether it was ``pipelined``, and the weights it continued from (``start``). Returns the futures
    of the server's replies (a copy of each, made when it arrives), one per push."""
    sync, push_pull = strategy._sync_async, strategy._push_pull
    replies: list[Any] = []

    def pushing(op: str, flat: torch.Tensor, tag: str) -> Any:
        futures = push_pull(op, flat, tag)
        if op == "delta":
            out[-1]["pushed"] = flat.detach().clone()
            replies.append(
                torch.futures.collect_all(futures).then(
                    lambda done: torch.cat([f.wait().reshape(-1) for f in done.wait()]).clone()
                )
            )
        return futures

    def syncing(pipelined: bool) -> None:
        out.append({"local": strategy.flat_weights(), "base": strategy._base.clone(), "pipelined": pipelined})
        sync(pipelined=pipelined)
        out[-1]["start"] = strategy.flat_weights()

    strategy._push_pull = pushing
    strategy._sync_async = syncing
    return replies


def clone(value: Any) -> Any:
    return apply_to_collection(value, torch.Tensor, lambda t: t.detach().clone())


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([local(p).detach().reshape(-1) for p in module.parameters()]).clone()


def run_scenario(name: str, sc: dict[str, Any], out: Path) -> tuple[int, dict[str, Any]]:
    L.seed_everything(sc.get("seed", 7), verbose=False)
    model = MODELS[sc.get("model", "mlp")](
        batch_size=sc.get("batch_size", 4), momentum=sc.get("momentum", 0.9), **sc.get("model_kwargs", {})
    )
    strategy_name = sc["strategy"]
    ours = strategy_name != "ddp"
    kwargs = dict(sc.get("kwargs", {}))
    if kwargs.get("word_counts") == "data":
        kwargs["word_counts"] = model.word_counts()
    strategy = L.pytorch.strategies.StrategyRegistry[strategy_name]["strategy"](**kwargs) if ours else strategy_name
    callbacks: list[L.Callback] = [CommStatsMonitor(summary_at_end=False)] if ours else []
    trace = Trace()
    at_end = BuffersAtEnd()
    callbacks.append(at_end)
    if sc.get("trace"):
        callbacks.append(trace)
    slow = Slow(*sc.get("slow_rank", (None, 0.0)))
    callbacks.append(slow)
    states = StateTrace()
    if sc.get("state_trace"):
        callbacks.append(states)
    if sc.get("inject_inf"):
        callbacks.append(InjectInf(*sc["inject_inf"]))
    clip_check = ClipCheck()
    if sc.get("clip_check"):
        callbacks.append(clip_check)
    if sc.get("scale_expert_grads") is not None:
        callbacks.append(ScaleExpertGrads(sc["scale_expert_grads"]))
    if sc.get("perturb"):
        callbacks.append(Perturb(*sc["perturb"]))
    if sc.get("marker_at"):
        callbacks.append(Marker(out, sc["marker_at"]))
    if sc.get("hold"):
        held, other = sc["hold"]
        callbacks.append(Hold(out / f"trained{other}-{name}", held, other))
    plugins = [lightning_commstrats.LayeredMixedPrecision(**sc["precision"])] if sc.get("precision") else []
    if sc.get("ckpt_every"):
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=sc.get("ckpt_dir", out / name),
                filename="{step}",
                every_n_train_steps=sc["ckpt_every"],
                save_top_k=-1,
            )
        )
    ckpt_path = None
    if sc.get("resume"):
        source, step = sc["resume"]
        ckpt_path = out / source / f"step={step}.ckpt"
    if sc.get("resume_path"):  # a checkpoint written by another run (another number of ranks)
        ckpt_path = sc["resume_path"]
    exchanges: list[dict[str, Any]] = []
    if sc.get("record_exchange"):
        record_pseudo_gradients(strategy, exchanges)
    if sc.get("slow_exchange"):
        slow_exchange(strategy, *sc["slow_exchange"])
    gradients: list[dict[str, torch.Tensor]] = []
    if sc.get("record_gradients"):
        record_gradients(strategy, gradients)
    pushes: list[dict[str, Any]] = []
    replies = record_pushes(strategy, pushes) if sc.get("record_pushes") else []
    trainer = L.Trainer(
        accelerator=sc.get("accelerator", "cpu"),
        devices=sc.get("devices", 2),
        strategy=strategy,
        max_steps=sc.get("max_steps", 8),
        accumulate_grad_batches=sc.get("accumulate", 1),
        gradient_clip_val=sc.get("clip"),
        val_check_interval=sc.get("val_every"),
        limit_val_batches=2 if sc.get("val_every") else 0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(sc.get("ckpt_every")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=plugins,
    )
    val_loss = None
    validated: dict[str, float] = {}
    if sc.get("validate_ckpt"):  # evaluate a checkpoint of an earlier scenario instead of training
        source, step = sc["validate_ckpt"]
        val_loss = trainer.validate(model, ckpt_path=out / source / f"step={step}.ckpt", verbose=False)[0]["val/loss"]
    else:
        trainer.fit(model, ckpt_path=ckpt_path)
        if sc.get("validate_after"):
            validated = trainer.validate(model, verbose=False)[0]
            val_loss = validated["val/loss"]
    for push, reply in zip(pushes, replies, strict=True):
        push["reply"] = reply.wait()
    result: dict[str, Any] = {
        "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "losses": model.losses,
        "world_size": trainer.world_size,
        "trace": trace.steps,
        "step_bytes": trace.step_bytes,
        "total_bytes": strategy.comm_stats.snapshot().as_dict() if ours else {},
        "clip_untouched": clip_check.same,
        "validated": trace.validated,
        "rows": trace.rows,
        "states": states.states,
        "rank_state_after_fit": clone(strategy.rank_state_dict()) if sc.get("state_trace") else None,
        "precision": trainer.precision_plugin.state_dict(),
        "exchanges": exchanges,
        "gradients": gradients,
        "pushes": pushes,
        "buffers_before_end": at_end.buffers,
        "val_loss": val_loss,
        "validated_metrics": {k: float(v) for k, v in validated.items()},
        "train_seconds": slow.end - slow.start,
        "start_params": slow.first,
        "heartbeats": sum(t.name == "commstrats-heartbeat" for t in threading.enumerate()),
    }
    if sc.get("ckpt_every") and not sc.get("validate_ckpt") and not sc.get("ckpt_dir"):
        # what the last checkpoint holds: the file's strategy state, this rank's shard
        last = max((out / name).glob("step=*.ckpt"), key=lambda f: int(f.stem.split("=")[1]))
        saved = torch.load(last, weights_only=False)[lightning_commstrats.strategies.base.STATE_KEY]
        shard = out / name / saved["shards"][trainer.global_rank]
        result["checkpoint"] = {"keys": sorted(saved), "shards": saved["shards"], "mine": torch.load(shard)}
    if sc.get("save_memory"):
        result["save_memory"] = save_peak_memory(trainer, out / f"{name}.ckpt")
        result["files"] = sorted(p.name for p in out.glob(f"{name}.ckpt*"))
    if ours:
        result["sync_history"] = list(getattr(trainer.strategy, "sync_history", []))
        result["samples_per_worker"] = trainer.strategy.samples_per_worker
    if ours:
        stats = trainer.strategy.comm_stats
        result["stats"] = stats.snapshot().as_dict()
        result["summary"] = format_summary(stats.snapshot())
        result["last_step"] = stats.last_step.as_dict()
        result["comm"] = repr(trainer.strategy.comm)
        exchange = getattr(trainer.strategy, "_exchange", None)
        result["exchange_comm"] = repr(exchange.comm) if exchange is not None else None
        host = getattr(trainer.strategy, "_host_comm", None)
        result["host_comm"] = repr(host) if host is not None else None
        result["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}
    return trainer.global_rank, result


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    assert "allreduce" in L.pytorch.strategies.StrategyRegistry, lightning_commstrats.__name__
    results = {}
    rank = 0
    for name, scenario in spec["scenarios"].items():
        rank, results[name] = run_scenario(name, scenario, out)
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
