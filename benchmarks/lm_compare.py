"""Train the LM recipe with several strategies on the same data and budget, side by side.

For each strategy it runs ``recipes/train_lm.py fit`` (Lightning starts the ranks), then reads the
validation perplexity (CSV logger), every rank's communication figures (``CommStatsMonitor``) and
the wall time, and prints one table with ratios against the first strategy. Results go to
``<out>/results.json`` and ``<out>/results.md``.

    python benchmarks/lm_compare.py --config lstm_demo --devices 2 \\
        --strategies allreduce onebit_sgd:distributed_after=2560 --out benchmarks/results/onebit

A strategy is ``name[:key=value,...]`` with a registered name; values are parsed as JSON when
they can be (``8``, ``true``, ``"steps"``). Extra arguments after ``--`` go to every run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from common import REPO, launcher_free_env, run_recipe, strategy_json, train_lm_command, write_results
from lightning.pytorch.strategies import StrategyRegistry
from recorded import portable

import lightning_commstrats  # noqa: F401 - registers the names
from lightning_commstrats.comm import wire
from lightning_commstrats.models import LanguageModel


def parse_strategy(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = spec.partition(":")
    if name not in StrategyRegistry:
        raise SystemExit(f"unknown strategy {name!r}; registered: {sorted(StrategyRegistry)}")
    kwargs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return name, kwargs


def strategy_arg(name: str, kwargs: dict[str, Any]) -> str:
    return strategy_json(name, kwargs) if kwargs else name


def run(label: str, name: str, kwargs: dict[str, Any], args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    run_dir = Path(args.out) / label.replace(":", "_").replace(",", "_").replace("=", "-")
    stats_dir = run_dir / "comm"
    monitor = [{"class_path": "lightning_commstrats.CommStatsMonitor", "init_args": {"save_dir": str(stats_dir)}}]
    cmd = train_lm_command(
        args.config,
        f"--trainer.devices={args.devices}",
        f"--trainer.strategy={strategy_arg(name, kwargs)}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={run_dir}",
        "--trainer.logger.name=csv",
        "--trainer.logger.version=0",
        f"--trainer.callbacks={json.dumps(monitor)}",
        "--trainer.enable_progress_bar=false",
        *extra,
    )
    print(f"== {label}: {' '.join(cmd[2:])}", flush=True)
    wall = run_recipe(cmd, launcher_free_env(), label, run_dir / "log.txt")
    ranks = [json.loads(p.read_text()) for p in sorted(stats_dir.glob("comm_stats.rank*.json"))]
    metrics = run_dir / "csv" / "version_0" / "metrics.csv"
    rows = list(csv.DictReader(open(metrics))) if metrics.exists() else []  # none without validation
    val = [float(r["val/ppl"]) for r in rows if r.get("val/ppl")]
    hparams = yaml.safe_load(open(run_dir / "csv" / "version_0" / "hparams.yaml"))
    return {
        "label": label,
        "strategy": name,
        "kwargs": kwargs,
        "wall_seconds": wall,
        "val_ppl": val[-1] if val else math.nan,
        "ranks": ranks,
        "hparams": hparams,
    }


def quantized_numel(hparams: dict[str, Any], small: int) -> tuple[int, int]:
    """(all trainable values, values in tensors a 1-bit scheme quantizes) of the run's model."""
    keys = LanguageModel.__init__.__code__.co_varnames[1 : LanguageModel.__init__.__code__.co_argcount]
    model = LanguageModel(**{k: v for k, v in hparams.items() if k in keys})
    params = list({id(p): p for p in model.parameters()}.values())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.dim() >= 2 and p.numel() > small)


def table(results: list[dict[str, Any]], devices: int) -> str:
    base = results[0]
    lines = [
        f"| strategy | val ppl | vs {base['label']} | wall s | MB/step/rank | grad MB/step | quantized part:"
        " sent / fp32 ring | comm share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rank0 = r["ranks"][0]
        steps = max(rank0["steps"], 1)
        grad = sum(v for k, v in rank0.items() if k.startswith("grad") and k.endswith("/bytes_sent"))
        q = rank0.get("grad_quantized/bytes_sent", 0)
        q_steps = rank0.get("grad_quantized/calls", 0) // 2  # two collectives per quantized step
        # without the first broadcast; a strategy that counts no bytes (ddp: the ranks alone) shows 0
        per_step = (rank0.get("bytes_sent", 0) - rank0.get("setup/bytes_sent", 0)) / steps
        ratio = "-"
        if q:
            small = r["kwargs"].get("small_tensor_numel", 1024)
            _, qn = quantized_numel(r["hparams"], small)
            ratio = f"1/{wire.all_reduce_bytes(qn, 4, devices) * q_steps / q:.1f}"
        share = rank0.get("comm_seconds", 0.0) / rank0["wall_seconds"] if rank0["wall_seconds"] else 0.0
        lines.append(
            f"| {r['label']} | {r['val_ppl']:.2f} | {100 * (r['val_ppl'] / base['val_ppl'] - 1):+.2f}% |"
            f" {r['wall_seconds']:.0f} | {per_step / 1e6:.3f} | {grad / steps / 1e6:.3f} |"
            f" {ratio} | {100 * share:.0f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "lightning_commstrats" / "configs" / "lstm_demo.yaml"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=["allreduce", "onebit_sgd"])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "lm_compare"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = [run(spec, *parse_strategy(spec), args, extra) for spec in args.strategies]
    md = f"Config `{portable(args.config)}`, {args.devices} ranks, extra `{' '.join(extra)}`\n\n" + table(
        results, args.devices
    )
    write_results(args.out, md, results, default=str)
    print(md)


if __name__ == "__main__":
    main()
