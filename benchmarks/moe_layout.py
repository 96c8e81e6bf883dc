"""Hierarchical against symmetric expert-parallel layout on a two-level emulated cluster.

Four ranks in two groups of two (``benchmarks/cluster.py``): links inside a group at ``--rate``
Mbit/s, the groups' uplinks at 3/16 of that (the 2022 paper's 3/16-pruned fat-tree). The MoE recipe
runs with ``dp = 2`` and ``ep = 2`` in both layouts:

- ``inner="dp"`` (hierarchical, the paper's choice): the two replicas of the same experts share a
  group; every all-to-all of tokens crosses the uplink, the expert-gradient all-reduce does not;
- ``inner="ep"`` (symmetric): each expert-parallel pair shares a group; tokens stay inside, the
  expert and dense gradients' data-parallel traffic crosses the uplink.

It prints tokens per second for both and their ratio, whatever it turns out to be.

    python benchmarks/moe_layout.py [--steps 30 --rate 1000]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from compare import REPO, Entry, cluster_or_loopback, launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rate", type=float, default=1000.0, help="Mbit/s inside a group; uplinks get 3/16")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--config", default=str(REPO / "lightning_commstrats" / "configs" / "moe_demo.yaml"))
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "moe_layout"))
    args = parser.parse_args()
    args.ranks, args.val_every, args.val_batches, args.max_steps = 4, args.steps, 1, args.steps
    args.target_ppl = args.budget_seconds = None  # a fixed number of steps, no race
    args.recipe_args = ["--data.seq_len=35", "--trainer.limit_val_batches=0"]
    out = Path(args.out)
    seq_len = 35
    rows = []
    with cluster_or_loopback(args, args.rate, groups=2, uplink_mbit=args.rate * 3 / 16) as (cluster, where):
        for inner, name in (("dp", "hierarchical (dp inner)"), ("ep", "symmetric (ep inner)")):
            strategy = {
                "class_path": "lightning_commstrats.ExpertParallelStrategy",
                "init_args": {"ep_size": 2, "dp_size": 2, "inner": inner},
            }
            run_dir = out / inner
            run_dir.mkdir(parents=True, exist_ok=True)
            for old in run_dir.glob("probe.rank*.json"):
                old.unlink()
            print(f"== {name}", flush=True)
            launch(Entry(inner, name, strategy, "ours"), args, 0, cluster, run_dir)
            ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("probe.rank*.json"))]
            steps = [r["step_seconds"][1:] for r in ranks]
            mean_step = statistics.fmean(statistics.fmean(s) for s in steps)
            tokens = args.batch_size * seq_len * 4
            cs = ranks[0]["comm_stats"]
            rows.append(
                {
                    "layout": name,
                    "mean_step_s": mean_step,
                    "tokens_per_s": tokens / mean_step,
                    "tokens_MB_per_step": cs.get("tokens/bytes_sent", 0) / ranks[0]["steps"] / 1e6,
                    "grad_MB_per_step": (cs.get("grad/bytes_sent", 0) + cs.get("grad_experts/bytes_sent", 0))
                    / ranks[0]["steps"]
                    / 1e6,
                }
            )
    lines = [
        f"4 ranks (dp 2 x ep 2), {where}; `{Path(args.config).name}`, {args.steps} steps of {args.batch_size}"
        f" x {seq_len} tokens per rank.",
        "",
        "| layout | mean step s | tokens/s | all-to-all MB/step (rank 0) | gradient MB/step (rank 0) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['layout']} | {r['mean_step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['tokens_MB_per_step']:.3f} |"
        f" {r['grad_MB_per_step']:.3f} |"
        for r in rows
    ]
    if len(rows) == 2:
        lines.append(
            f"\nhierarchical / symmetric tokens per second: {rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}"
        )
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(text)


if __name__ == "__main__":
    main()
