"""The 2018 multi-GPU neural-LM paper's comparison, reproduced on the emulated cluster.

The paper (Brown corpus, 40,000 training sentences, ~49k-word vocabulary, 4 GPUs) compares three
ways of exchanging the gradients of a neural LM against the epoch time: a parameter server (every
worker's gradient gathered to one server, the model sent back), ring all-reduce, and
sampled-vocabulary updates (only the rows of the words in the minibatch, the frequent words and
some random words travel). Its findings: against the parameter server, ring all-reduce saves about
25% of the epoch time and sampled-vocabulary updates about 41%; the saving grows with the
vocabulary; a feed-forward (5-gram) LM gains less from more devices than an RNN LM.

This script runs, for each model (LSTM LM; feed-forward 5-gram LM), each vocabulary (the full
Brown vocabulary, ``--data.max_vocab_size=60000``, ~49k words; a smaller one, 10000), each number
of ranks N in {1, 2, 3, 4} and each scheme (``parameter_server`` in sync mode with one server,
``allreduce``, ``sampled_vocab``), ``recipes/train_lm.py fit`` for a fixed number of samples in
total (the same at every N: each rank processes 1/N of them, the "epoch time" analogue), one rank
per host of the emulated cluster (``benchmarks/cluster.py``: network namespaces on a star of
``tc tbf`` links at ``--rate`` Mbit/s), one thread per rank. At N=1 the three schemes are the
same single process: it runs once per model x vocabulary.

Every rank runs one uncounted warm-up step, then the counted steps; :class:`EpochClock` (a
callback in this file) times them from the end of the warm-up step to the end of the last step
(process start-up, tokenizer and data set-up and the first step's allocations are outside; there
is no validation), and reads the strategy's ``comm_stats`` and the interface counter of ``eth0``
at both ends. The parent also reads every host's interface counter
(``EmulatedCluster.tx_bytes``) before and after the whole job.

    python benchmarks/paper2018.py                       # the full sweep (about half an hour, 2 idle cores)
    python benchmarks/paper2018.py --only model=lstm vocab=small n=1,2 scheme=allreduce
    python benchmarks/paper2018.py --table-only          # results.md, results.json, epoch_time.png from runs/
    python benchmarks/paper2018.py --list                # the runs the options select, nothing run

Output in ``benchmarks/results/paper2018/``: ``runs/<run>/run.json`` (each run's raw figures, every
rank) and logs, ``results.json`` (all runs with their derived figures), ``results.md`` and
``epoch_time.png``. Namespaces are named ``p2018-*`` (not the default ``cstrat-*``, so a run here
never removes another benchmark's cluster); a run killed hard leaves them behind:
``python benchmarks/cluster.py --prefix p2018 cleanup`` removes them.

The models are CPU-sized (LSTM: embedding and hidden 256, tied; FFN: embedding 128, hidden 512;
32 samples per rank and step); the paper's were GPU-sized (hidden 1024, 64 per worker). Four ranks
share this machine's 2 cores, so per-rank compute slows at 3 and 4 ranks: every table also gives
each run's compute seconds and a dedicated-device estimate (the N=1 run's compute seconds scaled
to one rank's share of the samples, plus the measured communication seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from cluster import EmulatedCluster, cluster_or_loopback  # noqa: E402
from common import (  # noqa: E402
    child_env,
    failed_ranks,
    log_tail,
    node_env,
    popen_on,
    read_rank_results,
    run_ranks,
    strategy_json,
    train_lm_command,
    write_results,
)

OUT = HERE / "results" / "paper2018"
PREFIX = "p2018"  # namespace prefix of this benchmark's clusters
MASTER_PORT = 29517  # every host is a fresh namespace: any port is free there

MODELS: dict[str, dict[str, Any]] = {
    "lstm": {
        "label": "LSTM LM",
        "config": "lstm_paper",  # the paper's RNN LM setting (SGD, dropout 0.5, tied, clip 0.25), shrunk
        "args": ["--model.embed_dim=256", "--model.hidden_dim=256"],
        "size": "LSTM, 1 layer, embedding = hidden = 256, tied output, dropout 0.5, SGD lr 1, clip 0.25",
        "sample": "window of 35 tokens",
    },
    "ffn": {
        "label": "feed-forward 5-gram LM",
        "config": "ffn_paper",  # the paper's 5-gram FFN setting (SGD momentum 0.9, dropout 0.3), shrunk
        "args": [
            "--model.arch=ffn",
            "--data.mode=ngram",
            "--data.order=5",
            "--model.embed_dim=128",
            "--model.hidden_dim=512",
        ],
        "size": "feed-forward, 4 context words, embedding 128, hidden 512, untied, dropout 0.3, SGD lr 0.5 mom. 0.9",
        "sample": "5-gram (4 context words, 1 predicted)",
    },
}
SCHEMES = ("parameter_server", "allreduce", "sampled_vocab")
SINGLE = "single"  # the N=1 run every scheme shares
RANKS = (1, 2, 3, 4)
# The paper's savings of epoch time against the parameter server at 4 GPUs, full vocabulary.
PAPER_SAVING = {"allreduce": 25.0, "sampled_vocab": 41.0}
SCHEME_LABEL = {
    SINGLE: "single process (every scheme)",
    "parameter_server": "parameter_server (sync, 1 server)",
    "allreduce": "allreduce (ring)",
    "sampled_vocab": "sampled_vocab",
}
COLORS = {"parameter_server": "tab:red", "allreduce": "tab:blue", "sampled_vocab": "tab:green"}


# ---------------------------------------------------------------------- inside every rank


def _tx_bytes(iface: str) -> int | None:
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except OSError:
        return None


def _comm(trainer: L.Trainer) -> dict[str, float] | None:
    stats = getattr(trainer.strategy, "comm_stats", None)
    return None if stats is None else dict(stats.snapshot().as_dict())


class EpochClock(L.Callback):
    """Times the counted training steps of one rank and what they communicated; writes
    ``<out>/rank<r>.json`` when training ends.

    The window runs from the end of optimizer step ``warmup_steps`` to the end of the last step
    (``trainer.max_steps``): the time of ``max_steps - warmup_steps`` steps of the training loop
    (forward, backward, exchange, optimizer, the next batch's loading), nothing before. At both ends
    it reads the strategy's ``comm_stats`` (bytes this rank sent, seconds the training loop waited
    for communication) and the kernel's ``tx_bytes`` of ``iface`` (the host's interface inside a namespace). Under
    ``sampled_vocab`` it also records the rows exchanged per step and the distinct word ids of
    this rank's minibatch (what the cost model's ``sampled_rows`` takes).

    Args:
        out: folder for the per-rank JSON.
        warmup_steps: optimizer steps before the window (not counted).
        iface: network interface whose counter is read.
    """

    def __init__(self, out: str, warmup_steps: int = 1, iface: str = "eth0") -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.out = out
        self.warmup_steps = warmup_steps
        self.iface = iface if Path(f"/sys/class/net/{iface}").exists() else "lo"
        self._t0: float | None = None
        self._t1: float | None = None
        self._cpu0 = 0.0
        self._cpu1 = 0.0
        self._last = 0.0
        self._tx0: int | None = None
        self._tx1: int | None = None
        self._cs0: dict[str, float] | None = None
        self._cs1: dict[str, float] | None = None
        self.step_seconds: list[float] = []
        self.rows: list[int] = []
        self.ids: list[int] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)

    def _counting(self, trainer: L.Trainer) -> bool:
        return trainer.global_step >= self.warmup_steps

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.warmup_steps == 0:
            self._start(trainer)

    def _start(self, trainer: L.Trainer) -> None:
        self._cs0 = _comm(trainer)
        self._tx0 = _tx_bytes(self.iface)
        self._cpu0 = time.process_time()
        self._t0 = self._last = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self._counting(trainer) and hasattr(trainer.strategy, "last_rows"):
            from lightning_commstrats.compression import batch_token_ids

            self.ids.append(int(batch_token_ids(batch, pl_module.hparams.vocab_size).numel()))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self.warmup_steps and self._t0 is None:
            self._start(trainer)
            return
        if self._t0 is None or self._t1 is not None:
            return
        now = time.perf_counter()
        self.step_seconds.append(now - self._last)
        self._last = now
        rows = getattr(trainer.strategy, "last_rows", None)
        if rows is not None:
            self.rows.append(int(rows.numel()))
        if step >= trainer.max_steps > 0:
            self._t1 = now
            self._cpu1 = time.process_time()
            self._tx1 = _tx_bytes(self.iface)
            self._cs1 = _comm(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._t0 is not None and self._t1 is None:  # stopped early (the data ran out)
            self._t1, self._tx1, self._cs1 = time.perf_counter(), _tx_bytes(self.iface), _comm(trainer)
            self._cpu1 = time.process_time()
        from lightning_commstrats.models.base import declared_vocabulary

        params = list({id(p): p for p in pl_module.parameters() if p.requires_grad}.values())
        vocab = declared_vocabulary(pl_module)
        comm = None
        if self._cs0 is not None and self._cs1 is not None:
            comm = {k: self._cs1[k] - self._cs0.get(k, 0) for k in self._cs1 if k != "wall_seconds"}
        loss = trainer.callback_metrics.get("train/loss")
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "threads": torch.get_num_threads(),
            "global_steps": trainer.global_step,
            "warmup_steps": self.warmup_steps,
            "counted_steps": len(self.step_seconds),
            "window_seconds": None if self._t0 is None else self._t1 - self._t0,
            # CPU seconds of this process in the window (every thread: compute, gloo, RPC)
            "cpu_seconds": None if self._t0 is None else self._cpu1 - self._cpu0,
            "step_seconds": self.step_seconds,
            "iface": self.iface,
            "tx_bytes": None if self._tx0 is None or self._tx1 is None else self._tx1 - self._tx0,
            "comm": comm,
            "rows_per_step": self.rows,
            "ids_per_step": self.ids,
            "train_loss": None if loss is None else float(loss),
            "vocab_size": int(pl_module.hparams.vocab_size),
            "vocab_width": sum(p[0].numel() for p in vocab),
            "param_shapes": [list(p.shape) for p in params],
        }
        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


# ---------------------------------------------------------------------- the sweep


def vocab_sizes(args: argparse.Namespace) -> dict[str, int]:
    return {"full": 60000, "small": args.small_vocab}


def run_id(model: str, vocab: str, n: int, scheme: str) -> str:
    return f"{model}_{vocab}_n{n}_{scheme}"


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What makes runs comparable: the tables only use runs measured under these settings."""
    return {
        "rate_mbit": args.rate,
        "samples": args.samples,
        "batch_size": args.batch_size,
        "warmup_steps": args.warmup_steps,
        "alpha": args.alpha,
        "beta": args.beta,
        "vocab": vocab_sizes(args),
        "models": {k: [m["config"], *m["args"]] for k, m in MODELS.items()},
        "seed": args.seed,
    }


def parse_only(items: list[str] | None) -> dict[str, set[str]]:
    """``--only model=lstm n=1,2``: the allowed values per key (model, vocab, n, scheme)."""
    keys = {"model", "vocab", "n", "scheme"}
    out: dict[str, set[str]] = {}
    for item in items or []:
        key, sep, values = item.partition("=")
        key = key.lower()
        if not sep or key not in keys:
            raise SystemExit(f"--only takes KEY=V1,V2 with KEY one of {sorted(keys)}; got {item!r}")
        out.setdefault(key, set()).update(v for v in values.split(",") if v)
    return out


def planned(args: argparse.Namespace) -> list[tuple[str, str, int, str]]:
    """(model, vocab, N, scheme) of every run the options select, in the order they run."""
    only = parse_only(args.only)
    sizes = vocab_sizes(args)

    def keep(key: str, *values: Any) -> bool:
        return key not in only or any(str(v) in only[key] for v in values)

    runs = []
    for model in MODELS:
        for vocab, size in sizes.items():
            for n in RANKS:
                for scheme in [SINGLE] if n == 1 else SCHEMES:
                    # the N=1 run belongs to every scheme: a scheme filter keeps it
                    schemes = SCHEMES if scheme == SINGLE else (scheme,)
                    if (
                        keep("model", model)
                        and keep("vocab", vocab, size)
                        and keep("n", n)
                        and keep("scheme", *schemes)
                    ):
                        runs.append((model, vocab, n, scheme))
    return runs


def strategy_arg(scheme: str, args: argparse.Namespace) -> str:
    if scheme == SINGLE:
        return "allreduce"  # one process: no exchange, but comm_stats like every other run
    if scheme == "allreduce":
        return "allreduce"
    if scheme == "sampled_vocab":
        init = {"alpha": args.alpha, "beta": args.beta}
    else:
        init = {"mode": "sync", "num_servers": 1, "rpc_transports": ["uv"]}
    return strategy_json(scheme, init)


def recipe_command(
    model: str, vocab_size: int, n: int, scheme: str, args: argparse.Namespace, run_dir: Path
) -> list[str]:
    steps = args.samples // (args.batch_size * n)
    clock = {
        "class_path": "paper2018.EpochClock",
        "init_args": {"out": str(run_dir), "warmup_steps": args.warmup_steps},
    }
    spec = MODELS[model]
    return train_lm_command(
        spec["config"],
        *spec["args"],
        f"--data.max_vocab_size={vocab_size}",
        f"--data.batch_size={args.batch_size}",
        f"--seed_everything={args.seed}",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        f"--trainer.num_nodes={n}",
        f"--trainer.strategy={strategy_arg(scheme, args)}",
        f"--trainer.max_steps={steps + args.warmup_steps}",
        "--trainer.max_epochs=-1",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
        f"--trainer.callbacks={json.dumps([clock])}",
    )


def launch(cmd: list[str], n: int, cluster: EmulatedCluster | None, run_dir: Path, timeout: float) -> float:
    """Start the ``n`` ranks (one per host), wait for them; returns the job's wall seconds."""
    env = child_env(HERE, REPO)
    env["MKL_NUM_THREADS"] = "1"

    def start_rank(i: int, log: Any) -> subprocess.Popen:
        rank_env = node_env(env, i, n, cluster.address(0) if cluster else "127.0.0.1", MASTER_PORT) if n > 1 else env
        if cluster is not None:
            # gloo and TensorPipe (the parameter server's RPC) bind the host's interface
            rank_env = {**rank_env, "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}
        return popen_on(cluster, i, cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT)

    start = time.perf_counter()
    procs = run_ranks(start_rank, n, run_dir, timeout)
    wall = time.perf_counter() - start
    if failed_ranks(procs):
        tail = log_tail(run_dir, failed_ranks(procs)[0])
        raise RuntimeError(f"{run_dir.name} failed or timed out after {wall:.0f} s (logs in {run_dir}):\n{tail}")
    return wall


def run_one(model: str, vocab: str, n: int, scheme: str, args: argparse.Namespace) -> dict[str, Any]:
    size = vocab_sizes(args)[vocab]
    run_dir = Path(args.out) / "runs" / run_id(model, vocab, n, scheme)
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in [*run_dir.glob("rank*.json"), run_dir / "run.json"]:
        old.unlink(missing_ok=True)
    cmd = recipe_command(model, size, n, scheme, args, run_dir)
    with cluster_or_loopback(args.loopback, n, args.rate, prefix=PREFIX) as (cluster, where):
        load = os.getloadavg()[0]  # other work on the cores would slow this run: recorded, shown in results.md
        before = [cluster.tx_bytes(i) for i in range(n)] if cluster else None
        wall = launch(cmd, n, cluster, run_dir, args.timeout)
        after = [cluster.tx_bytes(i) for i in range(n)] if cluster else None
    ranks = read_rank_results(run_dir, n)
    record = {
        "id": run_id(model, vocab, n, scheme),
        "model": model,
        "vocab": vocab,
        "max_vocab_size": size,
        "n": n,
        "scheme": scheme,
        "where": where,
        "settings": settings(args),
        "command": shlex.join(cmd),
        "job_wall_seconds": wall,
        "loadavg_1min_at_start": load,
        "host_tx_bytes_job": None if before is None else [a - b for a, b in zip(after, before, strict=True)],
        "ranks": ranks,
    }
    (run_dir / "run.json").write_text(json.dumps(record, indent=1))
    return record


# ---------------------------------------------------------------------- figures of a run


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def derive(run: dict[str, Any]) -> dict[str, Any]:
    """The figures the tables show, from a run's raw per-rank records (means over ranks)."""
    ranks = run["ranks"]
    steps = ranks[0]["counted_steps"]
    time_s = _mean([r["window_seconds"] for r in ranks])
    comm_s = _mean([r["comm"]["comm_seconds"] for r in ranks if r["comm"]]) or 0.0
    cs_bytes = [r["comm"]["bytes_sent"] / steps for r in ranks if r["comm"] and steps]
    tx = [r["tx_bytes"] / steps for r in ranks if r["tx_bytes"] is not None and steps]
    loopback = run["where"].startswith("loopback")
    return {
        "steps_per_rank": steps,
        "samples": steps * run["settings"]["batch_size"] * run["n"],
        "time_s": time_s,
        "time_s_max_rank": max(r["window_seconds"] for r in ranks),
        "comm_s": comm_s,
        "compute_s": time_s - comm_s,
        "cpu_s": _mean([r["cpu_seconds"] for r in ranks if r.get("cpu_seconds") is not None]),
        "comm_s_per_step": comm_s / steps if steps else None,
        "comm_share": comm_s / time_s if time_s else None,
        "cs_bytes_per_step": _mean(cs_bytes),
        "cs_bytes_per_step_max": max(cs_bytes) if cs_bytes else None,
        # on loopback one `lo` counter would hold every rank's traffic: not a per-host figure
        "tx_bytes_per_step": None if loopback else _mean(tx),
        "tx_bytes_per_step_max": None if loopback or not tx else max(tx),
        "rows_per_step": _mean([x for r in ranks for x in r["rows_per_step"]]),
        "ids_per_rank": _mean([x for r in ranks for x in r["ids_per_step"]]),
        "median_step_s": statistics.median(ranks[0]["step_seconds"]) if ranks[0]["step_seconds"] else None,
        "train_loss": ranks[0]["train_loss"],
        "vocab_size": ranks[0]["vocab_size"],
        "params": sum(math.prod(s) for s in ranks[0]["param_shapes"]),
    }


def predicted_comm_per_step(run: dict[str, Any], fig: dict[str, Any]) -> tuple[float | None, str | None]:
    """The cost model's communication seconds per step at the link rate; (None, why) when it has none."""
    if run["where"].startswith("loopback"):
        return None, "loopback"
    from lightning_commstrats import cost_model

    r0 = run["ranks"][0]
    shape = cost_model.ModelShape(tuple(tuple(s) for s in r0["param_shapes"]), r0["vocab_size"], r0["vocab_width"])
    n, bw = run["n"], run["settings"]["rate_mbit"] * 1e6
    scheme = run["scheme"]
    if scheme == SINGLE:
        return 0.0, None
    if scheme == "allreduce":
        return cost_model.ring_allreduce(shape, n, bw), None
    if scheme == "sampled_vocab":
        rows = round(fig["rows_per_step"] or 0)
        return cost_model.sampled_rows(shape, n, bw, rows, round(fig["ids_per_rank"] or 0)), None
    return cost_model.parameter_server(shape, n, bw, num_servers=1), None


# ---------------------------------------------------------------------- tables and plot


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _saving(base: float | None, value: float | None) -> float | None:
    return None if not base or value is None else 100 * (1 - value / base)


def build_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run with its derived figures, the prediction, the dedicated-device estimate and the
    savings against the parameter server at the same model, vocabulary and N."""
    rows = []
    for run in runs:
        fig = derive(run)
        pred, why = predicted_comm_per_step(run, fig)
        rows.append({**run, **fig, "predicted_comm_s_per_step": pred})
        if why:
            rows[-1]["predicted_note"] = why
    index = {(r["model"], r["vocab"], r["n"], r["scheme"]): r for r in rows}
    for r in rows:
        single = index.get((r["model"], r["vocab"], 1, SINGLE))
        # one rank's share of the samples on a device of its own: the N=1 compute / N, plus the comm measured
        r["dedicated_s"] = None if single is None else single["compute_s"] / r["n"] + r["comm_s"]
        r["speedup"] = None if single is None or not r["time_s"] else single["time_s"] / r["time_s"]
        r["dedicated_speedup"] = None if single is None or not r["dedicated_s"] else single["time_s"] / r["dedicated_s"]
    for r in rows:  # every row's estimate is known now
        ps = index.get((r["model"], r["vocab"], r["n"], "parameter_server"))
        is_scheme = r["scheme"] in SCHEMES and r["scheme"] != "parameter_server"
        r["saving_vs_ps"] = _saving(ps["time_s"], r["time_s"]) if ps and is_scheme else None
        r["dedicated_saving_vs_ps"] = _saving(ps["dedicated_s"], r["dedicated_s"]) if ps and is_scheme else None
    return rows


def _order(r: dict[str, Any]) -> tuple:
    return (
        list(MODELS).index(r["model"]),
        ["full", "small"].index(r["vocab"]),
        r["n"],
        ([SINGLE, *SCHEMES]).index(r["scheme"]),
    )


def sweep_command(args: argparse.Namespace) -> str:
    """``python benchmarks/paper2018.py`` with every option that differs from its default."""
    parser = make_parser()
    cmd = ["python", "benchmarks/paper2018.py"]
    for name in ("rate", "samples", "batch_size", "warmup_steps", "small_vocab", "alpha", "beta", "seed", "out"):
        value, default = getattr(args, name), parser.get_default(name)
        if name == "out" and Path(value).resolve() == Path(default).resolve():
            continue
        if value != default:
            cmd += [f"--{name.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join(cmd)


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, skipped: list[str]) -> str:
    s = settings(args)
    where = sorted({r["where"] for r in rows}) or ["-"]
    full_cmd = sweep_command(args)
    lines = [
        "# The 2018 multi-GPU NLM paper's comparison on the emulated cluster",
        "",
        "Commands (repository root, as root for the network namespaces; the timings assume nothing else runs"
        " on the machine's 2 cores):",
        "",
        "```bash",
        f"{full_cmd}                 # every run (tables and plot rebuilt at the end)",
        f"{full_cmd} --only model=lstm vocab=full n=4   # a subset: keys model, vocab, n, scheme",
        f"{full_cmd} --table-only    # rebuild results.md / results.json / epoch_time.png from runs/*/run.json",
        "```",
        "",
        "Each run is `recipes/train_lm.py fit` (the exact command of every run is in `results.json`, field"
        " `command`), one rank per host.",
        "",
        "## Setting",
        "",
        f"- **Where**: {'; '.join(where)}: every rank in its own network namespace with one `eth0`, a star of"
        f" `tc tbf` links at {args.rate:g} Mbit/s each way (no added latency), launched as a multi-node job"
        " (`num_nodes=N`, `devices=1`), gloo and TensorPipe bound to `eth0`. One thread per rank"
        " (`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`).",
        f"- **Samples**: {args.samples} samples in total at every N (each rank processes {args.samples} / N,"
        f" in {args.samples // args.batch_size} / N steps of {args.batch_size} samples per rank): the epoch-time"
        " analogue. A sample is a window of 35 tokens for the LSTM and one 5-gram (4 context words, 1"
        " predicted) for the FFN, so the LSTM predicts 35x more words per sample.",
        f"- **Timing**: training loop only. Every rank first runs {args.warmup_steps} uncounted warm-up"
        " step(s); the clock (`EpochClock` in `paper2018.py`) runs from the end of the warm-up to the end of"
        " the last step (process start-up, tokenizer and data set-up, the first step's allocations are"
        " outside; no validation). Time, comm s and compute s are means over the ranks (the schemes are"
        " synchronous: the ranks end within a few ms of each other). CPU s: the rank process's CPU"
        " seconds in the same window (every thread: compute, gloo, RPC), mean over ranks; below the time when"
        " the rank waited for the network or for a core.",
        "- **Comm s**: seconds inside the strategy's exchanges (`comm_stats`: collectives, and for the"
        " parameter server the RPC round trips; with one server that includes the time the server waits"
        " for the slowest worker); compute s = time - comm s (forward, backward, optimizer, data).",
        "- **MB/step/rank**: bytes sent per step and rank, from the interface counter of each host's `eth0`"
        " (mean over hosts, the busiest host in brackets; TCP/IP headers included; the kernel counter"
        " `EmulatedCluster.tx_bytes` reads, read by each rank at the two ends of the timed window) and from"
        " `comm_stats` (payload). The parent's `EmulatedCluster.tx_bytes` over the whole job (start-up, warm-up"
        " and teardown included) is in `results.json` as `host_tx_bytes_job`. With one parameter server, rank"
        " 0's host is the server: its link carries the other workers' gradients in and the averages out.",
        "- **Predicted comm s/step**: `lightning_commstrats.cost_model` at the link rate:"
        " `parameter_server(model, n, bandwidth, num_servers=1)`, `ring_allreduce`, `sampled_rows` (with"
        " the measured rows per step and distinct words per rank's minibatch).",
        "- **Saving vs PS**: 1 - time / parameter_server's time at the same model, vocabulary and N.",
        f"- **Models (CPU-sized; the paper's were GPU-sized, hidden 1024, 64 samples per worker)**: LSTM:"
        f" {MODELS['lstm']['size']} (config `lstm_paper` with `{' '.join(MODELS['lstm']['args'])}`);"
        f" FFN: {MODELS['ffn']['size']} (config `ffn_paper` with `{' '.join(MODELS['ffn']['args'])}`);"
        f" {args.batch_size} samples per rank and step, seed {args.seed}.",
        f"- **Vocabularies**: full Brown (`--data.max_vocab_size=60000`, the ~49k words of the 40,000"
        f" training sentences) and `--data.max_vocab_size={s['vocab']['small']}`.",
        f"- **sampled_vocab**: alpha = {args.alpha} most frequent words and beta = {args.beta} random words per"
        " step, plus every word of the step's minibatches (all ranks'), at both vocabulary sizes (the paper's"
        " spirit: a fixed number of rows, so what travels does not grow with the vocabulary); no error"
        " feedback (the paper's); the other parameters by fp32 ring all-reduce.",
        '- **parameter_server**: `mode="sync", num_servers=1, rpc_transports=["uv"]`: the server is'
        " hosted on rank 0; every worker pushes its gradient, the server averages and sends it back, every"
        " rank steps its own optimizer (the paper's bytes: the gradient up, the model's size back).",
        "",
        "**Caveat: 2 CPU cores for up to 4 ranks.** At 3 and 4 ranks the ranks share 2 cores, so each"
        " rank's compute is slower than it would be on a device of its own, and collectives wait for the"
        " slowest rank (that wait counts as comm s). The compute s column shows it; the **dedicated-device"
        " estimate** = (compute s of the N=1 run) / N + the run's measured comm s, i.e. the time if each"
        " rank computed its 1/N of the samples as fast as a lone process does. Its comm s still includes"
        " waiting caused by the shared cores, so at 3-4 ranks it is an upper bound on a dedicated machine's.",
        "",
    ]
    loads = sorted(
        (r.get("loadavg_1min_at_start"), r["id"]) for r in rows if r.get("loadavg_1min_at_start") is not None
    )
    if loads:
        lines += [
            f"Load average (1 min) when each run started: median {statistics.median(x for x, _ in loads):.2f},"
            f" highest {loads[-1][0]:.2f} ({loads[-1][1]}); a run's own ranks add up to N, and the previous"
            " run's ranks fade from it over a minute, so values well above 4 mean other work shared the cores.",
            "",
        ]
    if skipped:
        lines += [f"Not in the tables (measured under other settings): {', '.join(sorted(skipped))}.", ""]
    by_panel: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in sorted(rows, key=_order):
        by_panel.setdefault((r["model"], r["vocab"]), []).append(r)
    for (model, vocab), panel in by_panel.items():
        v = panel[0]["vocab_size"]
        lines += [
            f"## {MODELS[model]['label']}, {vocab} vocabulary ({v} words, {panel[0]['params'] / 1e6:.2f}M parameters)",
            "",
            "| N | scheme | steps/rank | time for the samples s | compute s | comm s | comm share | CPU s"
            " | MB/step/rank interface (busiest) | MB/step/rank comm_stats | comm s/step measured"
            " | comm s/step predicted | saving vs PS | dedicated-device estimate s | saving vs PS (estimate) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in panel:
            tx = "-"
            if r["tx_bytes_per_step"] is not None:
                tx = f"{r['tx_bytes_per_step'] / 1e6:.2f} ({r['tx_bytes_per_step_max'] / 1e6:.2f})"
            pred = _f(r["predicted_comm_s_per_step"], "{:.3f}")
            if r.get("predicted_note"):
                pred = f"- ({r['predicted_note']})"
            baseline = r["scheme"] == "parameter_server"
            cells = [
                str(r["n"]),
                SCHEME_LABEL[r["scheme"]],
                str(r["steps_per_rank"]),
                _f(r["time_s"], "{:.1f}"),
                _f(r["compute_s"], "{:.1f}"),
                _f(r["comm_s"], "{:.1f}"),
                _f(r["comm_share"] * 100 if r["comm_share"] is not None else None, "{:.0f}%"),
                _f(r["cpu_s"], "{:.1f}"),
                tx,
                _f(r["cs_bytes_per_step"] / 1e6 if r["cs_bytes_per_step"] is not None else None, "{:.2f}"),
                _f(r["comm_s_per_step"], "{:.3f}"),
                pred,
                "baseline" if baseline else _f(r["saving_vs_ps"], "{:+.0f}%"),
                _f(r["dedicated_s"], "{:.1f}"),
                "baseline" if baseline else _f(r["dedicated_saving_vs_ps"], "{:+.0f}%"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += paper_table(rows)
    lines += speedup_table(rows)
    lines += ["![time for the samples against N](epoch_time.png)", ""]
    return "\n".join(lines)


def paper_table(rows: list[dict[str, Any]]) -> list[str]:
    at4 = {(r["model"], r["vocab"], r["scheme"]): r for r in rows if r["n"] == 4}
    lines = [
        "## Against the paper at 4 ranks: saving of epoch time vs the parameter server",
        "",
        "The paper's figures are for its setting (Brown, ~49k vocabulary, 4 GPUs, GPU-sized models); they"
        " sit next to the full-vocabulary rows. Measured: this run's time for the samples; estimate: the"
        " dedicated-device estimate.",
        "",
        "| model | vocabulary | scheme | paper | measured | dedicated-device estimate |",
        "|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for vocab in ("full", "small"):
            for scheme in ("allreduce", "sampled_vocab"):
                r = at4.get((model, vocab, scheme))
                if r is None:
                    continue
                paper = f"~{PAPER_SAVING[scheme]:.0f}%" if vocab == "full" else "-"
                lines.append(
                    f"| {MODELS[model]['label']} | {vocab} ({r['vocab_size']}) | {SCHEME_LABEL[scheme]} | {paper} |"
                    f" {_f(r['saving_vs_ps'], '{:+.0f}%')} | {_f(r['dedicated_saving_vs_ps'], '{:+.0f}%')} |"
                )
    return [*lines, ""]


def speedup_table(rows: list[dict[str, Any]]) -> list[str]:
    """The paper's third finding: the FFN gains less from more devices than the RNN LM."""
    lines = [
        "## Gain from more devices: time at N=1 / time at N",
        "",
        "Measured (this machine: 2 cores) and on the dedicated-device estimate. The paper: the feed-forward"
        " LM gains less from more devices than the RNN LM.",
        "",
        "| model | vocabulary | scheme | N=2 | N=3 | N=4 | N=2 (estimate) | N=3 (estimate) | N=4 (estimate) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    index = {(r["model"], r["vocab"], r["n"], r["scheme"]): r for r in rows}
    for model in MODELS:
        for vocab in ("full", "small"):
            for scheme in SCHEMES:
                got = [index.get((model, vocab, n, scheme)) for n in (2, 3, 4)]
                if not any(got):
                    continue
                meas = [_f(g["speedup"], "{:.2f}x") if g else "-" for g in got]
                est = [_f(g["dedicated_speedup"], "{:.2f}x") if g else "-" for g in got]
                lines.append(
                    f"| {MODELS[model]['label']} | {vocab} | {SCHEME_LABEL[scheme]} | " + " | ".join(meas + est) + " |"
                )
    return [*lines, ""]


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["vocab"]) for r in rows}, key=lambda p: (list(MODELS).index(p[0]), p[1] != "full"))
    if not panels:
        return
    cols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4.2 * nrows), squeeze=False)
    index = {(r["model"], r["vocab"], r["n"], r["scheme"]): r for r in rows}
    for ax, (model, vocab) in zip(axes.flat, panels, strict=False):
        single = index.get((model, vocab, 1, SINGLE))
        for scheme in SCHEMES:
            pts = [(1, single)] if single else []
            pts += [(n, index[(model, vocab, n, scheme)]) for n in RANKS[1:] if (model, vocab, n, scheme) in index]
            if len(pts) < (2 if single else 1):
                continue
            ax.plot([n for n, _ in pts], [r["time_s"] for _, r in pts], "o-", color=COLORS[scheme], label=scheme)
            est = [(n, r["dedicated_s"]) for n, r in pts if r["dedicated_s"] is not None]
            if est:
                ax.plot(
                    *zip(*est, strict=True), "x--", color=COLORS[scheme], alpha=0.6, label=f"{scheme} (dedicated est.)"
                )
        if single:
            ax.plot(RANKS, [single["time_s"] / n for n in RANKS], ":", color="grey", label="ideal (N=1 time / N)")
        v = next(r["vocab_size"] for r in rows if (r["model"], r["vocab"]) == (model, vocab))
        ax.set_title(f"{MODELS[model]['label']}, {v} words", fontsize=10)
        ax.set_xlabel("ranks N (one host each)")
        ax.set_ylabel("seconds for the samples")
        ax.set_xticks(RANKS)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    rate = rows[0]["settings"]["rate_mbit"]
    fig.suptitle(
        f"Time for {rows[0]['samples']} samples at {rate:g} Mbit/s (2 CPU cores shared by the ranks)", fontsize=11
    )
    fig.tight_layout()
    fig.savefig(out / "epoch_time.png", dpi=120)
    plt.close(fig)


def tables(args: argparse.Namespace) -> str:
    out = Path(args.out)
    want = settings(args)
    runs, skipped = [], []
    for p in sorted(out.glob("runs/*/run.json")):
        run = json.loads(p.read_text())
        (runs if run["settings"] == want else skipped).append(run)
    if not runs:
        raise SystemExit(f"no runs under {out / 'runs'} measured with these settings ({len(skipped)} with others)")
    rows = sorted(build_rows(runs), key=_order)
    text = markdown(rows, args, [r["id"] for r in skipped])
    write_results(out, text, {"settings": want, "runs": rows})
    plot(rows, out)
    return text


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=1000.0, help="link rate in Mbit/s (default 1000)")
    parser.add_argument(
        "--samples", type=int, default=1536, help="samples in total at every N (default 1536: 48 steps at N=1)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--warmup-steps", type=int, default=1, help="uncounted steps per rank before the clock")
    parser.add_argument("--small-vocab", type=int, default=10000, help="max_vocab_size of the smaller vocabulary")
    parser.add_argument("--alpha", type=int, default=2000, help="sampled_vocab: frequent words always sent")
    parser.add_argument("--beta", type=int, default=1000, help="sampled_vocab: random words per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", nargs="*", metavar="KEY=V1,V2", help="model=lstm,ffn vocab=full,small n=1,2 scheme=..."
    )
    parser.add_argument("--table-only", action="store_true", help="rebuild the outputs from runs/*/run.json")
    parser.add_argument("--list", action="store_true", help="print the runs the options select and exit")
    parser.add_argument("--loopback", action="store_true", help="no namespaces (no rate limit): for debugging")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    parser.add_argument("--out", default=str(OUT))
    return parser


def main() -> None:
    args = make_parser().parse_args()
    todo = planned(args)
    if not args.table_only:
        bad = sorted({n for _, _, n, _ in todo if args.samples % (args.batch_size * n)})
        if bad:
            raise SystemExit(f"--samples {args.samples} is not a multiple of batch size x N for N in {bad}")
    if args.list:
        for spec in todo:
            print(run_id(*spec))
        return
    if not args.table_only:
        torch.set_num_threads(1)
        start = time.perf_counter()
        for i, spec in enumerate(todo):
            print(f"== [{i + 1}/{len(todo)}] {run_id(*spec)}", flush=True)
            record = run_one(*spec, args)
            fig = derive(record)
            print(
                f"   {fig['steps_per_rank']} steps/rank: {fig['time_s']:.1f} s (comm {fig['comm_s']:.1f} s,"
                f" compute {fig['compute_s']:.1f} s), {_f(fig['cs_bytes_per_step'], '{:.3g}')} B/step/rank"
                f" (comm_stats), {_f(fig['tx_bytes_per_step'], '{:.3g}')} (interface);"
                f" job {record['job_wall_seconds']:.0f} s, {time.perf_counter() - start:.0f} s so far",
                flush=True,
            )
    print(tables(args), flush=True)


if __name__ == "__main__":
    main()
