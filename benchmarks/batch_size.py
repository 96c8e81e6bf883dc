"""Fixed batch against CNTK's AutoAdjust against the noise-scale warm-up, on the LM recipe (2 ranks).

For every strategy, schedule and seed it runs ``recipes/train_lm.py fit`` on the same sample budget
(samples over all ranks; the run stops once it has trained them), and every ``--eval_every``
samples measures the validation perplexity on the first ``--eval_windows`` windows of Brown's
validation split (the same windows for every run; every rank computes it, nothing is exchanged;
its time is left out of the training time). At each of those points it keeps the optimizer steps,
the bytes this rank sent (without the one-time broadcast of the model) and the training seconds.
Then it prints, per run, the steps, bytes and seconds to reach ``--target`` perplexity (the first
measuring point at or below it), and the perplexity at the full budget.

Schedules: ``fixed`` (the DataLoader's batch throughout), ``auto_adjust``
(:class:`lightning_commstrats.batching.auto_adjust.AutoAdjust`, which searches at the start of each
epoch) and ``noise_scale`` (:class:`lightning_commstrats.GradientNoiseScale` with a batch warm-up).

    python benchmarks/batch_size.py --out benchmarks/results/batch_size -- \\
        --model.embed_dim=128 --model.hidden_dim=128 --data.max_vocab_size=5000

Arguments after ``--`` go to every run. Results: ``<out>/results.json`` and ``<out>/results.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import REPO, child_env, run_recipe, train_lm_command
from lightning.pytorch.utilities.data import extract_batch_size
from recorded import portable


class Milestones(pl.Callback):
    """Measures the validation perplexity every ``every`` samples (over all ranks), keeps the
    optimizer steps, bytes and training seconds at each point, and stops fit after ``budget`` samples."""

    def __init__(self, out: str, budget: int, every: int, windows: int) -> None:
        self.out, self.budget, self.every, self.windows = out, budget, every, windows
        self.points: list[dict[str, Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        data = trainer.datamodule.dataset("valid")
        items = [data[i] for i in range(min(self.windows, len(data)))]
        self.x = torch.stack([x for x, _ in items]).to(pl_module.device)
        self.y = torch.stack([y for _, y in items]).to(pl_module.device)
        self.samples, self.next_at, self.eval_seconds = 0, self.every, 0.0
        self.start = time.perf_counter()

    def _perplexity(self, pl_module: pl.LightningModule) -> float:
        began = time.perf_counter()
        was_training = pl_module.training
        pl_module.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(self.x), 64):
                logits = pl_module(self.x[i : i + 64]).float()
                y = self.y[i : i + 64].reshape(-1)
                keep = y != -100
                loss = torch.nn.functional.cross_entropy(logits.reshape(len(y), -1)[keep], y[keep], reduction="sum")
                total, count = total + float(loss), count + int(keep.sum())
        pl_module.train(was_training)
        self.eval_seconds += time.perf_counter() - began
        return math.exp(total / count)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        from lightning_commstrats.batching import current_batch_size, in_trial

        if in_trial(trainer):
            return
        self.samples += extract_batch_size(batch) * trainer.world_size
        if self.samples < self.next_at and self.samples < self.budget:
            return
        self.next_at += self.every
        elapsed = time.perf_counter() - self.start - self.eval_seconds
        stats = trainer.strategy.comm_stats.snapshot()
        noise = trainer.callback_metrics.get("train/noise_scale")
        self.points.append(
            {
                "samples": self.samples,
                "steps": trainer.global_step,
                "bytes": stats.bytes_sent - stats.setup_bytes,
                "train_seconds": elapsed,
                "ppl": self._perplexity(pl_module),
                "batch_size": current_batch_size(trainer),
                "noise_scale": float(noise) if noise is not None else None,
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
            }
        )
        if self.samples >= self.budget:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            Path(self.out).write_text(json.dumps(self.points, indent=1))


def schedule_callbacks(schedule: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    if schedule == "fixed":
        return []
    if schedule == "noise_scale":
        init = {
            "beta": 0.95,
            "min_batch_size": args.min_batch,
            "max_batch_size": args.max_batch,
            "growth_factor": 2.0,
            "check_every_n_steps": args.check_every,
            "lr_scaling": args.lr_scaling,
        }
        return [{"class_path": "lightning_commstrats.GradientNoiseScale", "init_args": init}]
    if schedule == "auto_adjust":
        init = {
            "min_batch_size": args.min_batch,
            "max_batch_size": args.max_batch,
            "search_samples": args.search_samples,
            "round_to": args.min_batch,
            "lr_scaling": args.lr_scaling,
        }
        return [{"class_path": "lightning_commstrats.batching.auto_adjust.AutoAdjust", "init_args": init}]
    raise SystemExit(f"unknown schedule {schedule!r}")


def run(strategy: str, schedule: str, seed: int, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    label = f"{strategy}/{schedule}/seed{seed}"
    run_dir = Path(args.out) / "runs" / f"{strategy}_{schedule}_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    points = run_dir / "points.json"
    milestones = {
        "class_path": "batch_size.Milestones",
        "init_args": {
            "out": portable(points),
            "budget": args.samples,
            "every": args.eval_every,
            "windows": args.eval_windows,
        },
    }
    monitor = {"class_path": "lightning_commstrats.CommStatsMonitor", "init_args": {"summary_at_end": True}}
    callbacks = [monitor, *schedule_callbacks(schedule, args), milestones]
    strategy_arg = strategy
    if strategy == "onebit_sgd":  # 1-bit after a full-precision warm start, as benchmarks/results/onebit_quality
        init = {"distributed_after": args.onebit_warm_start}
        strategy_arg = json.dumps({"class_path": "lightning_commstrats.OneBitSGDStrategy", "init_args": init})
    cmd = train_lm_command(
        args.config,
        f"--seed_everything={seed}",
        "--trainer.devices=2",
        f"--trainer.strategy={strategy_arg}",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.callbacks={json.dumps(callbacks)}",
        f"--data.batch_size={args.batch}",
        *extra,
    )
    env = child_env(REPO / "benchmarks", REPO, threads=None)
    print(f"== {label}", flush=True)
    wall = run_recipe(cmd, env, label, run_dir / "log.txt", header=" ".join(cmd[2:]) + "\n\n")
    return {
        "label": label,
        "strategy": strategy,
        "schedule": schedule,
        "seed": seed,
        "wall_seconds": wall,
        "points": json.loads(points.read_text()),
    }


def to_target(points: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((p for p in points if p["ppl"] <= target), None)


def table(results: list[dict[str, Any]], target: float) -> str:
    lines = [
        f"| strategy | schedule | seed | steps to ppl {target:g} | MB to it | train s to it | final ppl |"
        " steps | MB | train s | per-rank batch at end | noise scale at end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        end = r["points"][-1]
        hit = to_target(r["points"], target)
        reach = (
            f"{hit['steps']} | {hit['bytes'] / 1e6:.0f} | {hit['train_seconds']:.0f}" if hit else "not reached | - | -"
        )
        noise = f"{end['noise_scale']:.0f}" if end.get("noise_scale") is not None else "-"
        lines.append(
            f"| {r['strategy']} | {r['schedule']} | {r['seed']} | {reach} | {end['ppl']:.1f} | {end['steps']} |"
            f" {end['bytes'] / 1e6:.0f} | {end['train_seconds']:.0f} | {end['batch_size']} | {noise} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], target: float, path: Path) -> None:
    """Validation perplexity against samples, optimizer steps, MB sent and training seconds: one row per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = list(dict.fromkeys(r["strategy"] for r in results))
    axes_of = (
        ("samples", "samples (both ranks)", 1),
        ("steps", "optimizer steps", 1),
        ("bytes", "MB sent (rank 0)", 1e6),
    )
    axes_of += (("train_seconds", "training seconds", 1),)
    fig, axes = plt.subplots(len(strategies), len(axes_of), figsize=(14, 3.4 * len(strategies)), squeeze=False)
    colour = {"fixed": "C0", "auto_adjust": "C2", "noise_scale": "C3"}
    for row, strategy in zip(axes, strategies, strict=True):
        for r in (r for r in results if r["strategy"] == strategy):
            style = "-" if r["seed"] == min(x["seed"] for x in results) else "--"
            for ax, (key, label, unit) in zip(row, axes_of, strict=True):
                ax.plot(
                    [p[key] / unit for p in r["points"]],
                    [p["ppl"] for p in r["points"]],
                    style,
                    marker="o",
                    ms=3,
                    color=colour.get(r["schedule"], "k"),
                    label=f"{r['schedule']}, seed {r['seed']}",
                )
                ax.set_xlabel(label)
        for ax in row:
            ax.axhline(target, color="grey", lw=0.7)
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
        row[0].set_ylabel(f"{strategy}: validation ppl")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="lstm_demo")
    parser.add_argument("--strategies", nargs="+", default=["allreduce", "onebit_sgd"])
    parser.add_argument("--schedules", nargs="+", default=["fixed", "auto_adjust", "noise_scale"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--samples", type=int, default=12_800, help="sample budget per run, over all ranks")
    parser.add_argument("--eval_every", type=int, default=1_600, help="samples (all ranks) between measurements")
    parser.add_argument("--eval_windows", type=int, default=256, help="validation windows measured")
    parser.add_argument(
        "--target", type=float, nargs="+", default=None, help="perplexity targets, a table each (default: see below)"
    )
    parser.add_argument("--batch", type=int, default=32, help="the DataLoader's per-rank batch (fixed schedule)")
    parser.add_argument("--min_batch", type=int, default=8, help="per-rank batch the adaptive schedules start from")
    parser.add_argument("--max_batch", type=int, default=128)
    parser.add_argument("--check_every", type=int, default=20, help="noise scale: steps between checks")
    parser.add_argument("--search_samples", type=int, default=512, help="AutoAdjust: samples per rank per trial")
    parser.add_argument("--lr_scaling", default="sqrt")
    parser.add_argument("--onebit_warm_start", type=int, default=1_600, help="onebit_sgd: fp32 samples first")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "batch_size"))
    parser.add_argument("--table-only", action="store_true", help="rewrite the table and plot from results.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        results = json.loads((out / "results.json").read_text())
    else:
        results = []
        for strategy in args.strategies:
            for seed in args.seeds:
                for schedule in args.schedules:
                    results.append(run(strategy, schedule, seed, args, extra))
                    (out / "results.json").write_text(json.dumps(results, indent=1))
    # default target: the worst final perplexity of the fixed-batch runs, so every baseline reaches it
    fixed = [r["points"][-1]["ppl"] for r in results if r["schedule"] == "fixed"]
    targets = args.target or [math.ceil(max(fixed or [r["points"][-1]["ppl"] for r in results]))]
    md = (
        f"Config `{portable(args.config)}`, 2 ranks, {args.samples} samples per run (sequences over both ranks),"
        f" perplexity on {args.eval_windows} validation windows every {args.eval_every} samples;"
        f" extra `{' '.join(extra)}`"
    )
    for target in targets:
        md += f"\n\nTarget perplexity {target:g}:\n\n" + table(results, target)
    (out / "results.md").write_text(md + "\n")
    plot(results, targets[-1], out / "perplexity.png")
    print(md)


if __name__ == "__main__":
    main()
