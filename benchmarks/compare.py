"""The standard comparison, as a race: this package's strategies next to what users would pick
instead, on an emulated cluster of rate-limited links, with every figure of a table measured in one run.

Every entry trains until its validation perplexity reaches a fixed target (``--target-ppl``) or its
training budget runs out (``--budget-seconds``; validation time is excluded from both the budget
and the times reported). ``benchmarks/probe.py`` takes the stop decision on rank 0 after every
validation (every ``--val-every`` steps) and broadcasts it, so it works under any strategy.
``--trainer.max_steps`` (``--max-steps``) is only a safety cap. Each entry runs once per seed
(``--seeds``, passed as ``--seed_everything``) and once per link rate (``--rates``, one folder each:
``rate100/``, ``rate1000/``; ``loopback/`` without namespaces). Every folder gets ``results.md``
with three tables (quality at equal samples, quality at equal training time, time to target with
bytes and communication share), ratio lines of this package's best entry against the best peer,
``results.json`` and PNG plots.

Each rank runs in its own network namespace (``benchmarks/cluster.py``) and the job is a real
multi-node launch (Lightning ``num_nodes=N``, ``MASTER_ADDR`` / ``NODE_RANK`` / ``WORLD_SIZE``).

    python benchmarks/compare.py                        # the standard race (make bench), hours
    python benchmarks/compare.py --quick                # a smoke run on loopback, 2 ranks, tiny model
    python benchmarks/compare.py --only ddp diloco_8bit --seeds 0   # a few entries (keys or labels)
    python benchmarks/compare.py --scaling              # ring all-reduce bytes per rank for 2, 4, 8 ranks

torchft's DiLoCo and Streaming DiLoCo race as peers (``benchmarks/peers_torchft.py``: a Lightning
strategy on torchft's ``Manager``, ``ProcessGroupGloo`` and ``local_sgd.DiLoCo``; fp32, as torchft
quantizes only on CUDA). For each run of such an entry, ``launch()`` starts torchft's Lighthouse
(``min_replicas`` = the ranks) on a host of its own that ``race()`` adds to the emulated cluster
(on loopback at 127.0.0.1), hands its address to every rank in ``TORCHFT_LIGHTHOUSE``, starts each
rank under ``unshare --uts`` with its address as host name (torchft advertises the host name), and
stops the Lighthouse after the run:

    python benchmarks/compare.py --only torchft_diloco_h16 torchft_streaming_h16 torchft_diloco_h32 --seeds 0 1
    python benchmarks/compare.py --rates 10 --only alone torchft_diloco_h16 diloco_peer_h16 --seeds 0
    python benchmarks/compare.py --quick --seeds 0 --only alone torchft_diloco_h16 torchft_streaming_h16

Table (c) has a compute-utilisation column: the no-communication limit's (``alone``) mean seconds
per step over the entry's, per rate folder, when ``alone`` was measured there under the same
settings (``compute_utilisation`` in ``results.json``'s rows).

Without root (or where ``ip netns`` is refused) it runs on loopback instead and says so in every
output: loopback has no rate limit, so times there say nothing about slow networks.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
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

from cluster import EmulatedCluster  # noqa: E402
from cluster import cluster_or_loopback as cluster_here  # noqa: E402
from common import (  # noqa: E402
    child_env,
    free_port,
    log_tail,
    node_env,
    popen_on,
    run_ranks,
    train_lm_command,
    wait_for_line,
    write_results,
)

# ---------------------------------------------------------------- the standard setting's constants
# Measured once, not in the run they are used in (benchmarks/results/standard/calibration.md):
# 4 ranks, lstm_demo.yaml, 32 windows per rank and step, AdamW, seed 0, validation on 8 batches per
# rank. The target is the perplexity ddp first reaches at step 88 (about 2/5 of an epoch), where
# the curve is still steep enough that its step-to-step noise moves the step by a few percent.
STANDARD_TARGET_PPL = 200.0
DDP_STEPS_TO_TARGET = 88
# ddp's seconds per step on this project's 2-core machine, 4 ranks, idle: compute alone (the
# no-communication limit) and what a 100 Mbit/s link adds to it (the earlier standard table:
# 0.675 s and 2.353 s mean step); the link part scales with 1 / rate.
DDP_COMPUTE_SECONDS_PER_STEP = 0.675
DDP_LINK_SECONDS_PER_STEP_AT_100MBIT = 2.353 - 0.675
BUDGET_FACTOR = 1.5
# The smoke run (--quick: lstm_tiny.yaml, 2 ranks, loopback): a target ddp reaches within seconds.
QUICK_TARGET_PPL = 150.0
QUICK_BUDGET_SECONDS = 8.0

# Every entry uses the same inner optimizer: the config's learning rate, AdamW.
INNER_OPTIMIZER = ["--model.optimizer=adamw", "--model.weight_decay=0.01"]
WARM_STEPS = 16  # warm start in fp32 DDP steps for PowerSGD, post-local SGD and 1-bit SGD
DILOCO_H = 32  # inner steps between outer steps for every DiLoCo entry (paper: 500, longer than the race)
# torchft's DiLoCo entries: the outer optimizer of every DiLoCo entry (Nesterov SGD, lr 0.7, momentum 0.9)
TORCHFT_OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9}


def ddp_seconds_to_target(rate_mbit: float | None) -> float:
    """ddp's estimated training seconds to the standard target at this link rate (``None``: loopback)."""
    link = 0.0 if rate_mbit is None else DDP_LINK_SECONDS_PER_STEP_AT_100MBIT * 100 / rate_mbit
    return DDP_STEPS_TO_TARGET * (DDP_COMPUTE_SECONDS_PER_STEP + link)


def default_budget(rate_mbit: float | None) -> float:
    """``BUDGET_FACTOR`` x ddp's estimated training seconds to the standard target at this rate."""
    return BUDGET_FACTOR * ddp_seconds_to_target(rate_mbit)


@dataclass
class Entry:
    key: str  # folder name and --only handle
    label: str
    strategy: Any  # a registry name or a {"class_path", "init_args"} dict
    kind: str  # "peer", "ours" or "limit"
    predict: dict[str, Any] = field(default_factory=dict)  # cost-model scheme, see predicted_comm()
    torchft: bool = False  # needs a torchft Lighthouse (started by launch()) and UTS host names


def entries() -> list[Entry]:
    h, warm = DILOCO_H, WARM_STEPS
    return [
        Entry("alone", "alone (1 rank, no communication)", "auto", "limit"),
        Entry("ddp", "ddp", "ddp", "peer", {"scheme": "ring"}),
        Entry(
            "fp16",
            "ddp + fp16_compress_hook",
            {"class_path": "peers.FP16CompressDDP"},
            "peer",
            {"scheme": "ring", "scale": 0.5},
        ),
        Entry(
            "powersgd_r1",
            f"ddp + powerSGD r1 (torch default rank; start {warm})",
            {
                "class_path": "peers.PowerSGDDDP",
                "init_args": {"matrix_approximation_rank": 1, "start_powerSGD_iter": warm},
            },
            "peer",
        ),
        Entry(
            "powersgd_r4",
            f"ddp + powerSGD r4 (tuned: higher rank; start {warm})",
            {
                "class_path": "peers.PowerSGDDDP",
                "init_args": {"matrix_approximation_rank": 4, "start_powerSGD_iter": warm},
            },
            "peer",
        ),
        Entry(
            "postlocal_p4",
            f"post-local SGD (period 4, torch docs; start {warm})",
            {"class_path": "peers.PostLocalSGDDDP", "init_args": {"period": 4, "start_iter": warm}},
            "peer",
            {"scheme": "ring", "period": 4},
        ),
        Entry(
            "postlocal_p16",
            f"post-local SGD (period 16, tuned: fewer syncs; start {warm})",
            {"class_path": "peers.PostLocalSGDDDP", "init_args": {"period": 16, "start_iter": warm}},
            "peer",
            {"scheme": "ring", "period": 16},
        ),
        Entry(
            "diloco_peer",
            f"diloco, plain torch (paper outer opt., H {h})",
            {"class_path": "peers.DiLoCoDDP", "init_args": {"sync_period": h}},
            "peer",
            {"scheme": "ring", "period": h},
        ),
        Entry(
            "diloco_peer_h16",
            "diloco, plain torch (tuned: H 16)",
            {"class_path": "peers.DiLoCoDDP", "init_args": {"sync_period": 16}},
            "peer",
            {"scheme": "ring", "period": 16},
        ),
        Entry(
            f"torchft_diloco_h{h}",
            f"torchft diloco (fp32, paper outer opt., H {h})",
            {"class_path": "peers_torchft.TorchFTDiLoCo", "init_args": {"sync_period": h, **TORCHFT_OUTER}},
            "peer",
            {"scheme": "ring", "period": h},
            torchft=True,
        ),
        Entry(
            "torchft_diloco_h16",
            "torchft diloco (tuned: H 16, fp32)",
            {"class_path": "peers_torchft.TorchFTDiLoCo", "init_args": {"sync_period": 16, **TORCHFT_OUTER}},
            "peer",
            {"scheme": "ring", "period": 16},
            torchft=True,
        ),
        Entry(
            "torchft_streaming_h16",
            "torchft streaming diloco (H 16, 4 fragments, delay 1, fp32)",
            {
                "class_path": "peers_torchft.TorchFTDiLoCo",
                "init_args": {
                    "sync_period": 16,
                    "num_fragments": 4,
                    "fragment_sync_delay": 1,
                    "fragment_update_alpha": 0.0,
                    **TORCHFT_OUTER,
                },
            },
            "peer",
            {"scheme": "ring", "period": 16},
            torchft=True,
        ),
        Entry("allreduce", "allreduce", "allreduce", "ours", {"scheme": "ring"}),
        Entry(
            "diloco_32bit_h16",
            "diloco (fp32, H 16)",
            {
                "class_path": "lightning_commstrats.DiLoCoStrategy",
                "init_args": {"sync_period": 16, "outer_lr": 0.7, "outer_momentum": 0.9, "pseudo_grad_bits": 32},
            },
            "ours",
            {"scheme": "ring", "period": 16},
        ),
        *(
            Entry(
                f"streaming_diloco_h16_{bits}bit",
                f"streaming diloco (H 16, 4 fragments, delay 1, {bits}-bit)",
                {
                    "class_path": "lightning_commstrats.StreamingDiLoCoStrategy",
                    "init_args": {
                        "sync_period": 16,
                        "num_fragments": 4,
                        "fragment_sync_delay": 1,
                        "fragment_update_alpha": 0.0,
                        "pseudo_grad_bits": bits,
                    },
                },
                "ours",
                {"scheme": "ring", "period": 16, "scale": bits / 32},
            )
            for bits in (4, 32)
        ),
        # (key suffix, H, k per 4096, outer lr): the lr tuned on 2 ranks for 64 and 256; the SIGTERM
        # agreement's round every 8 steps (its packets are mostly headers, beside a payload of a few KB per step)
        *(
            Entry(
                f"sparseloco_h{period}{suffix}",
                f"sparseloco (top {k}/4096, 2-bit, H {period}, outer lr {lr:g}{' (tuned)' if tuned else ''},"
                " overlapped 1 step, stop round every 8 steps)",
                {
                    "class_path": "lightning_commstrats.SparseLoCoStrategy",
                    "init_args": {"sync_period": period, "topk_per_chunk": k, "outer_lr": lr, "stop_check_every": 8},
                },
                "ours",
            )
            for suffix, period, k, lr, tuned in (
                ("", 16, 64, 4.0, True),
                ("", 32, 64, 4.0, True),
                ("_k256", 16, 256, 2.0, True),
                ("_k96", 16, 96, 3.0, False),
                ("_k192", 32, 192, 2.0, False),
                ("_k192_lr4", 32, 192, 4.0, False),
            )
        ),
        # SparseLoCo as published (outer lr 1, the paper's), with and without the density schedule, and its
        # quantizer sent dense (benchmarks/results/sparseloco/)
        *(
            Entry(
                f"sparseloco_published_h16{suffix}",
                f"sparseloco published (64/tile of 64 x 64, statistical 2-bit, H 16{label}, overlapped 1 step,"
                " stop round every 8 steps)",
                {
                    "class_path": "lightning_commstrats.SparseLoCoStrategy",
                    "init_args": {"sync_period": 16, "topk_form": "published", "stop_check_every": 8, **extra},
                },
                "ours",
            )
            for suffix, label, extra in (
                ("", "", {}),
                ("_run", ", dense first syncs: topk_schedule 'run'", {"topk_schedule": "run"}),
            )
        ),
        Entry(
            "diloco_statistical_2bit_h16",
            "diloco, dense statistical 2-bit (error feedback 0.95 in place of outer momentum, outer lr 1, H 16)",
            {
                "class_path": "lightning_commstrats.DiLoCoStrategy",
                "init_args": {
                    "sync_period": 16,
                    "pseudo_grad_codec": "statistical",
                    "pseudo_grad_bits": 2,
                    "error_feedback_decay": 0.95,
                    "outer_lr": 1.0,
                    "outer_momentum": 0.0,
                },
            },
            "ours",
        ),
        Entry(
            "streaming_diloco_h16_4bit_overlap3",
            "streaming diloco (H 16, 4 fragments, 4-bit, overlapped 3 steps, local progress kept)",
            {
                "class_path": "lightning_commstrats.StreamingDiLoCoStrategy",
                "init_args": {
                    "sync_period": 16,
                    "num_fragments": 4,
                    "fragment_sync_delay": 3,
                    "keep_local_progress": True,
                    "pseudo_grad_bits": 4,
                },
            },
            "ours",
            {"scheme": "ring", "period": 16, "scale": 4 / 32},
        ),
        *(
            Entry(
                f"diloco_topk_h{period}",
                f"diloco + top-k pseudo-gradients (64/4096, 2-bit, Nesterov outer, H {period}, overlapped 1 step)",
                {
                    "class_path": "lightning_commstrats.DiLoCoStrategy",
                    "init_args": {
                        "sync_period": period,
                        "pseudo_grad_codec": "topk",
                        "pseudo_grad_bits": 2,
                        "fragment_sync_delay": 1,
                        "keep_local_progress": True,
                    },
                },
                "ours",
            )
            for period in (16, 32)
        ),
        Entry(
            "onebit_sgd",
            f"onebit_sgd (start {warm})",
            {
                "class_path": "lightning_commstrats.OneBitSGDStrategy",
                "init_args": {"distributed_after": warm, "distributed_after_unit": "steps"},
            },
            "ours",
            {"scheme": "onebit"},
        ),
        # the variance frozen after 100 steps: within 0.5% of allreduce on the recipe's LSTM at 2 ranks
        # (benchmarks/results/onebit_adam); 16 (the other entries' warm start) is before Adam's variance settles
        Entry(
            "onebit_adam",
            "onebit_adam (variance frozen after 100 steps)",
            {"class_path": "lightning_commstrats.OneBitAdamStrategy", "init_args": {"freeze_step": 100}},
            "ours",
            {"scheme": "onebit"},
        ),
        # 0/1 Adam: fp32 rounds on the variance's doubling schedule up to step 200, 1-bit ones between;
        # then local steps, the interval doubling every 25 steps up to 16 (benchmarks/results/zero_one_adam).
        # No cost-model prediction: its bytes per step change along the run.
        Entry(
            "zero_one_adam",
            "zero_one_adam (variance updated up to step 200, then local steps up to 16)",
            {
                "class_path": "lightning_commstrats.ZeroOneAdamStrategy",
                "init_args": {"var_freeze_step": 200, "local_step_scaler": 25},
            },
            "ours",
        ),
        Entry(
            "sampled_vocab",
            "sampled_vocab",
            {"class_path": "lightning_commstrats.SampledVocabStrategy", "init_args": {"alpha": 0.2, "beta": 0.1}},
            "ours",
        ),
        Entry(
            "model_averaging",
            "model_averaging (period 8)",
            {
                "class_path": "lightning_commstrats.ModelAveragingStrategy",
                "init_args": {"sync_period": 8, "sync_period_unit": "steps"},
            },
            "ours",
            {"scheme": "ring", "period": 8},
        ),
        Entry(
            "bmuf",
            "bmuf (period 8)",
            {
                "class_path": "lightning_commstrats.BMUFStrategy",
                "init_args": {"sync_period": 8, "sync_period_unit": "steps"},
            },
            "ours",
            {"scheme": "ring", "period": 8},
        ),
        *(
            Entry(
                f"diloco_{bits}bit",
                f"diloco ({bits}-bit pseudo-gradients, H {h})",
                {
                    "class_path": "lightning_commstrats.DiLoCoStrategy",
                    "init_args": {
                        "sync_period": h,
                        "sync_period_unit": "steps",
                        "outer_lr": 0.7,
                        "outer_momentum": 0.9,
                        "pseudo_grad_bits": bits,
                    },
                },
                "ours",
                {"scheme": "ring", "period": h, "scale": bits / 32},
            )
            for bits in (8, 4, 2)
        ),
        Entry(
            "streaming_diloco",
            f"streaming diloco (4 fragments, 4-bit, H {h})",
            {
                "class_path": "lightning_commstrats.StreamingDiLoCoStrategy",
                "init_args": {
                    "sync_period": h,
                    "num_fragments": 4,
                    "fragment_sync_delay": 1,
                    "fragment_update_alpha": 0.0,
                    "pseudo_grad_bits": 4,
                },
            },
            "ours",
            {"scheme": "ring", "period": h, "scale": 4 / 32},
        ),
        Entry(
            "streaming_diloco_h8",
            "streaming diloco (tuned: H 8, 4 fragments, 4-bit)",
            {
                "class_path": "lightning_commstrats.StreamingDiLoCoStrategy",
                "init_args": {
                    "sync_period": 8,
                    "num_fragments": 4,
                    "fragment_sync_delay": 1,
                    "fragment_update_alpha": 0.0,
                    "pseudo_grad_bits": 4,
                },
            },
            "ours",
            {"scheme": "ring", "period": 8, "scale": 4 / 32},
        ),
        Entry(
            "diloco_4bit_h16",
            "diloco (tuned: H 16, 4-bit)",
            {
                "class_path": "lightning_commstrats.DiLoCoStrategy",
                "init_args": {
                    "sync_period": 16,
                    "sync_period_unit": "steps",
                    "outer_lr": 0.7,
                    "outer_momentum": 0.9,
                    "pseudo_grad_bits": 4,
                },
            },
            "ours",
            {"scheme": "ring", "period": 16, "scale": 4 / 32},
        ),
        Entry(
            "diloco_4bit_h64",
            "diloco (tuned: H 64, 4-bit)",
            {
                "class_path": "lightning_commstrats.DiLoCoStrategy",
                "init_args": {
                    "sync_period": 64,
                    "sync_period_unit": "steps",
                    "outer_lr": 0.7,
                    "outer_momentum": 0.9,
                    "pseudo_grad_bits": 4,
                },
            },
            "ours",
            {"scheme": "ring", "period": 64, "scale": 4 / 32},
        ),
        Entry(
            "diloco_4bit_h8",
            "diloco (tuned: H 8, 4-bit)",
            {
                "class_path": "lightning_commstrats.DiLoCoStrategy",
                "init_args": {
                    "sync_period": 8,
                    "sync_period_unit": "steps",
                    "outer_lr": 0.7,
                    "outer_momentum": 0.9,
                    "pseudo_grad_bits": 4,
                },
            },
            "ours",
            {"scheme": "ring", "period": 8, "scale": 4 / 32},
        ),
    ]


# What `--quick` runs by default: one entry of each family.
QUICK_KEYS = (
    "alone",
    "ddp",
    "powersgd_r1",
    "postlocal_p4",
    "diloco_peer",
    "torchft_streaming_h16",  # left out where torchft is not installed
    "allreduce",
    "onebit_sgd",
    "bmuf",
    "diloco_8bit",
    "streaming_diloco",
)


def select(every: list[Entry], only: list[str] | None) -> list[Entry]:
    if not only:
        return every
    known = {e.key for e in every} | {e.label for e in every}
    unknown = [o for o in only if o not in known]
    if unknown:
        raise SystemExit(f"unknown entries {unknown}; keys: {[e.key for e in every]}")
    return [e for e in every if e.key in only or e.label in only]


def settings(args: argparse.Namespace, where: str) -> dict[str, Any]:
    """What makes rows comparable: a table only uses rows measured under the same settings."""
    return {
        "where": where,
        "config": Path(args.config).name,
        "ranks": args.ranks,
        "batch_size": args.batch_size,
        "target_ppl": args.target_ppl,
        "budget_seconds": args.budget_seconds,
        "val_every": args.val_every,
        "val_batches": args.val_batches,
        "max_steps": args.max_steps,
        "equal_steps": getattr(args, "equal_steps", None),
        "recipe_args": args.recipe_args,
    }


def launch(entry: Entry, args: argparse.Namespace, seed: int, cluster: EmulatedCluster | None, run_dir: Path) -> float:
    """Run one entry with one seed on ``args.ranks`` ranks; returns the wall seconds of the whole job."""
    n = args.ranks
    alone = entry.kind == "limit"

    def probe(out: Path) -> str:
        init = {
            "out": str(out),  # where this run's probe writes and the runner reads (not the recorded form)
            "samples_per_step": args.batch_size * (1 if alone else n),
            "target_ppl": None if getattr(args, "equal_steps", None) else args.target_ppl,
            "budget_seconds": None if getattr(args, "equal_steps", None) else args.budget_seconds,
        }
        return f"--trainer.callbacks={json.dumps([{'class_path': 'probe.BenchProbe', 'init_args': init}])}"

    base = train_lm_command(
        args.config,
        f"--seed_everything={seed}",
        f"--trainer.max_steps={args.max_steps}",
        f"--trainer.val_check_interval={args.val_every}",
        "--trainer.check_val_every_n_epoch=null",  # validate every --val-every steps across epochs
        f"--trainer.limit_val_batches={args.val_batches}",
        "--trainer.max_epochs=-1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=false",
        f"--data.batch_size={args.batch_size}",
        "--trainer.num_sanity_val_steps=0",
        *args.recipe_args,
    )
    strategy = entry.strategy if isinstance(entry.strategy, str) else json.dumps(entry.strategy)
    env = child_env(HERE, REPO)
    port = free_port()
    lighthouse = TorchFTLighthouse(n, cluster, run_dir, env) if entry.torchft else None

    def start_rank(i: int, log: Any) -> subprocess.Popen:
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
            rank_env = node_env(env, i, n, cluster.address(0) if cluster else "127.0.0.1", port)
        if lighthouse is not None:
            address = cluster.address(i) if cluster else "127.0.0.1"
            rank_env.update(TORCHFT_LIGHTHOUSE=lighthouse.address, BENCH_HOST_ADDRESS=address)
            if cluster:  # torchft advertises socket.gethostname(): make it the rank's address
                cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', address, *cmd]
        if cluster:
            rank_env["GLOO_SOCKET_IFNAME"] = "eth0"
        else:
            rank_env["BENCH_IFACE"] = "lo"
        return popen_on(cluster, i, cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT)

    timeout = args.timeout or (3 * args.budget_seconds + 300 if args.budget_seconds else 3600)
    start = time.perf_counter()
    try:
        procs = run_ranks(start_rank, n, run_dir, timeout)
    finally:
        if lighthouse is not None:
            lighthouse.stop()
    if any(p.returncode != 0 for p in procs):
        tail = log_tail(run_dir, 0)
        raise RuntimeError(f"{entry.label} (seed {seed}) failed or timed out (logs in {run_dir}):\n{tail}")
    return time.perf_counter() - start


class TorchFTLighthouse:
    """torchft's Lighthouse for one run of a torchft entry (``peers_torchft.py lighthouse``), with
    ``min_replicas`` = the ranks. On the emulated cluster it runs on the spare host that ``race()``
    adds for torchft entries (host ``n``, on the same switch as every rank; host 0 if there is none),
    on loopback at 127.0.0.1. ``address`` is what the ranks get in ``TORCHFT_LIGHTHOUSE``."""

    def __init__(self, n: int, cluster: EmulatedCluster | None, run_dir: Path, env: dict[str, str]) -> None:
        host = n if cluster is not None and cluster.hosts > n else 0
        cmd = [sys.executable, str(HERE / "peers_torchft.py"), "lighthouse", "--min-replicas", str(n)]
        path = run_dir / "lighthouse.txt"
        self.log = open(path, "w")
        kwargs: dict[str, Any] = {"env": env, "stdout": self.log, "stderr": subprocess.STDOUT}
        self.proc = popen_on(cluster, host, cmd, **kwargs)
        try:
            text = wait_for_line(path, "listening at", self.proc, 120, "torchft's Lighthouse")
        except RuntimeError:
            self.stop()
            raise
        port = text.split("listening at", 1)[1].split()[0].rsplit(":", 1)[1]
        self.address = f"http://{cluster.address(host) if cluster else '127.0.0.1'}:{port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def summarize(entry: Entry, run_dir: Path, wall: float, seed: int, loopback: bool) -> dict[str, Any]:
    """One row: an entry's figures for one seed (rank 0's curve; bytes averaged over ranks)."""
    pattern = "alone*/probe.rank0.json" if entry.kind == "limit" else "probe.rank*.json"
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob(pattern))]
    r0 = ranks[0]
    steps = max(r0["steps"], 1)
    step_times = r0["step_seconds"][1:] or r0["step_seconds"]
    comm = r0["training_comm"]
    comm_s = comm["comm_seconds"] if comm else r0.get("peer_comm_seconds")
    # every rank's sends cross `lo`: on loopback one counter holds them all (and anything else local)
    share = len(ranks) if loopback and entry.kind != "limit" else 1
    tx = [r["tx_bytes"] / steps / share for r in (ranks[:1] if loopback else ranks) if r["tx_bytes"] is not None]
    return {
        "key": entry.key,
        "label": entry.label,
        "kind": entry.kind,
        "seed": seed,
        "predict": entry.predict,
        "job_wall_seconds": wall,
        "steps": steps,
        "stop_reason": r0["stop_reason"],
        "train_seconds": r0["train_seconds"],
        "val_seconds": r0["val_seconds"],
        "wall_seconds": r0["wall_seconds"],
        "seconds_per_step": r0["train_seconds"] / steps,
        "median_step_s": statistics.median(step_times) if step_times else None,
        "comm_s_per_step": comm_s / steps if comm_s is not None else None,
        "comm_share": comm_s / r0["train_seconds"] if comm_s is not None and r0["train_seconds"] else None,
        "tx_bytes_per_step": statistics.fmean(tx) if tx else None,
        "comm_stats_bytes_per_step": comm["bytes_sent"] / steps if comm else None,
        "outer_syncs": r0.get("peer_syncs"),
        "final_ppl": r0["curve"][-1]["val_ppl"] if r0["curve"] else None,
        "curve": r0["curve"],
        "param_shapes": r0.get("param_shapes"),
    }


# ---------------------------------------------------------------- reading the curves


def time_to_target(curve: list[dict[str, float]], target: float, budget: float | None) -> float | None:
    """Training seconds at the first validation at or below ``target``; None if not reached in budget."""
    for point in curve:
        if point["val_ppl"] <= target:
            return point["train_seconds"] if budget is None or point["train_seconds"] <= budget else None
    return None


def point_at_samples(curve: list[dict[str, float]], samples: float) -> dict[str, float] | None:
    """The last validation at or before ``samples``."""
    before = [p for p in curve if p["samples"] <= samples]
    return before[-1] if before else None


def ppl_at_samples(curve: list[dict[str, float]], samples: float) -> float | None:
    point = point_at_samples(curve, samples)
    return point["val_ppl"] if point else None


def ppl_at_time(curve: list[dict[str, float]], seconds: float) -> float | None:
    """Validation perplexity at ``seconds`` of training, interpolated linearly in log perplexity
    between the validations either side (None outside the curve)."""
    for a, b in itertools.pairwise(curve):
        if a["train_seconds"] <= seconds <= b["train_seconds"]:
            span = b["train_seconds"] - a["train_seconds"]
            w = (seconds - a["train_seconds"]) / span if span > 0 else 1.0
            return math.exp((1 - w) * math.log(a["val_ppl"]) + w * math.log(b["val_ppl"]))
    if curve and curve[-1]["train_seconds"] == seconds:
        return curve[-1]["val_ppl"]
    return None


def _spread(values: list[float | None], spec: str) -> str:
    """Mean (min-max) over seeds; '-' when nothing was measured."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    if len(vals) == 1 or min(vals) == max(vals):
        return spec.format(vals[0])
    return f"{spec.format(statistics.fmean(vals))} ({spec.format(min(vals))}-{spec.format(max(vals))})"


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals and len(vals) == len(values) else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def predicted_comm(
    spec: dict[str, Any], shapes: list[list[int]] | None, n: int, rate_mbit: float | None
) -> float | None:
    """Cost-model communication seconds per step at the link rate (None on loopback or if unknown)."""
    if not spec or not shapes or rate_mbit is None:
        return None
    from lightning_commstrats import cost_model  # the tables alone need nothing of the package

    shape = cost_model.ModelShape(tuple(tuple(s) for s in shapes))
    bw = rate_mbit * 1e6
    if spec["scheme"] == "onebit":
        return cost_model.onebit(shape, n, bw)
    return cost_model.ring_allreduce(shape, n, bw) * spec.get("scale", 1.0) / spec.get("period", 1)


def group(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["key"], []).append(r)
    return out


def common_points(rows: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(samples, training seconds) every non-limit row reached: the smallest final sample count and
    the smallest final training time."""
    racers = [r for r in rows if r["kind"] != "limit" and r["curve"]]
    if not racers:
        return None, None
    return min(r["curve"][-1]["samples"] for r in racers), min(r["curve"][-1]["train_seconds"] for r in racers)


def figures(rows: list[dict[str, Any]], target: float | None, budget: float | None) -> dict[str, dict[str, Any]]:
    """Per entry, the per-seed values every table and ratio reads."""
    samples, seconds = common_points(rows)
    out = {}
    for key, runs in group(rows).items():
        out[key] = {
            "label": runs[0]["label"],
            "kind": runs[0]["kind"],
            "seeds": [r["seed"] for r in runs],
            "at_samples": [ppl_at_samples(r["curve"], samples) if samples else None for r in runs],
            "at_time": [ppl_at_time(r["curve"], seconds) if seconds else None for r in runs],
            "ttt": [time_to_target(r["curve"], target, budget) if target else None for r in runs],
            "tx": [r["tx_bytes_per_step"] for r in runs],
            "cs": [r["comm_stats_bytes_per_step"] for r in runs],
        }
    return out


def add_utilisation(rows: list[dict[str, Any]]) -> None:
    """Set every row's ``compute_utilisation``: the no-communication limit's mean seconds per step
    (the ``alone`` rows of the same folder, mean over seeds) over the row's seconds per step (training
    seconds / steps), so 1 is the compute-bound limit; None where there is no ``alone`` row."""
    alone = [r["seconds_per_step"] for r in rows if r["kind"] == "limit" and r.get("seconds_per_step")]
    reference = statistics.fmean(alone) if alone else None
    for r in rows:
        sps = r.get("seconds_per_step")
        r["compute_utilisation"] = reference / sps if reference and sps else None


def _fewer(reference: float | None, value: float | None) -> str:
    """``reference / value`` as "123x" (``-`` when either is unknown or the value is zero)."""
    if not reference or not value:
        return "-"
    return f"{reference / value:.3g}x"


def ratio_lines(fig: dict[str, dict[str, Any]]) -> list[str]:
    """This package's best entry against the best peer (means over seeds; lower is better)."""
    lines = []
    for name, field_, scale, spec in (
        ("time to target", "ttt", 1, "{:.0f} s"),
        ("val ppl at equal samples", "at_samples", 1, "{:.1f}"),
        ("val ppl at equal training time", "at_time", 1, "{:.1f}"),
        ("bytes per step and rank (interface)", "tx", 1e-6, "{:.4g} MB"),
    ):
        best = {}
        for kind in ("ours", "peer"):
            vals = [(_mean(f[field_]), f["label"]) for f in fig.values() if f["kind"] == kind]
            vals = [v for v in vals if v[0] is not None]
            best[kind] = min(vals) if vals else None
        if best["ours"] and best["peer"]:
            o, p = best["ours"], best["peer"]
            lines.append(
                f"- {name}: this package's best, {o[1]}, {spec.format(o[0] * scale)} / best peer, {p[1]},"
                f" {spec.format(p[0] * scale)} = **{o[0] / p[0]:.3g}**"
            )
        else:
            missing = tuple(k for k in best if not best[k])
            who = {("ours",): "this package", ("peer",): "the peers"}.get(missing, "either side")
            lines.append(f"- {name}: no ratio (no entry of {who} has it on every seed)")
    return lines


def header(
    args: argparse.Namespace, where: str, rate: float | None, samples: float | None, seconds: float | None
) -> list[str]:
    target = f"{args.target_ppl:g}" if args.target_ppl else "none"
    equal_steps = getattr(args, "equal_steps", None)
    source = {
        "quick": "`QUICK_TARGET_PPL` in compare.py, for the smoke run",
        "standard": "`STANDARD_TARGET_PPL` in compare.py, measured once in a separate ddp run (see"
        " `calibration.md`), not in this run",
        "given": "given with `--target-ppl`",
    }[args.target_source]
    budget = f"{args.budget_seconds:.0f} s" if args.budget_seconds else "none"
    budget_src = {
        "quick": "`QUICK_BUDGET_SECONDS`",
        "standard": f"{BUDGET_FACTOR} x ddp's estimated time to target here, {DDP_STEPS_TO_TARGET} steps x"
        f" {ddp_seconds_to_target(rate) / DDP_STEPS_TO_TARGET:.3f} s (compute {DDP_COMPUTE_SECONDS_PER_STEP} s"
        f" + a 100 Mbit/s link's {DDP_LINK_SECONDS_PER_STEP_AT_100MBIT:.3f} s x 100 / rate, measured on this"
        " project's 2-core machine; compare with ddp's row below)",
        "given": "given with `--budget-seconds`",
        "equal_steps": f"`--equal-steps {equal_steps}`: every entry trains for exactly that many steps",
    }[args.budget_source]
    return [
        f"# Race: {args.ranks} ranks, {where}",
        "",
        f"- **Where**: {where}.",
        f"- **Target**: validation perplexity {target} ({source}).",
        (
            f"- **Budget**: none ({budget_src}, whatever the target and the time; the time to target below is"
            " read from each run's validations); validation time is not counted."
            if equal_steps
            else f"- **Budget**: {budget} of training per entry ({budget_src}); validation time is not counted."
            " A run stops at the first validation at or below the target or at or past the budget (decided on"
            f" rank 0, broadcast to all); the safety cap of {args.max_steps} steps never ended a run unless a"
            " row says so."
        ),
        f"- **Seeds**: {' '.join(str(s) for s in args.seeds)} (every entry once per seed; quality figures are"
        " the mean over seeds with the (min-max) spread).",
        f"- **Setting**: config `{Path(args.config).name}`, {args.batch_size} windows per rank and step,"
        f" validation every {args.val_every} steps on {args.val_batches} batches per rank (this package's"
        " periodic strategies and the DiLoCo peers, plain torch and torchft, validate their global model, that"
        " of the last synchronisation, so their curves move at syncs; post-local SGD validates each rank's"
        " local weights);"
        f" inner optimizer for every entry: `{' '.join(INNER_OPTIMIZER)}` (learning rate from the config);"
        f" extra recipe arguments: `{' '.join(args.extra) or 'none'}`.",
        f"- **Equal samples**: {_fmt(samples, '{:.0f}')} samples (the smallest final sample count of the"
        " racing entries; every multi-rank entry validates at the same sample counts, so this is the"
        " last validation at or before it, no interpolation).",
        f"- **Equal time**: {_fmt(seconds, '{:.1f}')} training seconds (the smallest final training time of"
        " the racing entries; perplexity interpolated linearly in log between the validations either side).",
        "",
    ]


def table(rows: list[dict[str, Any]], args: argparse.Namespace, where: str, rate: float | None) -> str:
    add_utilisation(rows)
    samples, seconds = common_points(rows)
    fig = figures(rows, args.target_ppl, args.budget_seconds)
    byk = group(rows)
    lines = header(args, where, rate, samples, seconds)
    lines += [
        f"## (a) Quality at equal samples ({_fmt(samples, '{:.0f}')} samples)",
        "",
        "| run | kind | val ppl | at step |",
        "|---|---|---|---|",
    ]
    for key, f in fig.items():
        point = point_at_samples(byk[key][0]["curve"], samples) if samples else None
        step = point["step"] if point else None
        lines.append(f"| {f['label']} | {f['kind']} | {_spread(f['at_samples'], '{:.1f}')} | {_fmt(step, '{}')} |")
    lines += [
        "",
        f"## (b) Quality at equal training time ({_fmt(seconds, '{:.1f}')} s)",
        "",
        "| run | kind | val ppl |",
        "|---|---|---|",
    ]
    for f in fig.values():
        lines.append(f"| {f['label']} | {f['kind']} | {_spread(f['at_time'], '{:.1f}')} |")
    lines += [
        "",
        "## (c) Time to target, bytes and communication",
        "",
        "Time to target: training seconds at the first validation at or below the target, mean (min-max) over the"
        " seeds that reached it. Bytes per step and rank: the interface counter during training (veth `eth0`;"
        " on loopback the `lo` counter divided by the ranks, which also counts any other local traffic) and"
        " this package's `comm_stats` (training"
        " collectives only). Comm share: seconds the training loop waited for communication / training"
        " seconds (this package's `comm_stats`: collectives on the loop's thread and its waits for background"
        " exchanges, not the background exchanges' own seconds on the wire; the plain-torch DiLoCo peer"
        " times its outer all-reduce, the torchft peers torchft's"
        " whole sync hook: quorum, all-reduce wait, commit and outer step; unknown for DDP's hooks). Compute"
        " util.: the no-communication limit's (`alone`) mean s/step over the entry's s/step (100% is"
        " compute-bound; '-' without an `alone` row in this folder). Predicted comm:"
        " the cost model's seconds per step at the link rate. Fewer bytes than ddp: ddp's interface bytes per"
        " step and rank in this table over the entry's (means over seeds).",
        "",
        "| run | kind | time to target s | stop (per seed) | steps | train s | s/step | compute util. | median batch s"
        " | predicted comm s/step | comm s/step | comm share | MB/step/rank (interface) | MB/step/rank (comm_stats)"
        " | fewer bytes than ddp | final val ppl |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ddp_tx = _mean(fig["ddp"]["tx"]) if "ddp" in fig else None
    for key, f in fig.items():
        runs = byk[key]
        reached = [t for t in f["ttt"] if t is not None]
        if not args.target_ppl:
            ttt = "-"
        elif not reached:
            ttt = "not reached in budget"
        else:
            ttt = _spread(reached, "{:.0f}")
            if len(reached) < len(runs):
                ttt += f" ({len(reached)} of {len(runs)} seeds; the others not reached in budget)"
        pred = predicted_comm(runs[0]["predict"], runs[0].get("param_shapes"), args.ranks, rate)
        cells = [
            f["label"],
            f["kind"],
            ttt,
            " ".join(str(r["stop_reason"]) for r in runs),
            _spread([r["steps"] for r in runs], "{:.0f}"),
            _spread([r["train_seconds"] for r in runs], "{:.0f}"),
            _spread([r["seconds_per_step"] for r in runs], "{:.3f}"),
            _spread([u * 100 if (u := r.get("compute_utilisation")) is not None else None for r in runs], "{:.0f}%"),
            _spread([r["median_step_s"] for r in runs], "{:.3f}"),
            _fmt(pred, "{:.3f}"),
            _spread([r["comm_s_per_step"] for r in runs], "{:.3f}"),
            _spread([r["comm_share"] * 100 if r["comm_share"] is not None else None for r in runs], "{:.0f}%"),
            _spread([v / 1e6 if v is not None else None for v in f["tx"]], "{:.3f}"),
            _spread([v / 1e6 if v is not None else None for v in f["cs"]], "{:.3f}"),
            _fewer(ddp_tx, _mean(f["tx"])) if f["kind"] != "limit" else "-",
            _spread([r["final_ppl"] for r in runs], "{:.1f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## This package against the peers (same run, means over seeds, lower is better)",
        "",
        *ratio_lines(fig),
    ]
    return "\n".join(lines)


def plots(rows: list[dict[str, Any]], out: Path, args: argparse.Namespace, where: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.patches
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')")
        return
    byk = group(rows)
    colors = plt.get_cmap("tab20")
    for x, name, xlabel in (
        ("train_seconds", "ppl_vs_time.png", "training seconds (validation excluded)"),
        ("samples", "ppl_vs_samples.png", "samples (windows, all ranks)"),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, runs in enumerate(byk.values()):
            for j, r in enumerate(runs):
                if r["curve"]:
                    ax.plot(
                        [p[x] for p in r["curve"]],
                        [p["val_ppl"] for p in r["curve"]],
                        color=colors(i % 20),
                        linestyle="-" if r["kind"] == "ours" else "--" if r["kind"] == "peer" else ":",
                        label=r["label"] if j == 0 else None,
                    )
        if args.target_ppl:
            ax.axhline(args.target_ppl, color="black", linewidth=0.8)
        if args.budget_seconds and x == "train_seconds":
            ax.axvline(args.budget_seconds, color="grey", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation perplexity (log)")
        ax.set_title(f"Perplexity ({where}); solid: this package, dashed: peers", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
    fg = figures(rows, args.target_ppl, args.budget_seconds)
    racers = [f for f in fg.values() if f["kind"] != "limit"]
    kind_color = {"ours": "tab:blue", "peer": "tab:orange"}
    handles = [
        matplotlib.patches.Patch(color=c, label="this package" if k == "ours" else "peer")
        for k, c in kind_color.items()
    ]
    labeled = [f for f in racers if _mean(f["tx"])]
    if labeled:
        fig, ax = plt.subplots(figsize=(8, 5))
        ax.barh(
            [f["label"] for f in labeled],
            [_mean(f["tx"]) / 1e6 for f in labeled],
            color=[kind_color[f["kind"]] for f in labeled],
        )
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("MB sent per step and rank (interface counter, log)")
        ax.set_title(f"Bytes per step ({where})", fontsize=9)
        ax.legend(handles=handles, fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "bytes_per_step.png", dpi=120)
        plt.close(fig)
    if args.target_ppl and racers:
        fig, ax = plt.subplots(figsize=(8, 5))
        cap = args.budget_seconds or max((t for f in racers for t in f["ttt"] if t is not None), default=1.0)
        for i, f in enumerate(racers):
            t = _mean(f["ttt"])
            if t is None:
                ax.barh(i, cap, color="none", edgecolor=kind_color[f["kind"]], hatch="//")
                ax.text(cap, i, " not reached", va="center", fontsize=7)
            else:
                ax.barh(i, t, color=kind_color[f["kind"]])
        ax.set_yticks(range(len(racers)), [f["label"] for f in racers])
        ax.invert_yaxis()
        ax.set_xlabel(
            "training seconds to the target (mean over seeds)\nhatched to the budget: not reached on every seed"
        )
        ax.set_title(f"Time to val ppl {args.target_ppl:g} ({where})", fontsize=9)
        ax.legend(handles=handles, fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "time_to_target.png", dpi=120)
        plt.close(fig)


# ---------------------------------------------------------------- scaling, cluster, main


def scaling(args: argparse.Namespace) -> None:
    """Per-rank bytes of ring all-reduce for 2, 4 and 8 ranks (tiny model, a few steps, no race)."""
    rows = []
    for n in (2, 4, 8):
        sub = argparse.Namespace(**{**vars(args), "ranks": n, "target_ppl": None, "budget_seconds": None})
        for entry in (Entry("ddp", "ddp", "ddp", "peer"), Entry("allreduce", "allreduce", "allreduce", "ours")):
            run_dir = Path(args.out) / f"scaling-{n}-{entry.key}"
            run_dir.mkdir(parents=True, exist_ok=True)
            with cluster_or_loopback(sub, args.rates[0]) as (cluster, where):
                wall = launch(entry, sub, 0, cluster, run_dir)
            rows.append((n, entry.label, summarize(entry, run_dir, wall, 0, cluster is None), where))
    lines = ["| ranks | run | MB/step/rank (veth tx) | MB/step/rank (comm_stats) | where |", "|---|---|---|---|---|"]
    for n, label, s, where in rows:
        cs = s["comm_stats_bytes_per_step"]
        lines.append(
            f"| {n} | {label} | {s['tx_bytes_per_step'] / 1e6:.3f} | {cs / 1e6 if cs else float('nan'):.3f} | {where} |"
        )
    text = "\n".join(lines)
    (Path(args.out) / "scaling.md").write_text(text + "\n")
    print(text)


def cluster_or_loopback(
    args: argparse.Namespace, rate: float, groups: int = 1, uplink_mbit: float | None = None, spare_hosts: int = 0
) -> Any:
    """The emulated cluster for ``args.ranks`` hosts at ``rate``, or loopback (and why): a context manager
    (``cluster.cluster_or_loopback``). ``spare_hosts``: hosts past the ranks' (torchft's Lighthouse), one
    group only."""
    hosts = args.ranks + (spare_hosts if groups == 1 else 0)
    return cluster_here(getattr(args, "loopback", False), hosts, rate, groups, uplink_mbit)


class saved_where:
    """For ``--table-only``: where the runs in ``out`` (or its ``loopback`` sibling) ran; builds nothing."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __enter__(self) -> tuple[None, str]:
        for folder in (self.out, self.out.parent / "loopback"):
            for p in sorted(folder.glob("*/seed*/summary.json")):
                return None, json.loads(p.read_text())["settings"]["where"]
        raise SystemExit(f"--table-only: no runs in {self.out} or {self.out.parent / 'loopback'}")

    def __exit__(self, *exc: object) -> None:
        pass


def race(args: argparse.Namespace, todo: list[Entry], every: list[Entry], rate: float, out: Path) -> str:
    """Run ``todo`` (every seed) at one link rate into ``out``; write and return the tables of every
    entry measured there under the same settings. Returns where it ran."""
    spare = 1 if any(e.torchft for e in todo) else 0  # a host of its own for torchft's Lighthouse
    with (
        saved_where(out) if args.table_only else cluster_or_loopback(args, rate, spare_hosts=spare) as (
            cluster,
            where,
        )
    ):
        loopback = where.startswith("loopback")
        rate_used = None if loopback else rate
        out = out.parent / "loopback" if loopback else out
        args.budget_seconds, args.budget_source = (
            (args.given_budget, "given") if args.given_budget else (default_budget(rate_used), "standard")
        )
        if args.quick and not args.given_budget:
            args.budget_seconds, args.budget_source = QUICK_BUDGET_SECONDS, "quick"
        if getattr(args, "equal_steps", None):
            args.budget_seconds, args.budget_source = None, "equal_steps"
        run_settings = settings(args, where)
        for entry in todo if not args.table_only else []:
            for seed in args.seeds:
                run_dir = out / entry.key / f"seed{seed}"
                run_dir.mkdir(parents=True, exist_ok=True)
                for old in [*run_dir.glob("probe.rank*.json"), *run_dir.glob("alone*/probe.rank*.json")]:
                    old.unlink()
                print(f"== {where}: {entry.label}, seed {seed}", flush=True)
                wall = launch(entry, args, seed, cluster, run_dir)
                row = summarize(entry, run_dir, wall, seed, loopback)
                row["settings"] = run_settings
                (run_dir / "summary.json").write_text(json.dumps(row, indent=1))
                print(
                    f"   {row['stop_reason']} after {row['steps']} steps, {row['train_seconds']:.0f} s training"
                    f" ({row['val_seconds']:.0f} s validation, job {wall:.0f} s), final ppl {row['final_ppl']}",
                    flush=True,
                )
    # every entry measured into this folder under the same settings, so `--only` can redo a few
    rows = []
    for e in every:
        for seed in args.seeds:
            p = out / e.key / f"seed{seed}" / "summary.json"
            if p.exists():
                row = json.loads(p.read_text())
                if row.get("settings") == run_settings:
                    rows.append(row)
    add_utilisation(rows)  # into results.json's rows as well
    text = table(rows, args, where, rate_used)
    write_results(out, text, {"where": where, "rate_mbit": rate_used, "settings": run_settings, "rows": rows})
    plots(rows, out, args, where)
    print(text, flush=True)
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: loopback, tiny config, 2 ranks, seconds")
    parser.add_argument("--loopback", action="store_true", help="do not build namespaces; use loopback")
    parser.add_argument("--scaling", action="store_true", help="ring all-reduce bytes per rank for 2, 4, 8 ranks")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 1000.0], help="link rates, Mbit/s")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--target-ppl", type=float, help=f"default {STANDARD_TARGET_PPL} ({QUICK_TARGET_PPL} quick)")
    parser.add_argument(
        "--budget-seconds",
        type=float,
        help=f"training seconds per entry; default {BUDGET_FACTOR} x ddp's time to target",
    )
    parser.add_argument("--max-steps", type=int, default=100_000, help="safety cap on steps")
    parser.add_argument(
        "--equal-steps",
        type=int,
        help="train every entry for exactly this many steps (no stop at the target or the budget: quality at"
        " equal samples over a whole run; time to target is still read from the curves)",
    )
    parser.add_argument("--val-every", type=int, default=4, help="steps between validations")
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches per rank")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--config", default=str(REPO / "lightning_commstrats" / "configs" / "lstm_demo.yaml"))
    parser.add_argument("--only", nargs="*", help="entry keys or labels to run (default: all)")
    parser.add_argument("--table-only", action="store_true", help="rebuild the tables from the runs in --out")
    parser.add_argument("--timeout", type=float, help="seconds per job (default 3 x budget + 300)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "standard"))
    parser.add_argument("extra", nargs="*", help="extra recipe arguments after --")
    args = parser.parse_args()
    if args.equal_steps:
        args.max_steps = args.equal_steps
    if args.quick:
        args.config = str(REPO / "lightning_commstrats" / "configs" / "lstm_tiny.yaml")
        args.loopback = True
        args.ranks, args.val_every, args.val_batches, args.batch_size, args.rates = 2, 4, 2, 8, [100.0]
    args.target_source = "given" if args.target_ppl else "quick" if args.quick else "standard"
    if not args.target_ppl:
        args.target_ppl = QUICK_TARGET_PPL if args.quick else STANDARD_TARGET_PPL
    args.given_budget = args.budget_seconds
    args.recipe_args = [*INNER_OPTIMIZER, *args.extra]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.scaling:
        args.config = str(REPO / "lightning_commstrats" / "configs" / "lstm_tiny.yaml")
        args.max_steps, args.val_every, args.val_batches, args.batch_size = 5, 5, 1, 8
        scaling(args)
        return
    every = entries()
    todo = select(every, args.only or (list(QUICK_KEYS) if args.quick else None))
    if not args.table_only and any(e.torchft for e in todo) and importlib.util.find_spec("torchft") is None:
        if args.only:
            raise SystemExit("the torchft entries need torchft: pip install -e '.[ft]'")
        print("torchft is not installed (pip install -e '.[ft]'): its entries are left out", flush=True)
        todo = [e for e in todo if not e.torchft]
    sections = []
    for rate in args.rates:
        where = race(args, todo, every, rate, out / f"rate{rate:g}")
        name = "loopback" if where.startswith("loopback") else f"rate{rate:g}"
        sections.append(f"- [{where}]({name}/results.md)")
        if where.startswith("loopback"):
            break  # every rate would be the same loopback run
    (out / "results.md").write_text("# Races\n\n" + "\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
