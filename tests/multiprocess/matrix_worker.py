"""One rank of a support-matrix case (started by ``tests/harness.py`` from ``test_matrix_ranks.py``).

Usage: ``matrix_worker.py SPEC_JSON OUT_DIR``. SPEC is ``{"case": {axis: value}, "four_ranks": bool}``
(see :mod:`lightning_commstrats.support`). The case is trained as ``main`` (with validation during fit
and checkpoints every 3 optimizer steps when the case asks for them); as ``reference`` without either,
when the case has one; and as ``resumed`` from ``main``'s checkpoint at step 6 (the middle of a period of
4), when the case resumes (validating as ``main`` does; an epoch is 6 steps: Lightning resumes bit
for bit at an epoch's end).
This rank saves ``OUT_DIR/rank<r>.pt``: per run, the final state dict (whole
tensors), the state dict before training, the buffers before the end of fit, the tensors the scheme
says every rank of a replica group holds alike (``replicated``) and that group (``replica_key``).

The model is the worker's ``mlp`` (``lm`` for ``sampled_vocab``, ``moe`` for ``expert_parallel``) with
the case's feature grafted on: ``batchnorm`` (a BatchNorm over a side input that differs per rank),
``tied`` (two layers sharing one weight), ``no-grad`` (``idle``: never used; ``still``: in the loss
times 0, an exact zero gradient).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from rank_env import save_and_leave
from torch import nn
from torch.utils.data import DataLoader, Subset
from worker import MODELS, BuffersAtEnd

import lightning_commstrats
from lightning_commstrats import support
from lightning_commstrats.fabric import FabricStrategy, scheme_class
from lightning_commstrats.models.module import lm_loss

MAX_STEPS = 8
CKPT_EVERY = 3
RESUME_AT = 6


def build_model(settings: support.Settings, feature: str, rank: int) -> L.LightningModule:
    base = MODELS[settings.model]

    class Matrix(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            if feature == "batchnorm":
                self.aux_in = nn.Linear(8, 8)
                self.aux_bn = nn.BatchNorm1d(8)
            elif feature == "tied":
                self.aux_a = nn.Linear(8, 8)
                self.aux_b = nn.Linear(8, 8)
                self.aux_b.weight = self.aux_a.weight
            elif feature == "no-grad":
                self.idle = nn.Parameter(torch.randn(40, 32))  # above small_tensor_numel: quantized
                self.still = nn.Parameter(torch.randn(40, 32))

        epoch_samples: int | None = None  # the Trainer's epoch: the first samples of the data

        def train_dataloader(self) -> DataLoader:
            loader = super().train_dataloader()
            if self.epoch_samples is None:
                return loader
            return DataLoader(Subset(loader.dataset, range(self.epoch_samples)), batch_size=loader.batch_size)

        def aux_loss(self, batch: Any) -> torch.Tensor:
            first = batch[0] if isinstance(batch, (tuple, list)) else batch
            x = first.float().reshape(first.shape[0], -1)[:, :8] / 8 + rank  # other data on every rank
            if feature == "batchnorm":
                return 1e-2 * self.aux_bn(self.aux_in(x)).pow(2).mean()
            if feature == "tied":
                return 1e-2 * self.aux_b(torch.tanh(self.aux_a(x))).pow(2).mean()
            if feature == "no-grad":
                return 0.0 * self.still.sum()
            return x.new_zeros(())

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch, batch_idx) + self.aux_loss(batch)

        def fabric_loss(self, batch: Any) -> torch.Tensor:
            if settings.model == "mlp":
                loss = nn.functional.mse_loss(self(batch), batch[:, :2])
            else:
                x, y = batch
                loss = lm_loss(self(x), y)
                if self.hparams.num_experts:
                    loss = loss + self.aux_loss_weight * self.net.aux_loss
            self.losses.append(loss.item())
            return loss + self.aux_loss(batch)

    return Matrix(batch_size=4, momentum=0.9, **settings.model_kwargs)


def whole(value: Any) -> Any:
    """CPU copies, a DTensor gathered whole (a collective: every rank calls it in the same order)."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        return t.detach().cpu().clone()

    return apply_to_collection(value, torch.Tensor, copy)


def scheme_kwargs(settings: support.Settings, model: Any) -> dict[str, Any]:
    kwargs = dict(settings.kwargs)
    if kwargs.get("word_counts") == "data":
        kwargs["word_counts"] = model.word_counts()
    if settings.scheme != "local_sgd":
        kwargs["timeout"] = 120  # a rank left waiting fails the case instead of hanging it
    return kwargs


def replica_key(strategy: Any) -> int:
    if strategy.sharding is not None:
        size = strategy.world_size if strategy.group_size in (None, "node") else strategy.group_size
        return strategy.global_rank % size
    return 0


def batching_callback(case: dict[str, str]) -> list[L.Callback]:
    # AutoAdjust searches at every epoch's start (trials trained and rolled back) and keeps the size of 4:
    # the epoch stays RESUME_AT steps
    if case["batching"] == "AutoAdjust":
        return [lightning_commstrats.AutoAdjust(max_batch_size=4, search_samples=16, round_to=2)]
    if case["batching"] == "GradientNoiseScale":
        return [lightning_commstrats.GradientNoiseScale()]
    return []


def run_trainer(case: dict[str, str], settings: support.Settings, run: str, out: Path, rank: int) -> dict[str, Any]:
    L.seed_everything(7, verbose=False)
    model = build_model(settings, case["model"], rank)
    # an epoch of RESUME_AT optimizer steps (not limit_train_batches, which AutoAdjust refuses): Lightning
    # resumes a fit at an epoch's end bit for bit (mid-epoch it starts the DataLoader afresh), and step
    # RESUME_AT is the middle of a period
    model.epoch_samples = RESUME_AT * int(case["accumulate"]) * 4 * settings.world_size
    start = whole(model.state_dict())
    strategy = scheme_class(settings.scheme)(**scheme_kwargs(settings, model))
    at_end = BuffersAtEnd()
    callbacks: list[L.Callback] = [at_end, *batching_callback(case)]
    # the resumed run validates as the uninterrupted one did: validation averages the buffers, which
    # changes their rounding (not their value), and the two must agree bit for bit
    validate = run != "reference" and case["validation"] != "off"
    save = run == "main" and case["resume"] != "off"
    if save:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=out / "ckpt", filename="{step}", every_n_train_steps=CKPT_EVERY, save_top_k=-1
            )
        )
    plugins = (
        [lightning_commstrats.LayeredMixedPrecision("layered", dtype="bf16")] if case["precision"] != "off" else []
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=settings.world_size,
        strategy=strategy,
        max_steps=MAX_STEPS,
        accumulate_grad_batches=int(case["accumulate"]),
        val_check_interval=3 if validate else None,
        limit_val_batches=2 if validate else 0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=save,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=plugins,
    )
    ckpt = out / "ckpt" / f"step={RESUME_AT}.ckpt" if run == "resumed" else None
    trainer.fit(model, ckpt_path=ckpt)
    return {
        "start": start,
        "params": whole(model.state_dict()),
        "buffers_before_end": at_end.buffers,
        "replicated": whole(strategy.replicated_tensors()),
        "replica_key": replica_key(strategy),
        "global_step": trainer.global_step,
    }


def run_fabric(case: dict[str, str], settings: support.Settings, run: str, out: Path, rank: int) -> dict[str, Any]:
    L.seed_everything(7, verbose=False)
    model = build_model(settings, case["model"], rank)
    start_state = whole(model.state_dict())
    fabric = L.Fabric(
        accelerator="cpu",
        devices=settings.world_size,
        strategy=FabricStrategy(settings.scheme, **scheme_kwargs(settings, model)),
    )
    fabric.launch()
    model = fabric.setup_module(model)
    made = model.configure_optimizers()
    optimizer = made["optimizer"] if isinstance(made, dict) else made[0] if isinstance(made, (list, tuple)) else made
    optimizer = fabric.setup_optimizers(optimizer)
    loader = model.train_dataloader()
    loader = fabric.setup_dataloaders(DataLoader(loader.dataset, batch_size=4, shuffle=True))
    accumulate = int(case["accumulate"])
    observed = run == "main"
    first = 0
    if run == "resumed":
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(out / f"step={RESUME_AT}.ckpt", state)
        first = state["step"]
    step, micro = 0, 0
    for batch in loader:
        if step >= MAX_STEPS:
            break
        if step < first:  # the batches the resumed run already trained on
            micro += 1
            if micro % accumulate == 0:
                step += 1
            continue
        fabric.backward(model.fabric_loss(batch) / accumulate)
        micro += 1
        if micro % accumulate:
            continue
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if run != "reference" and case["validation"] != "off" and step % 3 == 0:
            with fabric.strategy.global_model(), torch.no_grad():
                model.eval()
                model.fabric_loss(batch)
                model.train()
        if observed and case["resume"] != "off" and step == RESUME_AT:
            fabric.save(out / f"step={RESUME_AT}.ckpt", {"model": model, "optimizer": optimizer, "step": step})
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    fabric.strategy.finish()
    return {
        "start": start_state,
        "params": whole(model.state_dict()),
        "buffers_before_end": buffers,
        "replicated": whole(fabric.strategy.scheme.replicated_tensors()),
        "replica_key": replica_key(fabric.strategy.scheme),
        "global_step": step,
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    # a rank still here after that long prints where every thread is (the harness then kills it)
    faulthandler.dump_traceback_later(spec.get("dump_after", 240), exit=False)
    case = spec["case"]
    settings = support.strategy_settings(case, four_ranks=spec.get("four_ranks", False))
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))))
    runs = ["main"]
    if case["validation"] != "off" or case["resume"] != "off":
        runs.append("reference")
    if case["resume"] != "off":
        runs.append("resumed")
    results: dict[str, Any] = {}
    # the runs share one process group (a Fabric run's launch finds it and joins it, as the Trainer's does):
    # destroyed and made anew between sharded Fabric runs, rank 0 went on into the next run's
    # collectives while rank 1 still waited in init_process_group, until the collective timeout
    for run in runs:
        began = time.perf_counter()
        front = run_trainer if case["front"] == "trainer" else run_fabric
        results[run] = front(case, settings, run, out, rank)
        results[run]["seconds"] = time.perf_counter() - began
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
