"""One training run of every scheme on one CUDA GPU, unsharded and ``shard="fsdp"``, with the device's
peak memory at a sync step against a plain step, for ``outer_state="host"`` and ``"device"``.

Part of ``make gpu-check`` (after the ``cuda``-marked tests). Each row trains a tied-embedding
Transformer-like LM (:class:`CheckNet`) for 3 optimizer steps on one GPU with a period of 2 steps,
so step 2 holds a periodic scheme's sync; ``torch.cuda.max_memory_allocated`` is read per step (its
peak reset at each batch's start), and ``memory_stats()`` tells where the scheme's state lives. A
row that fails prints its error and the script exits 1 once the table is out. With one GPU the
ranks are one (a group of one shard): this checks that every code path runs on CUDA and where
memory goes, not the exchange between ranks (``tests/cuda/test_nccl_ranks.py`` does that)::

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
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_commstrats  # noqa: F401  (registers the strategies)

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
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(blocks)
        )
        self.head = nn.Linear(dim, vocab, bias=False)
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
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[peaks],
    )
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
