"""Training throughput of the precision presets side by side: fp32 (O0), O1, O2, layered (and O3).

    python benchmarks/precision_speed.py [--device cpu|cuda] [--dtype bf16|fp16] [--steps 20 --rounds 3]

One process, one device, the package's Transformer LM (``--d-model``, ``--layers``, ``--ffn``,
``--experts`` for MoE FFNs) on random tokens, AdamW, a real ``Trainer`` with
``LayeredMixedPrecision``. Each round trains every preset for ``--warmup`` + ``--steps`` optimizer
steps, presets interleaved so that drift of the machine (other load, clocks) hits them alike; a
preset's figure is the median over rounds of its median step time. Ratios are against fp32 in the
same run. The table goes to stdout and, with ``--out``, to ``<out>/results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
from common import quiet_trainer, write_results
from recorded import portable_args
from torch.utils.data import DataLoader, TensorDataset

from lightning_commstrats import LayeredMixedPrecision
from lightning_commstrats.models import LanguageModel

PRESETS = ("O0", "O1", "O2", "layered", "O3")


class StepTimer(L.Callback):
    """Seconds of every training step (forward, backward, optimizer) after ``warmup`` steps."""

    def __init__(self, warmup: int, device: str) -> None:
        self.warmup, self.device = warmup, device
        self.seconds: list[float] = []
        self._start = 0.0

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._sync()
        if trainer.global_step > self.warmup:
            self.seconds.append(time.perf_counter() - self._start)


def one_run(preset: str, args: argparse.Namespace, data: TensorDataset) -> tuple[float, float]:
    """Median step seconds and the last training loss of one preset."""
    L.seed_everything(0, verbose=False)
    model = LanguageModel(
        arch="transformer",
        vocab_size=args.vocab,
        hidden_dim=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        ffn_dim=args.ffn,
        max_seq_len=args.seq_len,
        dropout=0.0,
        num_experts=args.experts,
        optimizer="adamw",
        lr=1e-3,
    )
    timer = StepTimer(args.warmup, args.device)
    trainer = quiet_trainer(
        validate=False,
        accelerator=args.device,
        devices=1,
        max_steps=args.warmup + args.steps,
        plugins=[LayeredMixedPrecision(preset, dtype=args.dtype, device=args.device)],
        callbacks=[timer],
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
    return statistics.median(timer.seconds), float(trainer.callback_metrics.get("train/loss", float("nan")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=0, help="MoE FFNs with this many experts (0: dense)")
    parser.add_argument("--vocab", type=int, default=10000)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    LayeredMixedPrecision(dtype=args.dtype, device=args.device)  # fails early if the device cannot run dtype

    g = torch.Generator().manual_seed(0)
    n = args.batch_size * (args.warmup + args.steps)
    tokens = torch.randint(0, args.vocab, (n, args.seq_len + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    times: dict[str, list[float]] = {p: [] for p in args.presets}
    losses: dict[str, float] = {}
    for _ in range(args.rounds):
        for preset in args.presets:
            seconds, losses[preset] = one_run(preset, args, data)
            times[preset].append(seconds)

    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    tokens_per_step = args.batch_size * args.seq_len
    base = statistics.median(times["O0"]) if "O0" in times else None
    rows = []
    for preset in args.presets:
        step = statistics.median(times[preset])
        rows.append(
            {
                "preset": preset,
                "dtype": "fp32" if preset == "O0" else args.dtype,
                "step_ms": 1000 * step,
                "tokens_per_s": tokens_per_step / step,
                "speedup_vs_fp32": base / step if base else None,
                "last_loss": losses[preset],
                "step_ms_per_round": [1000 * t for t in times[preset]],
            }
        )
    model = f"d_model {args.d_model}, {args.layers} blocks, FFN {args.ffn}, vocab {args.vocab}" + (
        f", {args.experts} experts" if args.experts else ""
    )
    lines = [
        f"Training throughput, {device}, torch {torch.__version__}; Transformer LM ({model}),"
        f" batch {args.batch_size} x {args.seq_len} tokens, AdamW; median of {args.rounds} interleaved rounds"
        f" of {args.steps} timed steps",
        "",
        "| preset | dtype | step ms | tokens/s | vs fp32 (O0) | loss after the run |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['speedup_vs_fp32']:.2f}x" if r["speedup_vs_fp32"] else "-"
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {ratio}"
            f" | {r['last_loss']:.3f} |"
        )
    print("\n".join(lines))
    if args.out:
        data = {"args": portable_args(args), "device": device, "rows": rows}
        write_results(args.out, "\n".join(lines), data, indent=2)


if __name__ == "__main__":
    main()
