"""One replica of a fault-tolerant periodic run (a Lightning job of its own): trains a small model
with a periodic scheme whose ``fault_tolerance`` points at the test's Lighthouse, records every sync
it committed, and saves what it ended with to ``<out>/<replica_id>.pt``.

A replica can be told to die by SIGKILL (no clean-up, as a machine that fails): after a given
optimizer step (mid-block), or inside the n-th cross-replica collective of a given sync (an
exchange in flight).

Usage: python ft_worker.py '<json spec>' <out dir>
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_commstrats
from lightning_commstrats import fault_tolerance as ft
from lightning_commstrats import replicas as rp
from lightning_commstrats.fabric import FabricStrategy
from lightning_commstrats.moe import MoELayer
from lightning_commstrats.moe.layer import Experts
from lightning_commstrats.sharding import local
from lightning_commstrats.strategies import periodic

SCHEMES = {
    "diloco": lightning_commstrats.DiLoCoStrategy,
    "streaming_diloco": lightning_commstrats.StreamingDiLoCoStrategy,
    "bmuf": lightning_commstrats.BMUFStrategy,
    "model_averaging": lightning_commstrats.ModelAveragingStrategy,
}


class Regression(L.LightningModule):
    """A two-layer MLP on a fixed random regression task (its matrices are large enough to be quantized)."""

    def __init__(self, step_sleep: float = 0.0, batchnorm: bool = False, moe: bool = False) -> None:
        super().__init__()
        norm = [nn.BatchNorm1d(64)] if batchnorm else []
        # moe: a mixture-of-experts layer (4 experts, top-1) between the two, for expert_parallel=True
        mid = [MoELayer(64, 64, 4)] if moe else []
        self.net = nn.Sequential(nn.Linear(32, 64), *norm, nn.Tanh(), *mid, nn.Linear(64, 32))
        self.step_sleep = step_sleep

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.step_sleep:
            time.sleep(self.step_sleep)
        loss = nn.functional.mse_loss(self.net(x), y)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def task(n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)  # the same task for every replica
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 32, generator=g) / 32**0.5
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 32, generator=g))


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(local(t).detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def outer_tensors(strategy: periodic.PeriodicSyncStrategy) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The global model and every tensor of the outer optimizer's state."""
    state = strategy.outer.state_dict()
    opt = [v for s in state["optimizer"]["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    return list(state["weights"]), opt


def run_fabric(spec: dict, strategy, model: Regression, data: TensorDataset, kill: dict | None) -> tuple[int, float]:
    """The same training in a plain Fabric loop; a replica that heals takes over the run's step count."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FabricStrategy(strategy))
    fabric.launch()
    net, optimizer = fabric.setup(model.net, torch.optim.AdamW(model.net.parameters(), lr=3e-3))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=16, shuffle=True))
    fabric.strategy.begin()  # joins the run: the first quorum, or a heal from a live peer
    while fabric.strategy.optimizer_steps < spec["max_steps"]:
        for x, y in loader:
            if model.step_sleep:
                time.sleep(model.step_sleep)
            fabric.backward(nn.functional.mse_loss(net(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if kill and "after_step" in kill and fabric.strategy.optimizer_steps >= kill["after_step"]:
                os.kill(os.getpid(), signal.SIGKILL)
            if fabric.strategy.optimizer_steps >= spec["max_steps"]:
                break
    fabric.strategy.finish()
    return fabric.strategy.optimizer_steps, optimizer.param_groups[0]["lr"]


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    rid = spec["replica_id"]
    torch.manual_seed(spec.get("init_seed", 0))  # replicas may start from different initialisations
    model = Regression(spec.get("step_sleep", 0.0), spec.get("batchnorm", False), spec.get("moe", False))
    config = {"lighthouse": spec["lighthouse"], "replica_id": rid, "min_replicas": spec.get("min_replicas", 1)}
    config.update(spec.get("ft", {}))
    kwargs = dict(spec.get("scheme_kwargs", {}))
    strategy = SCHEMES[spec.get("scheme", "diloco")](fault_tolerance=config, **kwargs)
    if spec.get("committed"):  # {"step": s, "batches_committed": n}: as a replica restored from a checkpoint
        strategy.replicas.load_state_dict(spec["committed"])

    syncs: list[dict] = []
    quorums: list[int] = []
    heals: list[dict] = []
    exchanges: list[dict] = []  # per committed sync: what this replica sent and the average it applied
    kill = spec.get("kill")  # {"after_step": k} or {"sync": s, "collective": c}

    original_quorum = ft.ReplicaSync.quorum

    def quorum(self):
        q = original_quorum(self)
        quorums.append(q.comm.world_size)
        if q.healed is not None:
            heals.append({"step": q.step, "optimizer_steps": strategy.optimizer_steps})
        mine = kill and kill.get("rank", strategy.global_rank) == strategy.global_rank
        if mine and "sync" in kill and self.step == kill["sync"]:
            count = {"n": 0}
            comm = q.comm
            for name in ("_all_reduce", "_all_to_all", "_all_gather", "_broadcast"):
                inner = getattr(comm, name)

                def dying(*args, _inner=inner, **kw):
                    count["n"] += 1
                    if count["n"] == kill["collective"]:
                        # inside the exchange: some peers may already be waiting on this replica
                        os.kill(os.getpid(), signal.SIGKILL)
                    return _inner(*args, **kw)

                setattr(comm, name, dying)
        return q

    ft.ReplicaSync.quorum = quorum

    original_after_sync = strategy.after_sync

    def after_sync(fragment: int) -> None:
        original_after_sync(fragment)
        weights, opt = outer_tensors(strategy)
        syncs.append(
            {
                "step": strategy.replicas.sync.step if strategy.replicas.sync is not None else None,
                "fragment": fragment,
                "optimizer_steps": strategy.optimizer_steps,
                "global": digest(weights),
                "outer_state": digest(opt),
                "quorum": quorums[-1] if quorums else None,
                "time": time.time(),
            }
        )
        if strategy.replicas.sync is not None and strategy.replicas.sync.step == spec.get("perturb_at_step"):
            # a replica whose global model left the run's without torchft knowing (same committed step)
            with torch.no_grad():
                strategy.outer.weights[0].add_(1e-3)

    strategy.after_sync = after_sync

    original_average = rp.ReplicaGroup.average

    def replica_average(self, pending, host, first=None):
        sent = pending.grad.clone()
        attempts_before = len(quorums)
        nonfinite = original_average(self, pending, host, first)
        exchanges.append(
            {
                "fragment": pending.fragment,
                "sent": sent if pending.contributes else torch.zeros_like(sent),
                "average": pending.grad.clone(),
                "quorums": quorums[attempts_before:] or quorums[-1:],
                "step": self.sync.step,
            }
        )
        return nonfinite

    rp.ReplicaGroup.average = replica_average

    reconciled: list[int] = []
    original_reconcile = rp.ReplicaGroup.reconcile

    def reconcile(self, quorum, received, host):
        state = original_reconcile(self, quorum, received, host)
        if state is not None:
            reconciled.append(self.sync.step)
        return state

    rp.ReplicaGroup.reconcile = reconcile

    started: dict = {}
    original_first = rp.ReplicaGroup.first_quorum

    def first_quorum(self, host):
        original_first(self, host)
        weights, _ = outer_tensors(strategy)
        started.update(step=self.sync.step, global_=digest(weights), optimizer_steps=strategy.optimizer_steps)

    rp.ReplicaGroup.first_quorum = first_quorum

    class Killer(L.Callback):
        """``kill["after_step"]``: SIGKILL (a dead machine), or with ``kill["signal"] == "TERM"`` a
        SIGTERM (a preemption) sent once to ``kill["rank"]`` of the replica (default: every rank)."""

        sent = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not kill or "after_step" not in kill or trainer.global_step < kill["after_step"] or self.sent:
                return
            if kill.get("rank", trainer.global_rank) != trainer.global_rank:
                return
            self.sent = True
            out.joinpath(f"{rid}.killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGTERM if kill.get("signal") == "TERM" else signal.SIGKILL)

    class Progress(L.Callback):
        """``progress``: rank 0 writes its global step to ``<out>/<rid>.step`` after every batch."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if spec.get("progress") and trainer.global_rank == 0:
                out.joinpath(f"{rid}.step").write_text(str(trainer.global_step))

    class Hold(L.Callback):
        """``hold = {"at_step": n, "until": name}``: every rank waits before step ``n`` until
        ``<out>/<name>`` exists (at most 300 s), so a replica that a test restarts finds this one
        still training however slowly the restart starts; ``mark_setup = name``: rank 0 writes
        ``<out>/<name>`` as its fit is set up, before the strategy joins the run."""

        held = False

        def setup(self, trainer, pl_module, stage):
            if spec.get("mark_setup") and trainer.global_rank == 0:
                out.joinpath(spec["mark_setup"]).write_text(str(time.time()))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            hold = spec.get("hold")
            if not hold or self.held or trainer.global_step < hold["at_step"]:
                return
            self.held = True
            deadline = time.time() + 300
            while not out.joinpath(hold["until"]).exists():
                if time.time() > deadline:
                    raise TimeoutError(f"{rid}: {hold['until']} did not appear within 300 s")
                time.sleep(0.05)

    data = task()
    if spec.get("front") == "fabric":
        global_step, lr = run_fabric(spec, strategy, model, data, kill)
    else:
        callbacks: list = [Killer(), Progress(), Hold()]
        if spec.get("early_stop_below") is not None:  # stops at the first validation whose loss is below it
            callbacks.append(
                EarlyStopping(monitor="val_loss", stopping_threshold=spec["early_stop_below"], patience=1000)
            )
        if spec.get("ckpt_every"):  # every k steps, all kept: <out>/<rid>/ckpts/step=<k>.ckpt
            ckpts = ModelCheckpoint(
                dirpath=out / rid / "ckpts", filename="{step}", every_n_train_steps=spec["ckpt_every"], save_top_k=-1
            )
            callbacks.append(ckpts)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=spec.get("devices", 1),
            strategy=strategy,
            max_steps=spec.get("max_steps", -1),
            max_epochs=spec.get("max_epochs"),
            limit_train_batches=spec.get("limit_train_batches"),
            val_check_interval=spec.get("val_check_interval"),
            limit_val_batches=spec.get("limit_val_batches", 0),
            enable_checkpointing=bool(spec.get("ckpt_every")),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            default_root_dir=str(out / rid),
        )
        try:
            trainer.fit(
                model,
                DataLoader(data, batch_size=16, shuffle=True),
                DataLoader(data, batch_size=256) if spec.get("limit_val_batches") else None,
                ckpt_path=spec.get("resume"),
            )
        except SIGTERMException:  # preempted: every rank of the replica stopped at the same step
            out.joinpath(f"{rid}.rank{trainer.global_rank}.stopped").write_text(str(trainer.global_step))
            return
        global_step, lr = trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]
    weights, opt = outer_tensors(strategy)
    with torch.no_grad():
        x, y = data.tensors
        loss = float(nn.functional.mse_loss(model(x), y))  # (sharded: FSDP2 gathers the weights)
    result = {
        "replica_id": rid,
        "global_step": global_step,
        "optimizer_steps": strategy.optimizer_steps,
        "syncs": syncs,
        "quorums": quorums,
        "heals": heals,
        "started": started,
        "reconciled": reconciled,
        "exchanges": exchanges if spec.get("keep_exchanges") else [],
        "global": digest(weights),
        "outer_state": digest(opt),
        "model": digest([p for p in model.parameters()]),
        "buffers": digest([b for b in model.buffers() if b.is_floating_point()]),
        "running_mean": next((b.clone() for n, b in model.named_buffers() if n.endswith("running_mean")), None),
        # moe: the experts this rank holds (local rows of its MoE tensors; None without an MoE layer)
        "expert_rows": next((m.w1.shape[0] for m in model.modules() if isinstance(m, Experts)), None),
        "weights": [w.clone() for w in weights],
        "loss": loss,
        "lr": lr,
        "bytes": {tag: c.bytes_sent for tag, c in strategy.comm_stats.by_tag.items()},
        # the loop's waiting (all of it, and the waits for a quorum or a commit) and its wall time
        "comm_seconds": strategy.comm_stats.comm_seconds,
        "quorum_seconds": getattr(strategy.comm_stats.by_tag.get("quorum"), "comm_seconds", 0.0),
        "wall_seconds": strategy.comm_stats.wall_seconds,
        "summary": strategy.replica_summary(),  # the [ft] line and its figures
    }
    rank = strategy.global_rank
    torch.save(result, out / (f"{rid}.pt" if rank == 0 else f"{rid}.rank{rank}.pt"))


if __name__ == "__main__":
    main()
