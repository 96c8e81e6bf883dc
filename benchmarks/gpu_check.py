"""One training run of every scheme on one CUDA GPU, unsharded and ``shard="fsdp"``, with the device's
peak memory at a sync step against a plain step, for ``outer_state="host"`` and ``"device"``.

Part of ``make gpu-check`` (after the ``cuda``-marked tests). Each row trains a tied-embedding
Transformer-like LM (:class:`CheckNet`) for 3 optimizer steps on one GPU with a period of 2 steps,
so step 2 holds a periodic scheme's sync; ``torch.cuda.max_memory_allocated`` is read per step (its
peak reset at each batch's start), and ``memory_stats()`` tells where the scheme's state lives. A
row that fails prints its error and the script exits 1 once the table is out. With one GPU the
ranks are one (a group of one shard): this checks that every code path runs on CUDA and where
memory goes, not the exchange between ranks (``tests/cuda/test_nccl_ranks.py`` does that).

A second table runs ``diloco`` with ``shard="fsdp"`` built whole and built empty
(``Trainer.init_module(empty_init=True)``: parameters on the meta device, materialised on the GPU
after sharding and initialised there) and under ``LayeredMixedPrecision("layered", "bf16")``
(FSDP2's per-unit precision), with the device's own peaks (``max_memory_allocated`` and
``max_memory_reserved``) from the build to the first batch and over training::

    python benchmarks/gpu_check.py            # about a minute on one GPU
    python benchmarks/gpu_check.py --dim 2048 # a larger model: the peaks further apart
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import lightning as L
import torch
from common import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_commstrats
from lightning_commstrats.models.base import declare

PERIODIC = {"sync_period": 2, "sync_period_unit": "steps"}
SCHEMES: dict[str, dict[str, Any]] = {
    "allreduce": {},
    "onebit_sgd": {},
    "onebit_adam": {"freeze_step": 2},  # step 3 takes the frozen-variance path (frozen after 1 step it explodes)
    "model_averaging": PERIODIC,
    "bmuf": PERIODIC,
    "diloco": PERIODIC,
    "streaming_diloco": {**PERIODIC, "num_fragments": 2},
    "sparseloco": {**PERIODIC, "fragment_sync_delay": 0},
}
MIB = 2**20


class CheckNet(L.LightningModule):
    """Tied embedding, ``blocks`` residual MLP blocks, AdamW."""

    def __init__(self, vocab: int, dim: int, blocks: int) -> None:
        super().__init__()
        self.emb = declare(nn.Embedding(vocab, dim), "embedding")
        self.blocks = nn.ModuleList(
            declare(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)), "ffn")
            for _ in range(blocks)
        )
        self.head = declare(nn.Linear(dim, vocab, bias=False), "output")
        self.head.weight = self.emb.weight
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        loss = nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Tokens(Dataset):
    def __init__(self, vocab: int, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(vocab, (n, 8, 33), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :, :-1], self.data[i, :, 1:]


class Peaks(L.Callback):
    """The device's peak allocated bytes of every batch, and the scheme's memory by device at step 2."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.scheme: dict[str, int] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated())
        if len(self.peaks) == 2:
            self.scheme = trainer.strategy.memory_stats()["scheme"]


def run(scheme: str, shard: str | None, outer_state: str | None, args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(SCHEMES[scheme])
    if shard is not None:
        kwargs.update(shard=shard, group_size=1)
    if outer_state is not None:
        kwargs["outer_state"] = outer_state
    strategy = L.pytorch.strategies.StrategyRegistry[scheme]["strategy"](**kwargs)
    torch.manual_seed(0)
    model = CheckNet(args.vocab, args.dim, args.blocks)
    peaks = Peaks()
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=3, callbacks=[peaks])
    start = time.perf_counter()
    trainer.fit(model, DataLoader(Tokens(args.vocab, 3), batch_size=None))
    finite = all(torch.isfinite(torch.tensor(model.losses)).tolist())
    return {
        "seconds": time.perf_counter() - start,
        "loss": model.losses[-1],
        "ok": finite and len(model.losses) == 3,
        "plain": peaks.peaks[2],
        "sync": peaks.peaks[1],
        "scheme": peaks.scheme,
    }


class BuildPeaks(L.Callback):
    """The device's peaks from the build to the first batch, then over training."""

    def __init__(self) -> None:
        self.build: tuple[int, int] = (0, 0)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.build == (0, 0):
            torch.cuda.synchronize()
            self.build = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()


def run_build(empty: bool, layered: bool, args: argparse.Namespace) -> dict[str, Any]:
    strategy = lightning_commstrats.DiLoCoStrategy(**PERIODIC, shard="fsdp", group_size=1)
    plugins = [lightning_commstrats.LayeredMixedPrecision("layered", dtype="bf16", device="cuda")] if layered else []
    peaks = BuildPeaks()
    trainer = quiet_trainer(
        accelerator="cuda", devices=1, strategy=strategy, plugins=plugins, max_steps=3, callbacks=[peaks]
    )
    torch.manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with trainer.init_module(empty_init=empty):
        model = CheckNet(args.vocab, args.dim, args.blocks)
    built_on = {str(p.device) for p in model.parameters()}
    start = time.perf_counter()
    trainer.fit(model, DataLoader(Tokens(args.vocab, 3), batch_size=None))
    torch.cuda.synchronize()
    finite = all(torch.isfinite(torch.tensor(model.losses)).tolist())
    return {
        "seconds": time.perf_counter() - start,
        "ok": finite and len(model.losses) == 3,
        "loss": model.losses[-1],
        "built_on": ", ".join(sorted(built_on)),
        "model": 4 * sum(p.numel() for p in model.parameters()),
        "build": (peaks.build[0] - before, peaks.build[1]),
        "train": (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()),
    }


def build_table(args: argparse.Namespace) -> tuple[list[str], int]:
    rows = [
        "| diloco, shard='fsdp' | built on | runs | last loss | model MiB | build peak MiB (allocated / reserved)"
        " | training peak MiB (allocated / reserved) | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    failed = 0
    for empty, layered in ((False, False), (True, False), (False, True), (True, True)):
        label = f"| {'empty' if empty else 'whole'}{', layered bf16' if layered else ''} |"
        try:
            r = run_build(empty, layered, args)
        except Exception as err:  # report and go on
            failed += 1
            rows.append(f"{label} FAIL: {type(err).__name__}: {str(err)[:120]} | | | | | | |")
            continue
        failed += not r["ok"]
        rows.append(
            f"{label} {r['built_on']} | {'yes' if r['ok'] else 'NO'} | {r['loss']:.3f} | {r['model'] / MIB:.1f}"
            f" | {r['build'][0] / MIB:.1f} / {r['build'][1] / MIB:.1f}"
            f" | {r['train'][0] / MIB:.1f} / {r['train'][1] / MIB:.1f} | {r['seconds']:.1f} |"
        )
    return rows, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    print(f"gpu_check on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = [
        "| scheme | shard | outer_state | runs | last loss | peak MiB, plain step | peak MiB, sync step | sync - plain"
        " | scheme state MiB by device | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    failed = 0
    for scheme in SCHEMES:
        placements = ("host", "device") if "sync_period" in SCHEMES[scheme] else (None,)
        cls = L.pytorch.strategies.StrategyRegistry[scheme]["strategy"]
        for shard in (None, "fsdp") if cls.supports_shard else (None,):
            for outer_state in placements:
                label = f"| {scheme} | {shard or '-'} | {outer_state or '-'} |"
                try:
                    r = run(scheme, shard, outer_state, args)
                except Exception as err:  # report and go on: the table shows every row
                    failed += 1
                    rows.append(f"{label} FAIL: {type(err).__name__}: {str(err)[:120]} | | | | | | |")
                    continue
                failed += not r["ok"]
                where = ", ".join(f"{d} {b / MIB:.1f}" for d, b in sorted(r["scheme"].items())) or "-"
                rows.append(
                    f"{label} {'yes' if r['ok'] else 'NO'} | {r['loss']:.3f} | {r['plain'] / MIB:.1f}"
                    f" | {r['sync'] / MIB:.1f} | {(r['sync'] - r['plain']) / MIB:+.1f} | {where} | {r['seconds']:.1f} |"
                )
    print("\n".join(rows))
    built, failed_builds = build_table(args)
    print()
    print("\n".join(built))
    return 1 if failed or failed_builds else 0


if __name__ == "__main__":
    sys.exit(main())
