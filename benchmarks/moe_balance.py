"""Expert load, dropped tokens and validation perplexity of the MoE balancing modes on the Brown recipe.

    python benchmarks/moe_balance.py --config moe_demo --devices 2 --steps 400 --seeds 0 1 \\
        --modes aux capacity swipe bias --out /tmp/moe_balance [-- --trainer.val_check_interval=200]

A mode is ``name[:override,...]`` with ``name`` a ``--model.balance`` value and overrides of
``--model.*`` (``bias:bias_update_rate=0.01``, ``bias:bias_update_rule=quantile``).
Every run is ``recipes/train_lm.py fit`` (Lightning starts the ranks) on the same config, seed and
number of optimizer steps, so the runs see the same samples. A callback records, after every
optimizer step, each MoE layer's load summed over the ranks (one extra all-reduce a step, charged as
metrics traffic), the dropped slots, the expert biases (``balance="bias"``), and the validation
perplexity whenever validation runs; validation runs every ``--val-every`` steps and at the end.

Per run: max / mean expert load per layer and step, over the steps after ``--warmup`` (mean, 95th
percentile, maximum, share of steps at most 1.1) and over the last ``--last`` steps, dropped slots
as a share of all slots, and the validation perplexity at the last step. Results go to
``<out>/results.json`` (the runs, each with its record of loads) and ``<out>/results.md``;
``--table-only`` prints the table of the runs already there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import HERE, REPO, child_env, train_lm_command


class LoadRecorder(L.Callback):
    """Records each MoE layer's load over all ranks after every optimizer step, and the validation
    perplexity; rank 0 writes them to ``path`` (JSON) when fit ends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.loads: list[list[list[int]]] = []  # [step][layer][expert]
        self.dropped: list[int] = []
        self.slots: list[int] = []
        self.val: list[tuple[int, float]] = []
        self.bias: list[list[list[float]]] = []  # [step][layer][expert], balance="bias" only

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        layers = pl_module.net.moe_layers()
        local = torch.stack(
            [torch.cat([m.routing.load, torch.tensor([m.routing.dropped, m.routing.kept.numel()])]) for m in layers]
        )
        total = trainer.strategy.reduce(local, reduce_op="sum")
        self.loads.append(total[:, :-2].tolist())
        self.dropped.append(int(total[:, -2].sum()))
        self.slots.append(int(total[:, -1].sum()))
        if all(hasattr(m, "expert_bias") for m in layers):  # the same on every rank
            self.bias.append([m.expert_bias.tolist() for m in layers])

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and "val/ppl" in trainer.callback_metrics:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val/ppl"])))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            record = {"loads": self.loads, "dropped": self.dropped, "slots": self.slots, "val": self.val}
            record["bias"] = self.bias
            Path(self.path).write_text(json.dumps(record))


def parse_mode(spec: str) -> tuple[str, list[str]]:
    """``name:a=1,b=2`` -> (``name``, ``["--model.a=1", "--model.b=2"]``)."""
    name, _, rest = spec.partition(":")
    return name, [f"--model.{item}" for item in filter(None, rest.split(","))]


def summarize(record: dict[str, Any], warmup: int, last: int) -> dict[str, Any]:
    loads = torch.tensor(record["loads"], dtype=torch.float64)  # [steps, layers, experts]
    per_step = loads.max(-1).values / loads.mean(-1)  # [steps, layers]
    ratio = per_step[warmup:].reshape(-1)
    pooled = loads[-last:].sum(0)  # each layer's load summed over the last steps: the batch noise averaged out
    return {
        "steps": loads.shape[0],
        "last_mean": per_step[-last:].mean().item(),
        "last_max": per_step[-last:].max().item(),
        "last_pooled": (pooled.max(-1).values / pooled.mean(-1)).max().item(),
        "balance_mean": ratio.mean().item(),
        "balance_p95": ratio.quantile(0.95).item(),
        "balance_max": ratio.max().item(),
        "share_at_most_1.1": (ratio <= 1.1).double().mean().item(),
        "dropped_share": sum(record["dropped"]) / max(sum(record["slots"]), 1),
        "val_ppl": record["val"][-1][1] if record["val"] else float("nan"),
        "val_curve": record["val"],
    }


def run(mode: str, seed: int, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    name, overrides = parse_mode(mode)
    label = f"{mode.replace(':', '_').replace(',', '_').replace('=', '-')}_seed{seed}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / f"{label}.json"
    callbacks = [
        {"class_path": "lightning_commstrats.CommStatsMonitor", "init_args": {"summary_at_end": False}},
        {"class_path": "moe_balance.LoadRecorder", "init_args": {"path": str(record_path)}},
    ]
    cmd = train_lm_command(
        args.config,
        f"--seed_everything={seed}",
        f"--trainer.devices={args.devices}",
        f"--trainer.max_steps={args.steps}",
        f"--trainer.val_check_interval={args.val_every}",
        f"--trainer.limit_val_batches={args.val_batches}",
        f"--trainer.callbacks={json.dumps(callbacks)}",
        "--trainer.enable_progress_bar=false",
        f"--model.balance={name}",
        *overrides,
        *extra,
    )
    env = child_env(REPO, HERE, threads=args.threads)
    print(" ".join(cmd[1:]), flush=True)
    start = time.time()
    done = subprocess.run(cmd, env=env, cwd=REPO).returncode
    if not record_path.exists() or record_path.stat().st_mtime < start:
        raise SystemExit(f"{label}: the run failed (exit status {done}) before it wrote {record_path}")
    if done:  # gloo's threads torn down at interpreter exit can abort a rank after fit has ended
        print(f"{label}: exit status {done} after the run wrote its record", flush=True)
    result = {"mode": mode, "seed": seed, "seconds": time.time() - start, "record": str(record_path)}
    return result


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.config}, {args.devices} rank(s), {args.steps} optimizer steps. max/mean: the busiest expert's"
        " load over the mean, per MoE layer and optimizer step, the load summed over the ranks. Columns"
        f" 3-6 over the steps after {args.warmup}; 'last {args.last}': over the last {args.last} steps,"
        " per step (mean, max) and of the load summed over those steps (pooled, the worse layer)",
        "",
        f"| mode | seed | mean | p95 | max | steps <= 1.1 | last {args.last} mean | last {args.last} max"
        f" | last {args.last} pooled | dropped | val ppl |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(results, key=lambda r: (r["seed"], r["mode"])):
        r = summarize(json.loads(Path(run["record"]).read_text()), args.warmup, args.last)
        lines.append(
            f"| {run['mode']} | {run['seed']} | {r['balance_mean']:.3f} | {r['balance_p95']:.3f}"
            f" | {r['balance_max']:.3f} | {r['share_at_most_1.1']:.0%} | {r['last_mean']:.3f} | {r['last_max']:.3f}"
            f" | {r['last_pooled']:.3f} | {r['dropped_share']:.2%} | {r['val_ppl']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="moe_demo")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of every run")
    parser.add_argument("--warmup", type=int, default=100, help="steps left out of the load figures")
    parser.add_argument("--last", type=int, default=100, help="steps of the 'last' columns")
    parser.add_argument("--table-only", action="store_true", help="print the table of the runs in --out")
    parser.add_argument("--val-every", type=int, default=200, help="validation every this many steps")
    parser.add_argument("--val-batches", type=float, default=1.0, help="limit_val_batches")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--modes", nargs="+", default=["aux", "capacity", "swipe", "bias"])
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--out", default="/tmp/moe_balance")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    results_path = Path(args.out) / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["mode"], r["seed"]) for r in results}
    for seed in [] if args.table_only else args.seeds:
        for mode in args.modes:
            if (mode, seed) in done:
                continue
            results.append(run(mode, seed, args, extra))
            results_path.write_text(json.dumps(results, indent=1))
            (Path(args.out) / "results.md").write_text(table(results, args))
    print(table(results, args))


if __name__ == "__main__":
    main()
