"""Hierarchical against symmetric expert-parallel layout on a two-level emulated cluster.

Four ranks in two groups of two (``benchmarks/cluster.py``): links inside a group at ``--rate``
Mbit/s, the groups' uplinks at 3/16 of that (the 2022 paper's 3/16-pruned fat-tree). The MoE recipe
runs with ``dp = 2`` and ``ep = 2`` in both layouts:

- ``inner="dp"`` (hierarchical, the paper's choice): the two replicas of the same experts share a
  group; every all-to-all of tokens crosses the uplink, the expert-gradient all-reduce does not;
- ``inner="ep"`` (symmetric): each expert-parallel pair shares a group; tokens stay inside, the
  expert and dense gradients' data-parallel traffic crosses the uplink.

and, with ``group_size=2`` (the package's two-level gradient exchange: reduce-scatter inside a
group, all-reduce of half the buffer across, all-gather inside), the hierarchical layout again with
the slow hop in fp32 and in 8 bits (error feedback). It prints tokens per second for each, the bytes
that crossed the uplinks per step (the switches' uplink counters, both directions), and the ratios
to the symmetric flat layout, whatever they turn out to be.

    python benchmarks/moe_layout.py [--steps 30 --rate 1000]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import write_results
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
        layouts = (
            ("ep", "symmetric (ep inner), flat ring", {"inner": "ep"}),
            ("dp", "hierarchical (dp inner), flat ring", {"inner": "dp"}),
            ("dp_two", "hierarchical, two-level exchange", {"inner": "dp", "group_size": 2}),
            (
                "dp_two8",
                "hierarchical, two-level, 8-bit slow hop",
                {"inner": "dp", "group_size": 2, "slow_hop_bits": 8},
            ),
        )
        for key, name, settings in layouts:
            strategy = {
                "class_path": "lightning_commstrats.ExpertParallelStrategy",
                "init_args": {"ep_size": 2, "dp_size": 2, **settings},
            }
            run_dir = out / key
            run_dir.mkdir(parents=True, exist_ok=True)
            for old in run_dir.glob("probe.rank*.json"):
                old.unlink()
            print(f"== {name}", flush=True)
            up_before = [cluster.uplink_tx_bytes(g) for g in range(2)] if cluster else [0, 0]
            launch(Entry(key, name, strategy, "ours"), args, 0, cluster, run_dir)
            up_after = [cluster.uplink_tx_bytes(g) for g in range(2)] if cluster else [0, 0]
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
                    "grad_MB_per_step": sum(
                        v
                        for k, v in cs.items()
                        if k.endswith("/bytes_sent") and k.split("/")[0].startswith(("grad", "slow"))
                    )
                    / ranks[0]["steps"]
                    / 1e6,
                    # everything that crossed the uplinks during the run (setup, validation and
                    # the launch included), per training step
                    "uplink_MB_per_step": sum(a - b for a, b in zip(up_after, up_before, strict=True))
                    / ranks[0]["steps"]
                    / 1e6,
                }
            )
    lines = [
        f"4 ranks (dp 2 x ep 2), {where}; `{Path(args.config).name}`, {args.steps} steps of {args.batch_size}"
        f" x {seq_len} tokens per rank.",
        "",
        "| layout | mean step s | tokens/s | vs symmetric | all-to-all MB/step (rank 0) | gradient MB/step"
        " (rank 0) | uplinks MB/step (interfaces) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = rows[0]["tokens_per_s"]
    lines += [
        f"| {r['layout']} | {r['mean_step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x |"
        f" {r['tokens_MB_per_step']:.3f} | {r['grad_MB_per_step']:.3f} | {r['uplink_MB_per_step']:.2f} |"
        for r in rows
    ]
    text = "\n".join(lines)
    write_results(out, text, rows)
    print(text)


if __name__ == "__main__":
    main()
