"""The standard comparison: this package's strategies next to what users would pick instead, on an
emulated cluster of rate-limited links, with every figure measured in one run.

Each rank runs in its own network namespace (``benchmarks/cluster.py``) and the job is a real
multi-node launch (Lightning ``num_nodes=N``, ``MASTER_ADDR`` / ``NODE_RANK`` / ``WORLD_SIZE``).
For every entry it records, per rank: the wall time of every step, validation perplexity against
samples and wall time, the interface's ``tx_bytes`` and, for this package's strategies, the bytes in
``comm_stats``. It writes one JSON per run, ``results.json``, ``results.md`` (the table) and PNG
plots (perplexity against wall time, bytes per step) to ``--out``.

    python benchmarks/compare.py                       # the standard comparison (make bench)
    python benchmarks/compare.py --quick --loopback    # a smoke run on 2 ranks, seconds per entry
    python benchmarks/compare.py --scaling             # ring all-reduce bytes per rank for 2, 4, 8 ranks

Without root (or where ``ip netns`` is refused) it runs on loopback instead and says so in every
output: loopback has no rate limit, so times there say nothing about slow networks.
``local_sgd`` needs ``mpiexec``, which cannot start ranks inside namespaces here (no remote
launcher), so it runs on loopback and is labelled so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from cluster import ClusterUnavailable, EmulatedCluster  # noqa: E402
from lm_compare import launcher_free_env  # noqa: E402

from lightning_commstrats import cost_model  # noqa: E402


@dataclass
class Entry:
    label: str
    strategy: Any  # a registry name or a {"class_path", "init_args"} dict
    kind: str  # "peer", "ours" or "limit"
    predict: str = ""  # cost-model scheme
    extra: list[str] = field(default_factory=list)
    mpi: bool = False


def entries(steps: int, quick: bool) -> list[Entry]:
    warm = max(steps // 10, 2)  # PowerSGD needs 2+ plain steps
    out = [
        Entry("alone (no communication)", "auto", "limit"),
        Entry("ddp", "ddp", "peer", "ring"),
        Entry("ddp + fp16_compress_hook", {"class_path": "peers.FP16CompressDDP"}, "peer", "fp16"),
        Entry(
            "ddp + powerSGD r1",
            {
                "class_path": "peers.PowerSGDDDP",
                "init_args": {"matrix_approximation_rank": 1, "start_powerSGD_iter": warm},
            },
            "peer",
        ),
        Entry(
            "ddp + powerSGD r4",
            {
                "class_path": "peers.PowerSGDDDP",
                "init_args": {"matrix_approximation_rank": 4, "start_powerSGD_iter": warm},
            },
            "peer",
        ),
        Entry(
            "post-local SGD (period 8)",
            {"class_path": "peers.PostLocalSGDDDP", "init_args": {"period": 8, "start_iter": warm}},
            "peer",
            "periodic8",
        ),
        Entry("allreduce", "allreduce", "ours", "ring"),
        Entry(
            "onebit_sgd",
            {
                "class_path": "lightning_commstrats.OneBitSGDStrategy",
                "init_args": {"distributed_after": warm, "distributed_after_unit": "steps"},
            },
            "ours",
            "onebit",
        ),
        Entry(
            "sampled_vocab",
            {
                "class_path": "lightning_commstrats.SampledVocabStrategy",
                "init_args": {"alpha": 0.2 if not quick else 0.5, "beta": 0.1},
            },
            "ours",
            "sampled",
        ),
        Entry(
            "model_averaging (period 8)",
            {
                "class_path": "lightning_commstrats.ModelAveragingStrategy",
                "init_args": {"sync_period": 8, "sync_period_unit": "steps"},
            },
            "ours",
            "periodic8",
        ),
        Entry(
            "bmuf (period 8)",
            {
                "class_path": "lightning_commstrats.BMUFStrategy",
                "init_args": {"sync_period": 8, "sync_period_unit": "steps"},
            },
            "ours",
            "periodic8",
        ),
        Entry(
            "local_sgd (Q 8)",
            {"class_path": "lightning_commstrats.LocalSGDStrategy", "init_args": {"sync_period": 8}},
            "ours",
            "periodic8",
            mpi=True,
        ),
    ]
    if quick:
        keep = {"alone (no communication)", "ddp", "ddp + powerSGD r1", "allreduce", "onebit_sgd", "bmuf (period 8)"}
        out = [e for e in out if e.label in keep]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(entry: Entry, args: argparse.Namespace, cluster: EmulatedCluster | None, run_dir: Path) -> float:
    """Run one entry on ``args.ranks`` ranks; returns the wall seconds of the whole job."""
    n = args.ranks
    alone = entry.kind == "limit"

    def probe(out: Path) -> str:
        init = {"out": str(out), "samples_per_step": args.batch_size * (1 if alone else n)}
        return f"--trainer.callbacks={json.dumps([{'class_path': 'probe.BenchProbe', 'init_args': init}])}"

    base = [
        sys.executable,
        str(REPO / "recipes" / "train_lm.py"),
        "fit",
        "--config",
        args.config,
        f"--trainer.max_steps={args.steps}",
        f"--trainer.val_check_interval={args.val_every}",
        f"--trainer.limit_val_batches={args.val_batches}",
        "--trainer.max_epochs=-1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=false",
        f"--data.batch_size={args.batch_size}",
        "--trainer.num_sanity_val_steps=0",
        *args.extra,
    ]
    strategy = entry.strategy if isinstance(entry.strategy, str) else json.dumps(entry.strategy)
    env = launcher_free_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]), PYTHONUNBUFFERED="1")
    logs = [open(run_dir / f"log{i}.txt", "w") for i in range(n)]
    start = time.perf_counter()
    procs = []
    try:
        if entry.mpi:
            mpiexec = Path(sys.executable).parent / "mpiexec"
            cmd = [
                str(mpiexec),
                "-n",
                str(n),
                *base,
                probe(run_dir),
                f"--trainer.devices={n}",
                f"--trainer.strategy={strategy}",
            ]
            procs.append(
                subprocess.Popen(cmd, env={**env, "BENCH_IFACE": "lo"}, stdout=logs[0], stderr=subprocess.STDOUT)
            )
        else:
            port = _free_port()
            for i in range(n):
                if alone:  # N independent one-rank jobs, each with its own probe folder
                    cmd = [*base, probe(run_dir / f"alone{i}"), "--trainer.devices=1", "--trainer.strategy=auto"]
                    rank_env = dict(env)
                else:
                    cmd = [
                        *base,
                        probe(run_dir),
                        "--trainer.devices=1",
                        f"--trainer.num_nodes={n}",
                        f"--trainer.strategy={strategy}",
                    ]
                    rank_env = {
                        **env,
                        "MASTER_ADDR": cluster.address(0) if cluster else "127.0.0.1",
                        "MASTER_PORT": str(port),
                        "WORLD_SIZE": str(n),
                        "NODE_RANK": str(i),
                        "LOCAL_RANK": "0",
                    }
                if cluster:
                    rank_env["GLOO_SOCKET_IFNAME"] = "eth0"
                    procs.append(cluster.popen(i, cmd, env=rank_env, stdout=logs[i], stderr=subprocess.STDOUT))
                else:
                    rank_env["BENCH_IFACE"] = "lo"
                    procs.append(subprocess.Popen(cmd, env=rank_env, stdout=logs[i], stderr=subprocess.STDOUT))
        deadline = start + args.timeout
        while any(p.poll() is None for p in procs):
            if time.perf_counter() > deadline or any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()
    if any(p.returncode != 0 for p in procs):
        tail = (run_dir / "log0.txt").read_text()[-3000:]
        raise RuntimeError(f"{entry.label} failed or timed out (logs in {run_dir}):\n{tail}")
    return time.perf_counter() - start


def summarize(entry: Entry, run_dir: Path, wall: float, args: argparse.Namespace) -> dict[str, Any]:
    pattern = "alone*/probe.rank0.json" if entry.kind == "limit" else "probe.rank*.json"
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob(pattern))]
    r0 = ranks[0]
    steps = max(r0["steps"], 1)
    step_times = r0["step_seconds"][1:] or r0["step_seconds"]
    cs = r0["comm_stats"] or {}
    cs_bytes = None
    if cs:
        cs_bytes = (cs["bytes_sent"] - cs.get("setup/bytes_sent", 0)) / steps
    tx = [r["tx_bytes"] / steps for r in ranks if r["tx_bytes"] is not None]
    curve = r0["curve"]
    return {
        "label": entry.label,
        "kind": entry.kind,
        "mpi_loopback": entry.mpi,
        "wall_seconds": wall,
        "steps": steps,
        "median_step_s": statistics.median(step_times),
        "mean_step_s": statistics.fmean(step_times),
        "comm_s_per_step": cs.get("comm_seconds", 0.0) / steps if cs else None,
        "tx_bytes_per_step": statistics.fmean(tx) if tx else None,
        "comm_stats_bytes_per_step": cs_bytes,
        "final_ppl": curve[-1]["val_ppl"] if curve else None,
        "curve": curve,
        "param_shapes": r0.get("param_shapes"),
    }


def time_to_target(curve: list[dict[str, float]], target: float) -> float | None:
    for point in curve:
        if point["val_ppl"] <= target:
            return point["wall_seconds"]
    return None


def predictions(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, float]:
    shapes = next((r["param_shapes"] for r in rows if r.get("param_shapes")), None)
    if not shapes:
        return {}
    shape = cost_model.ModelShape(tuple(tuple(s) for s in shapes))
    bw, n = args.rate * 1e6, args.ranks
    return {
        "ring": cost_model.ring_allreduce(shape, n, bw),
        "fp16": cost_model.ring_allreduce(shape, n, bw) / 2,
        "onebit": cost_model.onebit(shape, n, bw),
        "periodic8": cost_model.periodic(shape, n, bw, 8),
        "ps": cost_model.parameter_server(shape, n, bw),
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace, where: str, pred: dict[str, float]) -> str:
    # MPI runs on loopback (shared memory, no rate limit) are not comparable with the cluster's
    ours = [r for r in rows if r["kind"] == "ours" and r["final_ppl"] and not r["mpi_loopback"]]
    peers = [r for r in rows if r["kind"] == "peer" and r["final_ppl"]]
    ref = next((r for r in rows if r["label"] == "ddp"), None)
    target = 1.05 * ref["final_ppl"] if ref and ref["final_ppl"] else None
    lines = [
        f"{args.ranks} ranks, {where}; config `{Path(args.config).name}`, {args.steps} steps of"
        f" {args.batch_size} windows per rank, validation every {args.val_every} steps on {args.val_batches} batches.",
        (f"Parameter-server prediction for this model: {pred['ps']:.2f} s/step. " if "ps" in pred else "")
        + (f"Target perplexity: {target:.1f} (ddp's final x 1.05)." if target else ""),
        "Predicted comm s: the cost model at the link rate (bytes x 8 / rate)"
        + ("; loopback has no such rate." if "loopback" in where else "."),
        "",
        "| run | kind | median step s | mean step s | predicted comm s | comm s (measured) | MB/step/rank (veth tx)"
        " | MB/step/rank (comm_stats) | tx / comm_stats | final val ppl | time to target s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tx, cs = r["tx_bytes_per_step"], r["comm_stats_bytes_per_step"]
        ttt = time_to_target(r["curve"], target) if target and r["kind"] != "limit" else None
        cells = [
            r["label"] + (" (loopback, MPI)" if r["mpi_loopback"] else ""),
            r["kind"],
            f"{r['median_step_s']:.3f}",
            f"{r['mean_step_s']:.3f}",
            _fmt(pred.get(r.get("predict", "")), "{:.3f}"),
            _fmt(r["comm_s_per_step"], "{:.3f}"),
            _fmt(tx / 1e6 if tx is not None else None, "{:.3f}"),
            _fmt(cs / 1e6 if cs is not None else None, "{:.3f}"),
            _fmt(tx / cs if tx and cs else None, "{:.2f}"),
            _fmt(r["final_ppl"], "{:.1f}"),
            _fmt(ttt, "{:.0f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if ours and peers and target:

        def best(group, key):
            vals = [(key(r), r["label"]) for r in group if key(r) is not None]
            return min(vals) if vals else None

        for name, key in (
            ("time to target", lambda r: time_to_target(r["curve"], target)),
            ("bytes per step", lambda r: r["tx_bytes_per_step"]),
            ("mean step time", lambda r: r["mean_step_s"]),
        ):
            b_ours, b_peer = best(ours, key), best(peers, key)
            if b_ours and b_peer:
                lines.append(
                    f"\nBest of this package / best peer, {name}: {b_ours[1]} {b_ours[0]:.4g} / {b_peer[1]}"
                    f" {b_peer[0]:.4g} = {b_ours[0] / b_peer[0]:.3f}"
                )
    return "\n".join(lines)


def _run_dir(out: Path, entry: Entry) -> Path:
    return out / entry.label.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def plots(rows: list[dict[str, Any]], out: Path, where: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["curve"] and r["kind"] != "limit":
            ax.plot(
                [p["wall_seconds"] for p in r["curve"]],
                [p["val_ppl"] for p in r["curve"]],
                marker="o",
                label=r["label"],
            )
    ax.set_xlabel("wall seconds")
    ax.set_ylabel("validation perplexity")
    ax.set_title(f"Perplexity against wall time ({where})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ppl_vs_wall.png", dpi=120)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labeled = [r for r in rows if r["tx_bytes_per_step"] is not None and r["kind"] != "limit"]
    ax.barh([r["label"] for r in labeled], [r["tx_bytes_per_step"] / 1e6 for r in labeled])
    ax.set_xlabel("MB sent per step and rank (interface counter)")
    ax.set_title(f"Bytes per step ({where})")
    fig.tight_layout()
    fig.savefig(out / "bytes_per_step.png", dpi=120)


def scaling(args: argparse.Namespace) -> None:
    """Per-rank bytes of ring all-reduce for 2, 4 and 8 ranks (tiny model, a few steps)."""
    rows = []
    for n in (2, 4, 8):
        sub = argparse.Namespace(**{**vars(args), "ranks": n})
        for entry in (Entry("ddp", "ddp", "peer"), Entry("allreduce", "allreduce", "ours")):
            run_dir = Path(args.out) / f"scaling-{n}-{entry.label}"
            run_dir.mkdir(parents=True, exist_ok=True)
            with cluster_or_loopback(sub) as (cluster, where):
                wall = launch(entry, sub, cluster, run_dir)
            rows.append((n, entry.label, summarize(entry, run_dir, wall, sub), where))
    lines = ["| ranks | run | MB/step/rank (veth tx) | MB/step/rank (comm_stats) | where |", "|---|---|---|---|---|"]
    for n, label, s, where in rows:
        cs = s["comm_stats_bytes_per_step"]
        lines.append(
            f"| {n} | {label} | {s['tx_bytes_per_step'] / 1e6:.3f} | {cs / 1e6 if cs else float('nan'):.3f} | {where} |"
        )
    text = "\n".join(lines)
    (Path(args.out) / "scaling.md").write_text(text + "\n")
    print(text)


class _NoCluster:
    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> tuple[None, str]:
        return None, self.where

    def __exit__(self, *exc: object) -> None:
        pass


class cluster_or_loopback:
    """The emulated cluster for ``args.ranks`` hosts at ``args.rate``, or loopback (and why)."""

    def __init__(self, args: argparse.Namespace, groups: int = 1, uplink_mbit: float | None = None) -> None:
        self.args = args
        self.groups = groups
        self.uplink_mbit = uplink_mbit
        self.cluster: EmulatedCluster | None = None

    def __enter__(self) -> tuple[EmulatedCluster | None, str]:
        if getattr(self.args, "loopback", False):
            return None, "loopback (no rate limit)"
        try:
            self.cluster = EmulatedCluster(self.args.ranks, self.args.rate, self.groups, self.uplink_mbit)
            self.cluster.create()
            if self.groups > 1:
                return self.cluster, (
                    f"emulated cluster: groups of {self.args.ranks // self.groups} at {self.args.rate:g} Mbit/s,"
                    f" uplinks at {self.uplink_mbit:g} Mbit/s"
                )
            return self.cluster, f"emulated cluster, {self.args.rate:g} Mbit/s links"
        except ClusterUnavailable as err:
            print(f"emulated cluster unavailable ({err}); falling back to loopback", flush=True)
            return None, f"loopback (no rate limit; emulated cluster unavailable: {err})"

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            self.cluster.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny config, 2 ranks, a few steps")
    parser.add_argument("--loopback", action="store_true", help="do not build namespaces; use loopback")
    parser.add_argument("--scaling", action="store_true", help="ring all-reduce bytes per rank for 2, 4, 8 ranks")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--config", default=str(REPO / "recipes" / "configs" / "lstm_demo.yaml"))
    parser.add_argument("--only", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--table-only", action="store_true", help="rebuild the table from the runs in --out")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per entry")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "standard"))
    parser.add_argument("extra", nargs="*", help="extra recipe arguments after --")
    args = parser.parse_args()
    if args.quick:
        args.config = str(REPO / "recipes" / "configs" / "lstm_tiny.yaml")
        args.ranks, args.steps, args.val_every, args.val_batches, args.batch_size = 2, 6, 3, 2, 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.scaling:
        if not args.quick:
            args.config = str(REPO / "recipes" / "configs" / "lstm_tiny.yaml")
            args.steps, args.val_every, args.val_batches, args.batch_size = 5, 5, 1, 8
        scaling(args)
        return
    every = entries(args.steps, args.quick)
    todo = [e for e in every if not args.only or e.label in args.only]
    if args.table_only:
        saved = [json.loads(p.read_text()).get("where") for p in out.glob("*/summary.json")]
        todo, where = [], next((w for w in saved if w), "unknown")
    with cluster_or_loopback(args) if todo else _NoCluster(where) as (cluster, where):
        for entry in todo:
            run_dir = _run_dir(out, entry)
            run_dir.mkdir(parents=True, exist_ok=True)
            for old in run_dir.glob("probe.rank*.json"):
                old.unlink()
            print(f"== {entry.label}", flush=True)
            wall = launch(entry, args, None if entry.mpi else cluster, run_dir)
            row = summarize(entry, run_dir, wall, args)
            row["predict"] = entry.predict
            row["where"] = where
            (run_dir / "summary.json").write_text(json.dumps(row, indent=1))
            print(
                f"   median step {row['median_step_s']:.3f}s, final ppl {row['final_ppl']}, wall {wall:.0f}s",
                flush=True,
            )
    # the table covers every entry measured into this folder, so `--only` can redo a few
    rows = [json.loads(p.read_text()) for p in (_run_dir(out, e) / "summary.json" for e in every) if p.exists()]
    text = table(rows, args, where, predictions(args, rows))
    (out / "results.json").write_text(json.dumps({"where": where, "rows": rows}, indent=1))
    (out / "results.md").write_text(text + "\n")
    plots(rows, out, where)
    print(text)


if __name__ == "__main__":
    main()
