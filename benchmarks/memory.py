"""Bytes per rank of every scheme, unsharded and sharded with FSDP2 (``shard="fsdp"``), and the largest
model that trains under a per-rank budget either way.

    python benchmarks/memory.py [--budget-mib 1024] [--out benchmarks/results/memory]
    python benchmarks/memory.py --quick          # one small size, two schemes: a couple of minutes
    python benchmarks/memory.py --os             # table 3 alone: tensors against the kernel's count, a minute
    python benchmarks/memory.py --os --os-size big --os-ranks 4   # on the 75M-parameter model, 4 ranks

Four ranks on this machine (gloo on localhost, one process per rank with ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment, as ``torchrun`` starts them) train
the recipe's Transformer LM (:class:`~lightning_commstrats.models.LanguageModel`, ``arch="transformer"``,
tied input/output embedding, AdamW, no dropout, 64 positions) on **synthetic tokens**: a
Zipf-distributed stream over a vocabulary of 8,192 words, each rank its own. The Brown corpus is not
used: what is measured is bytes, and the loss only has to show that the model learns.

**Table 1** (sizes x schemes x layouts). For each model size (about 5M, 20M and 50M parameters) and
each of ``allreduce``, ``model_averaging``, ``bmuf``, ``diloco``, ``streaming_diloco``
(``num_fragments=2``) and ``sparseloco`` (their defaults otherwise: ``streaming_diloco`` sends 4-bit
pseudo-gradients, ``sparseloco`` top-k with error feedback; the periodic schemes sync every 2
optimizer steps, ``sync_period_unit="steps"``), 4 optimizer steps run unsharded (``shard=None``),
sharded in one group of 4 (``shard="fsdp", group_size=4``) and in two groups of 2 (``group_size=2``).
Batches of 2 sequences of 32 tokens (the bytes counted do not depend on them). Rank 0 takes
``trainer.strategy.memory_stats()`` in a callback at ``on_train_batch_end`` of the last step (a sync
step), when every state is held (gradients of the step, the inner AdamW moments, the periodic
schemes' global model, outer optimizer state, residuals, an exchange in flight): bytes by kind,
counted from the tensors' storages (:mod:`lightning_commstrats.sharding.memory`). The ratio is the
sharded total over the unsharded total of the same size and scheme; the last column is the largest
total over the ends of all steps.

**Table 2** (the largest model under a budget). At a fixed width (``d_model`` 512, 8 heads, FFN 2048)
``diloco``'s accounted bytes per rank (parameters + gradients + optimizer + scheme) are measured
for 1 and 2 blocks, unsharded and sharded 4-way; they are linear in the number of blocks, which
gives the most blocks whose accounted bytes fit ``--budget-mib`` per rank each way. Both models are
then trained ``--budget-steps`` steps on 4 ranks (batches of 4 sequences of 64 tokens, AdamW lr 1e-3,
diloco syncing every 5 steps: the same state as every 2, a steadier loss over so few steps), and
the table reports their parameters, the accounted bytes measured at the last step (flagged if over
the budget), the mean loss over the ranks at the first and last step, and the largest peak resident
set size of a rank, by the time training starts (model built and sharded) and over the whole run.

What this does and does not show: the budget is a budget of *accounted* state bytes, not an
out-of-memory limit. Activations, FSDP2's gathered units during forward and backward, communication
buffers in flight and the allocator's slack are not counted (the peak RSS column shows what the
process really held at its peak). Each rank builds the whole model before ``fully_shard`` shards it
(``LanguageModel`` builds it in ``__init__``), so the initialisation peak per rank is the full
model's parameters in any layout: a model whose *full* parameters do not fit a rank cannot start
this way unless ``configure_model`` builds it sharded (or on the meta device). On CPU every kind is
host memory.

**Table 3** (the tensors against the operating system's count, ``--os``). What a rank runs out of is
its resident set, not its tensors. A language model of residual MLP blocks (tied embedding of 8,192
words, ``blocks`` x ``Linear(d, 4d)``, GELU, ``Linear(4d, d)`` with a skip, plain SGD without momentum:
an optimizer with no state) trains ``--os-steps`` steps (4) with ``allreduce`` on ``--os-ranks`` ranks
(2), unsharded and sharded in one group (``shard="fsdp"``), batches of 4 sequences of 64 tokens; every rank
builds the whole model before it is sharded (as table 2's do). Each run (a layout under an
allocator setting) is a launch of its own, so no run inherits another's heap. Per rank, beside the
tensor accounting (``memory_stats()``, the largest total over the ends of all steps), the kernel's peak
resident set (``VmHWM``) above the resident set when the rank began to build the model, measured with
:class:`~lightning_commstrats.sharding.process_memory.ProcessMemory` over the run and within phases:
``build`` (the model built, sharded and its optimizer made, to the start of training), ``training``
(to the end of fit) and ``sync`` (each step's gradient exchange, wrapped in a subclass of the
strategy). The allocator settings (``--os-allocators``; the first two by default): glibc's defaults; its
mmap threshold fixed at 128 KiB at the rank's start by
:func:`~lightning_commstrats.sharding.process_memory.fix_mmap_threshold` (as
``MALLOC_MMAP_THRESHOLD_=131072`` in the environment would); jemalloc and tcmalloc (gperftools' minimal
library) preloaded into the ranks (``LD_PRELOAD``; ``--jemalloc`` / ``--tcmalloc`` name the library where
the linker does not find it; each rank checks its memory map that the preload took), each with its
defaults and with its own setting for handing freed memory back at once (jemalloc's
``MALLOC_CONF=dirty_decay_ms:0,muzzy_decay_ms:0``, tcmalloc's ``TCMALLOC_AGGRESSIVE_DECOMMIT=true``).
"Apart" is the run's peak above the start over the accounted tensors. The cost of a setting: the fit's
seconds (noisy on shared cores) and its minor page faults (``getrusage``: every block the allocator maps
afresh is faulted in page by page).
Sizes (``--os-size``): ``small`` (d 512, 4 blocks, 12.6M parameters: about a
minute on two ranks on two shared cores, two on four ranks), ``big`` (d 1024, 8 blocks, 75.5M
parameters). Results go to ``--out``'s ``os-<size>/`` (tables 1 and 2's files stay).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    REPO,
    failed_ranks,
    finish_rank,
    local_rank,
    localhost_env,
    quiet_trainer,
    rank_tails,
    read_rank_results,
    run_ranks,
    transformer_args,
    write_results,
    zipf_batches,
)

VOCAB, SEQ_LEN, BATCH = 8192, 64, 4
WORLD = 4
KINDS = ("parameters", "gradients", "optimizer", "scheme")
PERIOD = {"sync_period": 2, "sync_period_unit": "steps"}
# scheme -> (registry name, arguments)
SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {
    "allreduce": ("allreduce", {}),
    "model_averaging": ("model_averaging", PERIOD),
    "bmuf": ("bmuf", PERIOD),
    "diloco": ("diloco", PERIOD),
    "streaming_diloco": ("streaming_diloco", {"sync_period": 2, "num_fragments": 2}),
    "sparseloco": ("sparseloco", PERIOD),
}
# layout -> strategy arguments
LAYOUTS: dict[str, dict[str, Any]] = {
    "unsharded": {},
    "fsdp 1x4": {"shard": "fsdp", "group_size": 4},
    "fsdp 2x2": {"shard": "fsdp", "group_size": 2},
}
# name -> d_model, blocks, heads (FFN 4 x d_model)
SIZES: dict[str, tuple[int, int, int]] = {
    "5M": (256, 4, 4),
    "20M": (512, 5, 8),
    "50M": (768, 6, 12),
}
BUDGET_WIDTH = (512, 8)  # d_model, heads of the budget search
BUDGET_SYNC_PERIOD = 5  # diloco's inner steps per sync when the two largest models train
TABLE_BATCH = (2, 32)  # sequences per batch and tokens per sequence of table 1's runs (bytes only)


# ---------------------------------------------------------------- one rank


def model_args(d_model: int, blocks: int, heads: int, lr: float = 1e-3) -> dict[str, Any]:
    return transformer_args(VOCAB, SEQ_LEN, d_model, blocks, heads, lr)


def rss_bytes() -> tuple[int, int]:
    """This process's resident set now and at its peak, bytes (Linux)."""
    now = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_one(run: dict[str, Any], rank: int) -> dict[str, Any]:
    """Train one model with one strategy on this rank; what rank ``rank`` saw."""
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_commstrats  # noqa: F401  (registers the strategies)
    from lightning_commstrats.models import LanguageModel

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.memory: dict[str, dict[str, int]] | None = None
            self.losses: list[float] = []
            self.totals: list[int] = []  # accounted bytes at the end of every step
            self.rss_at_last = 0
            self.rss_at_start = (0, 0)

        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            self.rss_at_start = rss_bytes()  # the model built, sharded, the optimizer made

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
            self.losses.append(float(outputs["loss"]))
            memory = trainer.strategy.memory_stats()
            self.totals.append(total(memory))
            if trainer.global_step == trainer.max_steps:
                self.memory = memory
                self.rss_at_last = rss_bytes()[0]

    L.seed_everything(run.get("seed", 0), verbose=False)
    model = LanguageModel(**run["model"])
    numel = sum(p.numel() for p in model.parameters())
    strategy = L.pytorch.strategies.StrategyRegistry[run["strategy"]]["strategy"](**run["kwargs"])
    measure = Measure()
    batches = zipf_batches(rank, run["steps"], run.get("batch", BATCH), run.get("seq_len", SEQ_LEN), VOCAB)
    loader = DataLoader(batches, batch_size=None, shuffle=False)
    trainer = quiet_trainer(
        validate=False,
        devices=WORLD,
        strategy=strategy,
        max_steps=run["steps"],
        use_distributed_sampler=False,
        callbacks=[measure],
    )
    start = time.perf_counter()
    trainer.fit(model, train_dataloaders=loader)
    seconds = time.perf_counter() - start
    if measure.memory is None:
        raise RuntimeError(f"{run['name']}: the last step's callback did not run")
    result = {
        "numel": numel,
        "memory": measure.memory,
        "losses": measure.losses,
        "totals": measure.totals,
        "seconds": seconds,
        "rss_at_last": measure.rss_at_last,
        "rss_peak_setup": measure.rss_at_start[1],
        "rss_peak": rss_bytes()[1],  # of the process: the run's own when it is the launch's only run
    }
    del trainer, strategy, model
    gc.collect()
    return result


def rank_main(spec_json: str, out: str) -> None:
    import torch

    rank = int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(1)
    spec = json.loads(spec_json)
    if spec.get("preload"):
        from lightning_commstrats.sharding import host_allocator

        if host_allocator() != spec["preload"]:
            raise RuntimeError(f"{spec['preload']} was to be preloaded, the process runs on {host_allocator()}")
    if spec.get("fix_mmap_threshold"):  # first, before the runs allocate: it holds for the process
        from lightning_commstrats.sharding import fix_mmap_threshold

        applied, why = fix_mmap_threshold()
        if not applied:
            raise RuntimeError(f"the mmap threshold could not be fixed: {why}")
    results = {run["name"]: (run_os if run.get("kind") == "os" else run_one)(run, rank) for run in spec["runs"]}
    finish_rank(out, rank, results)


# ---------------------------------------------------------------- the launcher


def launch(
    runs: list[dict[str, Any]], timeout: float = 1800.0, world: int = WORLD, **spec: Any
) -> list[dict[str, dict[str, Any]]]:
    """Run ``runs`` one after the other on ``world`` ranks (one process each, started as ``torchrun``
    would); every rank's results, in rank order. A rank that fails, or a launch that outlives
    ``timeout`` seconds, stops every rank and raises with the ranks' output. ``spec``: settings of
    the ranks' processes: ``fix_mmap_threshold=True``, ``preload`` (an allocator's name; its library's
    path in ``library``) and ``env`` (variables of the ranks' environment)."""
    out = Path(tempfile.mkdtemp(prefix="commstrats-memory-"))
    env = localhost_env(world, REPO)
    env.update(spec.pop("env", None) or {})
    if spec.get("library"):
        env["LD_PRELOAD"] = os.pathsep.join(filter(None, [spec.pop("library"), env.get("LD_PRELOAD")]))
    args = [sys.executable, str(Path(__file__).resolve()), "--rank", json.dumps({"runs": runs, **spec}), str(out)]
    try:
        # a failed rank: 2 s more for the others to print their side of the failure
        procs = run_ranks(lambda r, log: local_rank(args, env, r, log), world, out, timeout, grace=2.0)
        if failed_ranks(procs):
            names = ", ".join(run["name"] for run in runs)
            raise RuntimeError(f"ranks failed or timed out running {names}:\n" + rank_tails(procs, out, 6000))
        return read_rank_results(out, world)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_spec(
    name: str, scheme: str, layout: str, model: dict[str, Any], steps: int, batch: int = BATCH, seq_len: int = SEQ_LEN
) -> dict[str, Any]:
    registry_name, kwargs = SCHEMES[scheme]
    return {
        "name": name,
        "strategy": registry_name,
        "kwargs": {**kwargs, **LAYOUTS[layout]},
        "model": model,
        "steps": steps,
        "batch": batch,
        "seq_len": seq_len,
    }


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def total(memory: dict[str, dict[str, int]]) -> int:
    return sum(sum(memory[k].values()) for k in KINDS)


# ---------------------------------------------------------------- table 1


def measure_table(
    sizes: list[str], schemes: list[str], layouts: list[str], steps: int = 4, log: Any = print
) -> list[dict[str, Any]]:
    """Rank 0's bytes by kind at the last of ``steps`` steps, one row per size x scheme x layout."""
    rows = []
    for size in sizes:
        d, blocks, heads = SIZES[size]
        runs = [
            run_spec(f"{size}|{scheme}|{layout}", scheme, layout, model_args(d, blocks, heads), steps, *TABLE_BATCH)
            for scheme in schemes
            for layout in layouts
        ]
        start = time.perf_counter()
        ranks = launch(runs)
        log(f"{size}: {len(runs)} runs on {WORLD} ranks in {time.perf_counter() - start:.0f}s")
        for run in runs:
            _, scheme, layout = run["name"].split("|")
            r0 = ranks[0][run["name"]]
            rows.append(
                {
                    "size": size,
                    "scheme": scheme,
                    "layout": layout,
                    "numel": r0["numel"],
                    "bytes": {k: sum(r0["memory"][k].values()) for k in KINDS},
                    "total": total(r0["memory"]),
                    "totals": r0["totals"],
                    "seconds": r0["seconds"],
                }
            )
    by_key = {(r["size"], r["scheme"], r["layout"]): r for r in rows}
    for r in rows:
        base = by_key.get((r["size"], r["scheme"], "unsharded"))
        r["ratio"] = r["total"] / base["total"] if base else None
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | scheme | layout | parameters | gradients | optimizer | scheme state | total MiB/rank"
        " | sharded / unsharded | total, max over steps |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        b = r["bytes"]
        ratio = "1" if r["layout"] == "unsharded" else (f"{r['ratio']:.3f}" if r["ratio"] is not None else "-")
        lines.append(
            f"| {r['size']} ({r['numel'] / 1e6:.1f}M) | {r['scheme']} | {r['layout']} | "
            + " | ".join(mib(b[k]) for k in KINDS)
            + f" | {mib(r['total'])} | {ratio} | {mib(max(r['totals']))} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- table 2


def blocks_within(budget: int, one: int, two: int) -> dict[str, int]:
    """The most blocks whose accounted bytes fit ``budget``, from the bytes measured with one block
    (``one``) and two (``two``): linear in the blocks, ``base + blocks * per_block``."""
    per_block, base = two - one, 2 * one - two
    if per_block <= 0:
        raise ValueError(f"a second block added {per_block} bytes; the accounting should grow with the model")
    blocks = (budget - base) // per_block
    if blocks < 1:
        raise ValueError(f"a budget of {mib(budget)} MiB fits no block (one block takes {mib(one)} MiB)")
    return {"blocks": blocks, "base": base, "per_block": per_block, "predicted": base + blocks * per_block}


def largest_under_budget(budget: int, steps: int, log: Any = print) -> dict[str, Any]:
    """The most blocks (at ``BUDGET_WIDTH``) whose accounted diloco bytes per rank fit ``budget``,
    unsharded and sharded 4-way, found from measurements at 1 and 2 blocks; then both trained."""
    d, heads = BUDGET_WIDTH
    layouts = {"unsharded": "unsharded", "sharded 4-way": "fsdp 1x4"}
    probes = [
        run_spec(f"probe|{label}|{blocks}", "diloco", layout, model_args(d, blocks, heads), 4)
        for label, layout in layouts.items()
        for blocks in (1, 2)
    ]
    start = time.perf_counter()
    measured = launch(probes)[0]
    log(f"budget probes: {len(probes)} runs in {time.perf_counter() - start:.0f}s")
    chosen = {
        label: blocks_within(
            budget, total(measured[f"probe|{label}|1"]["memory"]), total(measured[f"probe|{label}|2"]["memory"])
        )
        for label in layouts
    }
    result: dict[str, Any] = {"budget": budget, "d_model": d, "layouts": {}}
    for label, layout in layouts.items():
        c = chosen[label]
        run = run_spec(f"budget|{label}", "diloco", layout, model_args(d, c["blocks"], heads), steps)
        run["kwargs"]["sync_period"] = BUDGET_SYNC_PERIOD
        start = time.perf_counter()
        ranks = launch([run])
        wall = time.perf_counter() - start
        log(f"budget {label}: {c['blocks']} blocks, {steps} steps in {wall:.0f}s")
        per_rank = [r[run["name"]] for r in ranks]
        losses = [sum(r["losses"][i] for r in per_rank) / WORLD for i in range(len(per_rank[0]["losses"]))]
        r0 = per_rank[0]
        result["layouts"][label] = {
            **c,
            "numel": r0["numel"],
            "bytes": {k: sum(r0["memory"][k].values()) for k in KINDS},
            "total": total(r0["memory"]),
            "losses": losses,
            "rss_peak": max(r["rss_peak"] for r in per_rank),
            "rss_peak_setup": max(r["rss_peak_setup"] for r in per_rank),
            "rss_at_last": r0["rss_at_last"],
            "seconds": r0["seconds"],
        }
    u, s = result["layouts"]["unsharded"], result["layouts"]["sharded 4-way"]
    result["numel_ratio"] = s["numel"] / u["numel"]
    return result


def format_budget(result: dict[str, Any]) -> str:
    lines = [
        f"Budget {mib(result['budget'])} MiB of accounted state per rank (diloco, d_model {result['d_model']}):",
        "",
        "| layout | blocks | parameters | params / grads / optim / scheme MiB | accounted MiB/rank (predicted)"
        " | loss first -> last | peak RSS MiB: setup / run (max over ranks) | fit s |",
        "|---|--:|--:|---|--:|---|--:|--:|",
    ]
    for label, r in result["layouts"].items():
        b = r["bytes"]
        lines.append(
            f"| {label} | {r['blocks']} | {r['numel'] / 1e6:.1f}M | "
            + " / ".join(mib(b[k]) for k in KINDS)
            + f" | {mib(r['total'])} ({mib(r['predicted'])})"
            f" | {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} ({len(r['losses'])} steps)"
            f" | {mib(r['rss_peak_setup'])} / {mib(r['rss_peak'])} | {r['seconds']:.0f} |"
        )
    u, s = result["layouts"]["unsharded"], result["layouts"]["sharded 4-way"]
    over = [label for label, r in result["layouts"].items() if r["total"] > result["budget"]]
    rising = [label for label, r in result["layouts"].items() if not r["losses"][-1] < r["losses"][0]]
    lines += [
        "",
        *([f"OVER THE BUDGET: {', '.join(over)}."] if over else []),
        *([f"LOSS DID NOT FALL: {', '.join(rising)}."] if rising else []),
        f"Largest model: sharded / unsharded parameters = {result['numel_ratio']:.2f}x"
        f" ({s['numel'] / 1e6:.1f}M / {u['numel'] / 1e6:.1f}M). Accounted bytes per block:"
        f" {mib(u['per_block'])} MiB unsharded, {mib(s['per_block'])} MiB sharded"
        f" ({s['per_block'] / u['per_block']:.3f}x); the rest (embeddings, final norm):"
        f" {mib(u['base'])} / {mib(s['base'])} MiB.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- table 3: the tensors against the kernel's count

OS_SIZES: dict[str, tuple[int, int]] = {"small": (512, 4), "big": (1024, 8)}  # d_model, residual MLP blocks
# The host allocators table 3 compares: glibc as it starts and with its threshold fixed, and the two
# allocators people preload instead (LD_PRELOAD, found by ``--jemalloc`` / ``--tcmalloc`` or the linker's
# search), each with its defaults and with its own setting for giving freed memory back at once.
OS_ALLOCATORS: dict[str, dict[str, Any]] = {
    "glibc defaults": {},
    "mmap threshold fixed": {"fix_mmap_threshold": True},
    "jemalloc": {"preload": "jemalloc"},
    "jemalloc, no decay": {"preload": "jemalloc", "env": {"MALLOC_CONF": "dirty_decay_ms:0,muzzy_decay_ms:0"}},
    "tcmalloc": {"preload": "tcmalloc"},
    "tcmalloc, aggressive decommit": {"preload": "tcmalloc", "env": {"TCMALLOC_AGGRESSIVE_DECOMMIT": "true"}},
}
OS_LIBRARIES = {"jemalloc": "jemalloc", "tcmalloc": "tcmalloc_minimal"}  # names the linker's search takes


def find_allocator(name: str, given: str | None) -> str | None:
    """The path of allocator ``name``'s shared library: ``given`` (checked to exist), else the
    linker's own search (``ctypes.util.find_library``); None when it is not installed."""
    import ctypes.util

    if given is not None:
        if not Path(given).is_file():
            raise SystemExit(f"--{name} must name the allocator's shared library, got {given!r} (no such file)")
        return str(Path(given).resolve())
    return ctypes.util.find_library(OS_LIBRARIES[name])


def mlp_lm(vocab: int, dim: int, blocks: int, lr: float = 0.05) -> Any:
    """A language model of residual MLP blocks: tied embedding (std 0.02: the default N(0, 1) makes the
    tied logits hundreds and SGD diverge), ``blocks`` x (``Linear(dim, 4 dim)``, GELU,
    ``Linear(4 dim, dim)``) added to their input, plain SGD (no optimizer state)."""
    import lightning as L
    import torch
    from torch import nn

    class MLPLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(blocks)
            )
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.emb.weight
            nn.init.normal_(self.emb.weight, std=0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=lr)

    return MLPLM()


def run_os(run: dict[str, Any], rank: int) -> dict[str, Any]:
    """Table 3's run on this rank: the accounted tensors beside the kernel's peak (see the docstring)."""
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_commstrats  # noqa: F401  (registers the strategies)
    from lightning_commstrats.sharding import ProcessMemory

    gc.collect()
    # exact phases (this process only measures); its start: the resident set before the model is built
    tracker = ProcessMemory(phases="reset")
    tracker.begin("build")
    L.seed_everything(0, verbose=False)
    dim, blocks = run["dims"]
    model = mlp_lm(VOCAB, dim, blocks)
    numel = sum(p.numel() for p in model.parameters())
    base = L.pytorch.strategies.StrategyRegistry["allreduce"]["strategy"]

    class Tracked(base):  # the sync phase: each step's gradient exchange
        def after_backward(self, optimizer: Any) -> None:
            with tracker.phase("sync"):
                super().after_backward(optimizer)

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.totals: list[int] = []
            self.memory: dict[str, dict[str, int]] = {}
            self.losses: list[float] = []

        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            tracker.end("build")
            tracker.begin("training")

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
            self.losses.append(float(outputs["loss"]))
            memory = trainer.strategy.memory_stats()
            if not self.totals or total(memory) >= max(self.totals):
                self.memory = memory
            self.totals.append(total(memory))

    measure = Measure()
    batches = zipf_batches(rank, run["steps"], run["batch"], SEQ_LEN, VOCAB)
    trainer = quiet_trainer(
        validate=False,
        devices=run["world"],
        strategy=Tracked(**run["kwargs"]),
        max_steps=run["steps"],
        use_distributed_sampler=False,
        callbacks=[measure],
    )
    start = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None, shuffle=False))
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    tracker.close()
    return {
        "numel": numel,
        "memory": measure.memory,
        "total": max(measure.totals),
        "losses": measure.losses,
        "rss": tracker.stats()["rss"],
        "seconds": seconds,
        "faults": faults,
    }


def measure_os(
    size: str,
    ranks: int,
    steps: int,
    allocators: list[str] | None = None,
    libraries: dict[str, str | None] | None = None,
    log: Any = print,
) -> list[dict[str, Any]]:
    """Table 3: one launch per layout and allocator setting (``allocators``, names of
    :data:`OS_ALLOCATORS`: the two glibc settings by default); a row per rank. ``libraries``: the
    preloaded allocators' library paths by name."""
    dim, blocks = OS_SIZES[size]
    layouts = {"unsharded": {}, f"fsdp 1x{ranks}": {"shard": "fsdp", "group_size": ranks}}
    rows = []
    for allocator in allocators or list(OS_ALLOCATORS)[:2]:
        setting = dict(OS_ALLOCATORS[allocator])
        if setting.get("preload"):
            library = (libraries or {}).get(setting["preload"])
            if library is None:
                raise ValueError(f"allocator {allocator!r} needs {setting['preload']}'s library: none given or found")
            setting["library"] = library
        for layout, kwargs in layouts.items():
            run = {
                "name": f"os|{layout}",
                "kind": "os",
                "kwargs": kwargs,
                "dims": [dim, blocks],
                "steps": steps,
                "batch": BATCH,
                "world": ranks,
            }
            start = time.perf_counter()
            per_rank = launch([run], world=ranks, **setting)
            log(f"{layout}, {allocator}: {ranks} ranks in {time.perf_counter() - start:.0f}s")
            for rank, results in enumerate(per_rank):
                r = results[run["name"]]
                rss = r["rss"]
                rows.append(
                    {
                        "layout": layout,
                        "allocator": allocator,
                        "rank": rank,
                        "numel": r["numel"],
                        "bytes": {k: sum(r["memory"][k].values()) for k in KINDS},
                        "total": r["total"],
                        "start": rss["start"],
                        "peak": rss["peak"] - rss["start"],
                        "phases": {name: None if b is None else b - rss["start"] for name, b in rss["phases"].items()},
                        "note": rss.get("note"),
                        "losses": r["losses"],
                        "seconds": r["seconds"],
                        "faults": r["faults"],
                    }
                )
    return rows


def format_os(rows: list[dict[str, Any]], size: str) -> str:
    model_bytes = 4 * rows[0]["numel"]
    dim, blocks = OS_SIZES[size]

    def above(b: int | None) -> str:
        return "-" if b is None else mib(b)

    lines = [
        f"Tensors against the kernel's count: residual MLP LM, d {dim}, {blocks} blocks,"
        f" {rows[0]['numel'] / 1e6:.1f}M parameters ({mib(model_bytes)} MiB in fp32), allreduce, plain SGD;"
        " MiB per rank; peaks are VmHWM above VmRSS when the rank began to build the model.",
        "",
        "| layout | allocator | rank | params / grads / optim / scheme | tensors (max over steps)"
        " | peak RSS: build / training / sync | peak RSS, run | apart: run peak / tensors | run peak / model"
        " | loss first -> last | fit s | page faults in fit (k) |",
        "|---|---|--:|---|--:|---|--:|--:|--:|---|--:|--:|",
    ]
    for r in rows:
        b, ph = r["bytes"], r["phases"]
        lines.append(
            f"| {r['layout']} | {r['allocator']} | {r['rank']} | "
            + " / ".join(mib(b[k]) for k in KINDS)
            + f" | {mib(r['total'])} | {above(ph.get('build'))} / {above(ph.get('training'))} /"
            f" {above(ph.get('sync'))} | {mib(r['peak'])} | {r['peak'] / r['total']:.2f}x"
            f" (+{mib(r['peak'] - r['total'])}) | {r['peak'] / model_bytes:.2f}x"
            f" | {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} | {r['seconds']:.1f} | {r['faults'] / 1e3:.0f} |"
        )
    notes = {r["note"] for r in rows if r["note"]}
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    allocators = list(dict.fromkeys(r["allocator"] for r in rows))
    lines += [
        "",
        "The largest rank, run peak above the start (x the fp32 model; training phase alone):",
        "",
        "| run | " + " | ".join(allocators) + " |",
        "|---|" + "--:|" * len(allocators),
    ]
    for layout in layouts:
        cells = []
        for allocator in allocators:
            mine = [r for r in rows if r["layout"] == layout and r["allocator"] == allocator]
            top = max(mine, key=lambda r: r["peak"])
            train = max((r["phases"].get("training") or 0) for r in mine)
            cells.append(
                f"{mib(top['peak'])} ({top['peak'] / model_bytes:.2f}x; training {mib(train)},"
                f" {train / model_bytes:.2f}x) vs tensors {mib(top['total'])}"
            )
        lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Phases not measured: " + "; ".join(sorted(notes)) + "."]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run of table 1")
    parser.add_argument("--budget-mib", type=float, default=1024, help="accounted state bytes per rank, MiB")
    parser.add_argument("--budget-steps", type=int, default=10, help="steps the two largest models train")
    parser.add_argument("--no-budget", action="store_true", help="table 1 only")
    parser.add_argument("--no-table", action="store_true", help="table 2 (the budget) only")
    parser.add_argument("--quick", action="store_true", help="5M only, allreduce and diloco, budget 256 MiB")
    parser.add_argument("--os", action="store_true", help="table 3 alone: the tensors against the kernel's count")
    parser.add_argument("--os-size", default="small", choices=list(OS_SIZES), help="table 3's model (big: 75.5M)")
    parser.add_argument("--os-ranks", type=int, default=2, help="table 3's ranks (one group when sharded)")
    parser.add_argument("--os-steps", type=int, default=4, help="table 3's optimizer steps per run")
    parser.add_argument(
        "--os-allocators",
        nargs="*",
        default=list(OS_ALLOCATORS)[:2],
        choices=list(OS_ALLOCATORS),
        help="table 3's host allocator settings (jemalloc and tcmalloc are preloaded into the ranks)",
    )
    parser.add_argument("--jemalloc", help="jemalloc's shared library (default: the linker's search)")
    parser.add_argument("--tcmalloc", help="tcmalloc's (minimal) shared library (default: the linker's search)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "memory"))
    parser.add_argument("--rank", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(*args.rank)
        return
    if args.quick:
        args.sizes, args.schemes, args.budget_mib = ["5M"], ["allreduce", "diloco"], 256.0
        if args.out == parser.get_default("out"):
            args.out = str(Path(args.out) / "quick")
    if args.os:
        libraries = {name: find_allocator(name, getattr(args, name)) for name in OS_LIBRARIES}
        for allocator in args.os_allocators:
            name = OS_ALLOCATORS[allocator].get("preload")
            if name and libraries[name] is None:
                parser.error(f"--os-allocators {allocator!r}: {name} is not installed; give its library with --{name}")
        default_out = args.out == parser.get_default("out")
        main_os(args.os_size, args.os_ranks, args.os_steps, args.out, default_out, args.os_allocators, libraries)
        return
    start = time.perf_counter()
    rows = [] if args.no_table else measure_table(args.sizes, args.schemes, args.layouts, args.steps)
    parts = [] if args.no_table else [format_table(rows)]
    budget = None
    if not args.no_budget:
        budget = largest_under_budget(int(args.budget_mib * 2**20), args.budget_steps)
        parts.append(format_budget(budget))
    text = "\n\n".join(parts)
    wall = time.perf_counter() - start
    text += f"\n\nWall time: {wall:.0f}s."
    print(text)
    write_results(args.out, text, {"rows": rows, "budget": budget, "wall_seconds": wall})


def main_os(
    size: str,
    ranks: int,
    steps: int,
    out_dir: str,
    default_out: bool,
    allocators: list[str] | None = None,
    libraries: dict[str, str | None] | None = None,
) -> None:
    if ranks < 2 or steps < 1:
        raise SystemExit(f"--os-ranks must be at least 2 and --os-steps at least 1, got {ranks} and {steps}")
    start = time.perf_counter()
    rows = measure_os(size, ranks, steps, allocators, libraries)
    wall = time.perf_counter() - start
    text = format_os(rows, size) + f"\n\nWall time: {wall:.0f}s."
    print(text)
    out = Path(out_dir) / f"os-{size}" if default_out else Path(out_dir)  # beside, not over, tables 1 and 2
    write_results(out, text, {"rows": rows, "size": size, "wall_seconds": wall})


if __name__ == "__main__":
    main()
