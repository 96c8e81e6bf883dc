"""Mixture-of-experts across two sites: expert-parallel layouts against experts inside each site with a
periodic scheme across, on a two-level emulated cluster.

Four ranks as two sites of two (``benchmarks/cluster.py``): links inside a site at ``--rate`` Mbit/s,
each site's uplink (the slow link between the sites) at each of ``--uplinks``. The MoE recipe (moe_demo's
model: 4 experts per block, top-1, fp32) runs for ``--steps`` steps of ``--batch-size`` windows per rank
in every layout, so all see the same samples:

- ``ep4``: ``expert_parallel`` with ep over all 4 ranks (dp 1): every all-to-all of tokens and the dense
  gradients' all-reduce cross the slow link every step;
- ``dp2xep2``: the hierarchical ``expert_parallel`` layout, dp 2 x ep 2 ``inner="dp"`` (flat ring): the
  replicas of the same experts share a site, the all-to-all crosses the slow link every step;
- ``diloco``, ``diloco_4bit``, ``streaming``: experts inside each site (``expert_parallel=True``,
  ``shard="fsdp"``, ``group_size=2``: the all-to-all and FSDP2 stay inside the site), ``diloco`` (fp32 or
  4-bit pseudo-gradients) or ``streaming_diloco`` (4-bit, 2 fragments) across every ``--sync-period`` steps.

For each layout, seed and uplink rate it prints the mean step time (seconds per training step, the first
step left out), the bytes on the slow link per training step (the two site switches' uplink counters,
sent in both directions, sampled through the run and cut at the start and end of training, so setup
and the closing validation are left out; the whole job's per step beside it, as ``moe_layout.py``
counts), the validation perplexity after the last step, and every figure's ratio to ``ep4`` at the same
rate. Runs are kept in ``<out>/runs/``; ``--table-only`` rebuilds the tables from them.

    python benchmarks/moe_sites.py [--steps 32 --sync-period 8 --seeds 0 1 --uplinks 187.5 18.75]
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from common import write_results
from compare import REPO, Entry, cluster_or_loopback, launch

SEQ_LEN = 35
RANKS = 4


def layouts(sync_period: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(key, label, strategy) of every layout, the reference ``ep4`` first."""
    sites = {"sync_period": sync_period, "shard": "fsdp", "group_size": 2, "expert_parallel": True}
    ep = "lightning_commstrats.ExpertParallelStrategy"
    return [
        (
            "ep4",
            "expert_parallel, ep 4 (over all ranks)",
            {"class_path": ep, "init_args": {"ep_size": 4, "dp_size": 1}},
        ),
        (
            "dp2xep2",
            "expert_parallel, dp 2 x ep 2, inner dp",
            {"class_path": ep, "init_args": {"ep_size": 2, "dp_size": 2, "inner": "dp"}},
        ),
        ("diloco", "sites: diloco fp32", {"class_path": "lightning_commstrats.DiLoCoStrategy", "init_args": sites}),
        (
            "diloco_4bit",
            "sites: diloco 4-bit",
            {"class_path": "lightning_commstrats.DiLoCoStrategy", "init_args": {**sites, "pseudo_grad_bits": 4}},
        ),
        (
            "streaming",
            "sites: streaming_diloco 4-bit",
            {
                "class_path": "lightning_commstrats.StreamingDiLoCoStrategy",
                "init_args": {**sites, "pseudo_grad_bits": 4, "num_fragments": 2},
            },
        ),
    ]


class UplinkCounters:
    """The site switches' uplink ``tx_bytes``, sampled with the wall clock while a job runs.

    One shell per site, inside the switch's namespace, prints ``<unix time> <bytes>`` every
    ``interval`` seconds; :meth:`between` reads the bytes sent in a span, interpolated between samples.
    """

    def __init__(self, cluster: Any, interval: float = 0.2) -> None:
        loop = f"while :; do echo $(date +%s.%N) $(cat /sys/class/net/up0/statistics/tx_bytes); sleep {interval}; done"
        self.samples: list[list[tuple[float, int]]] = [[] for _ in range(cluster.groups)]
        self.procs = [
            subprocess.Popen(
                ["ip", "netns", "exec", f"{cluster.prefix}-sw{g}", "sh", "-c", loop],
                stdout=subprocess.PIPE,
                text=True,
            )
            for g in range(cluster.groups)
        ]
        self.threads = [threading.Thread(target=self._read, args=(g,), daemon=True) for g in range(cluster.groups)]
        for t in self.threads:
            t.start()
        while any(len(s) < 1 for s in self.samples):
            time.sleep(0.05)

    def _read(self, g: int) -> None:
        for line in self.procs[g].stdout:  # type: ignore[union-attr]
            t, n = line.split()
            self.samples[g].append((float(t), int(n)))

    def stop(self) -> None:
        time.sleep(0.5)  # a sample past the end
        for p in self.procs:
            p.terminate()
            p.wait()
        for t in self.threads:
            t.join(timeout=5)

    def between(self, start: float, end: float) -> int:
        """Bytes that left the sites through their uplinks between two unix times (both directions)."""
        return round(sum(at(s, end) - at(s, start) for s in self.samples))


def at(samples: list[tuple[float, int]], t: float) -> float:
    """A counter's value at time ``t``, linear between the samples either side (held past the ends)."""
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return samples[0][1]
    if i == len(samples):
        return samples[-1][1]
    (t0, v0), (t1, v1) = samples[i - 1], samples[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1


def summarize(ranks: list[dict[str, Any]], uplink_train: int | None, uplink_job: int | None) -> dict[str, Any]:
    """One run's figures from its ranks' probe records and the uplink bytes in training and in the job."""
    r0 = ranks[0]
    steps = max(r0["steps"], 1)
    mean_step = statistics.fmean(statistics.fmean(r["step_seconds"][1:] or r["step_seconds"]) for r in ranks)
    return {
        "steps": r0["steps"],
        "mean_step_s": mean_step,
        "train_seconds": r0["train_seconds"],
        "uplink_MB_per_step": None if uplink_train is None else uplink_train / steps / 1e6,
        "uplink_job_MB_per_step": None if uplink_job is None else uplink_job / steps / 1e6,
        "val_ppl": r0["curve"][-1]["val_ppl"] if r0["curve"] else None,
        "samples": r0["curve"][-1]["samples"] if r0["curve"] else None,
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _cell(values: list[float | None], spec: str) -> str:
    """The mean over seeds, with the seeds' values when there are several."""
    mean = _mean(values)
    if len(values) < 2:
        return _fmt(mean, spec)
    return f"{_fmt(mean, spec)} ({' / '.join(_fmt(v, spec) for v in values)})"


def _ratio(value: float | None, reference: float | None) -> str:
    return "n/a" if value is None or not reference else f"{value / reference:.2f}x"


def table(rows: list[dict[str, Any]], keys: list[tuple[str, str]]) -> list[str]:
    """Markdown lines for one uplink rate: a row per layout (means over seeds, each seed in brackets) and
    the ratios of the means to the first layout's (``ep4``)."""
    by_key = {k: [r for r in rows if r["key"] == k] for k, _ in keys}
    means = {
        k: {f: _mean([r[f] for r in rs]) for f in ("mean_step_s", "uplink_MB_per_step", "val_ppl")}
        for k, rs in by_key.items()
    }
    ref = means[keys[0][0]]
    lines = [
        "| layout | step s | slow link MB/step | whole job MB/step | val ppl | step time vs ep4 | slow-link bytes"
        " vs ep4 | ppl vs ep4 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, label in keys:
        rs = by_key[k]
        if not rs:
            continue
        m = means[k]
        lines.append(
            f"| {label} | {_cell([r['mean_step_s'] for r in rs], '.3f')}"
            f" | {_cell([r['uplink_MB_per_step'] for r in rs], '.2f')}"
            f" | {_cell([r['uplink_job_MB_per_step'] for r in rs], '.2f')}"
            f" | {_cell([r['val_ppl'] for r in rs], '.0f')}"
            f" | {_ratio(m['mean_step_s'], ref['mean_step_s'])}"
            f" | {_ratio(m['uplink_MB_per_step'], ref['uplink_MB_per_step'])}"
            f" | {_ratio(m['val_ppl'], ref['val_ppl'])} |"
        )
    return lines


def report(rows: list[dict[str, Any]], args: argparse.Namespace, where: dict[float, str]) -> str:
    keys = [(k, label) for k, label, _ in layouts(args.sync_period) if not args.only or k in args.only]
    out = [
        f"4 ranks as 2 sites of 2; `{Path(args.config).name}` (fp32, warm-up {args.warmup_steps} steps),"
        f" {args.steps} steps of {args.batch_size} x {SEQ_LEN} tokens per rank ({RANKS * args.batch_size}"
        f" windows per step in every layout), validation on {args.val_batches} batches per rank after the last"
        f" step; sites' schemes sync every {args.sync_period} steps. Seeds {', '.join(map(str, args.seeds))}:"
        " mean (each seed).",
    ]
    for uplink in args.uplinks:
        here = [r for r in rows if r["uplink_mbit"] == uplink]
        if not here:
            continue
        out += ["", f"**Uplinks at {uplink:g} Mbit/s** ({where.get(uplink, 'n/a')})", "", *table(here, keys)]
    return "\n".join(out)


def run_one(
    key: str, label: str, strategy: dict[str, Any], seed: int, args: argparse.Namespace, cluster: Any, run_dir: Path
) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("probe.rank*.json"):
        old.unlink()
    counters = UplinkCounters(cluster) if cluster else None
    job_start = time.time()
    try:
        launch(Entry(key, label, strategy, "ours"), args, seed, cluster, run_dir)
    finally:
        job_end = time.time()
        if counters:
            counters.stop()
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("probe.rank*.json"))]
    train_start = ranks[0]["train_start_unix"]
    # validation only after the last step: training is one span from the start
    train_end = train_start + ranks[0]["train_seconds"]
    row = summarize(
        ranks,
        counters.between(train_start, train_end) if counters else None,
        counters.between(job_start, job_end) if counters else None,
    )
    return {"key": key, "label": label, "seed": seed, **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--sync-period", type=int, default=8, help="steps between the sites' syncs")
    parser.add_argument("--warmup-steps", type=int, default=4, help="the recipe's lr warm-up, shortened")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rate", type=float, default=1000.0, help="Mbit/s inside a site")
    parser.add_argument("--uplinks", type=float, nargs="+", default=[187.5, 18.75], help="Mbit/s of the slow links")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--only", nargs="+", help="layout keys (default: all)")
    parser.add_argument("--loopback", action="store_true", help="no namespaces: a smoke run, no link figures")
    parser.add_argument("--table-only", action="store_true", help="rebuild the tables from <out>/runs")
    parser.add_argument("--config", default=str(REPO / "lightning_commstrats" / "configs" / "moe_demo.yaml"))
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "moe_sites"))
    args = parser.parse_args()
    known = [k for k, _, _ in layouts(args.sync_period)]
    if args.only and (unknown := [k for k in args.only if k not in known]):
        raise SystemExit(f"unknown layouts {unknown}; keys: {known}")
    if args.val_batches < 2:  # the Trainer reads limit_val_batches=1 as 1.0: the whole validation set
        raise SystemExit(f"--val-batches must be at least 2, got {args.val_batches}")
    if not Path(args.out).resolve().is_relative_to(REPO):
        raise SystemExit(f"--out must be inside the repository {REPO} (the probes record paths relative to it)")
    args.ranks, args.val_every, args.max_steps = RANKS, args.steps, args.steps
    args.target_ppl = args.budget_seconds = None  # a fixed number of steps, no race
    args.recipe_args = [f"--data.seq_len={SEQ_LEN}", f"--model.warmup_steps={args.warmup_steps}"]
    out = Path(args.out)
    runs = out / "runs"
    rows: list[dict[str, Any]] = []
    where: dict[float, str] = {}
    for uplink in args.uplinks:
        folder = runs / f"uplink{uplink:g}"
        if args.table_only:
            for p in sorted(folder.glob("*/seed*/summary.json")):
                saved = json.loads(p.read_text())
                rows.append(saved["row"])
                where[uplink] = saved["where"]
            continue
        with cluster_or_loopback(args, args.rate, groups=2, uplink_mbit=uplink) as (cluster, here):
            where[uplink] = here
            for key, label, strategy in layouts(args.sync_period):
                if args.only and key not in args.only:
                    continue
                for seed in args.seeds:
                    print(f"== uplinks {uplink:g} Mbit/s, {label}, seed {seed}", flush=True)
                    run_dir = folder / key / f"seed{seed}"
                    row = {"uplink_mbit": uplink, **run_one(key, label, strategy, seed, args, cluster, run_dir)}
                    print(json.dumps(row), flush=True)
                    summary = {"where": here, "strategy": strategy, "args": sys_args(args), "row": row}
                    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
                    rows.append(row)
    text = report(rows, args, where)
    write_results(out, text, rows)
    print(text)


def sys_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings a run was measured under (what makes its row comparable)."""
    names = ("steps", "sync_period", "warmup_steps", "rate", "batch_size", "val_batches", "config", "recipe_args")
    return {n: (Path(v).name if n == "config" else v) for n in names if (v := getattr(args, n)) is not None}


if __name__ == "__main__":
    main()
