"""The largest model of the recipe's Transformer family that trains with ``diloco`` on 4 ranks under a
real per-rank memory limit: unsharded, sharded in two groups of 2 and in one group of 4.

    python benchmarks/fit_limit.py [--budget-mib 768] [--out benchmarks/results/fit_limit]
    python benchmarks/fit_limit.py --layouts unsharded --budget-mib 512   # one layout
    python benchmarks/fit_limit.py --trial 6 --layouts "fsdp 1x4"         # one rung, one layout

**The limit.** Every rank is a process of its own (gloo on localhost, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` in the environment, as ``torchrun`` starts them), and each is put, before
it executes anything, into a memory cgroup (v1) of its own made under this script's own cgroup, with
``memory.limit_in_bytes`` = ``memory.memsw.limit_in_bytes`` = the budget (no swap to escape to). Everything
the process touches from its first instruction on is charged to it: the interpreter, torch, Lightning,
the model, the optimizer, activations, gloo's buffers. A rank that needs more is killed by the kernel's
OOM killer (``oom_kill`` in its cgroup's ``memory.oom_control``): that model does not fit. A rank that
fails any other way stops the search with its output. Without a usable memory cgroup (``--no-cgroup``,
or none can be made: another kernel, no permission) the ranks run unlimited and a model fits when every
rank's peak resident set (``VmHWM``, the kernel's count) stays within the budget; the table says which.

**The family** (one ladder, :data:`LADDER`): rung ``j`` is ``LanguageModel(arch="transformer")`` with
``d_model = 32 j``, ``j // 2`` blocks, ``j`` heads of 32, ``ffn_dim = 4 d_model``, a tied embedding of 8,192
words, 64 positions, no dropout: about ``12 d^2 (j // 2) + 8,256 d`` parameters (rung 10: 320 x 5, 8.8M;
rung 12: 384 x 6, 13.8M; rung 20: 640 x 10, 54.5M; rung 28: 896 x 14, 142M). Wider and deeper together,
as model families grow; each rung 12-35% more parameters than the one before.

**The training.** AdamW (lr 1e-3) inside, ``diloco`` across (``sync_period=2`` steps, outer Nesterov
SGD 0.7/0.9, ``outer_state="host"``: its global copy and outer momentum on the host), 3 optimizer steps
of 2 sequences of 64 tokens (synthetic Zipf tokens, each rank its own): the sync at step 2 creates the
outer state, step 3 is an inner step with all of it held (parameters, gradients, AdamW's moments, the
global copy, the outer momentum). glibc's mmap threshold is fixed at 128 KiB in every rank
(:func:`~lightning_commstrats.sharding.fix_mmap_threshold`, ``--glibc-defaults`` to leave it), so freed
blocks go back to the system and the peak follows the live tensors.

**The layouts.** ``unsharded``: ``shard=None``, the model built as usual (whole, initialised) on every
rank: ``init_module(empty_init=True)`` without sharding leaves the weights uninitialised, as ddp does,
and a model that does not fit whole cannot train unsharded anyway. ``fsdp 2x2`` (``shard="fsdp",
group_size=2``) and ``fsdp 1x4`` (``group_size=4``): built empty, ``with trainer.init_module(empty_init=True)``
(parameters on the meta device; after ``fully_shard`` only the local shards get memory, initialised by
``TransformerLM.init_weights``), so no rank ever holds the whole model. In 1x4 the four ranks are one
group: diloco's sync has no other group to exchange with, so its buffers are never made.

**The search.** Per layout, from a first guess (40 bytes per parameter over the group above a 300 MiB
process: what the unsharded layout measured), each trial trains one rung; after a fit, the next rung
tried is the largest the measured peak extrapolates to (linear in the parameters above the rank's usage
before the build), after an OOM kill the rungs between the largest fit and it are bisected, until the
largest rung that fits sits next to the smallest that does not. Each trial launches the ranks afresh
(no heap inherited).

**The table.** Per layout: the largest rung that fits (parameters, MB in fp32), its measured peak per
rank (the largest over the ranks of the cgroup's ``memory.max_usage_in_bytes``, and of ``VmHWM``), the
usage before the build (interpreter and libraries), the parameters over the unsharded layout's, and the
next rung with the rank the kernel killed. Results: ``--out``'s ``results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
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

VOCAB, SEQ_LEN, BATCH = 8192, 64, 2
WORLD = 4
STEPS, SYNC_PERIOD = 3, 2
MIB = 1 << 20
LADDER = list(range(4, 33))  # rung j: d_model 32j, j // 2 blocks, j heads
LAYOUTS: dict[str, dict[str, Any]] = {
    "unsharded": {},
    "fsdp 2x2": {"shard": "fsdp", "group_size": 2},
    "fsdp 1x4": {"shard": "fsdp", "group_size": 4},
}
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
GUESS_BASE, GUESS_BYTES_PER_PARAM = 300 * MIB, 40  # the first guess only


def rung_dims(k: int) -> dict[str, int]:
    d = 32 * k
    return {"d_model": d, "num_layers": k // 2, "num_heads": k, "ffn_dim": 4 * d}


def rung_params(k: int) -> int:
    """Parameters of rung ``k`` (the tied output layer counted once), as the model counts them."""
    d, n = 32 * k, k // 2
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return VOCAB * d + SEQ_LEN * d + n * block + 2 * d + VOCAB  # embeddings, blocks, final norm, output bias


def model_args(k: int) -> dict[str, Any]:
    dims = rung_dims(k)
    return transformer_args(VOCAB, SEQ_LEN, dims["d_model"], dims["num_layers"], dims["num_heads"])


# ---------------------------------------------------------------- one rank


def _cgroup_usage(cgroup: str | None, name: str) -> int | None:
    if not cgroup:
        return None
    try:
        return int((Path(cgroup) / name).read_text())
    except OSError:
        return None


def rank_main(spec_json: str, out: str) -> None:
    """One rank of one trial: train rung ``spec["rung"]`` in ``spec["layout"]``; write ``rank<r>.json``."""
    import torch

    spec = json.loads(spec_json)
    rank = int(os.environ["LOCAL_RANK"])
    cgroup = os.environ.get("FIT_LIMIT_CGROUP")
    torch.set_num_threads(1)
    from lightning_commstrats.sharding import ProcessMemory, fix_mmap_threshold

    if spec["fix_mmap_threshold"]:
        applied, why = fix_mmap_threshold()
        if not applied:
            raise RuntimeError(f"the mmap threshold could not be fixed: {why}")

    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_commstrats  # noqa: F401  (registers the strategies)
    from lightning_commstrats.models import LanguageModel

    batches = zipf_batches(rank, STEPS, BATCH, SEQ_LEN, VOCAB)

    class Measure(L.Callback):
        def __init__(self, tracker: ProcessMemory) -> None:
            self.tracker = tracker
            self.losses: list[float] = []
            self.accounted = 0

        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            self.tracker.end("build")
            self.tracker.begin("training")

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
            self.losses.append(float(outputs["loss"]))
            memory = trainer.strategy.memory_stats()
            kinds = ("parameters", "gradients", "optimizer", "scheme")
            self.accounted = max(self.accounted, sum(sum(memory[k].values()) for k in kinds))

    kwargs = {"sync_period": SYNC_PERIOD, "sync_period_unit": "steps", "outer_state": "host", **spec["kwargs"]}
    kwargs["memory_phases"] = False  # the kernel's peak counter is this script's tracker's alone
    strategy = L.pytorch.strategies.StrategyRegistry["diloco"]["strategy"](**kwargs)
    trainer = quiet_trainer(
        validate=False, devices=WORLD, strategy=strategy, max_steps=STEPS, use_distributed_sampler=False
    )
    L.seed_everything(0, verbose=False)
    cgroup_start = _cgroup_usage(cgroup, "memory.usage_in_bytes")
    tracker = ProcessMemory()  # its start: the resident set before the model is built
    tracker.begin("build")
    measure = Measure(tracker)
    trainer.callbacks.append(measure)
    with trainer.init_module(empty_init=bool(spec["kwargs"].get("shard"))):
        model = LanguageModel(**model_args(spec["rung"]))
    numel = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None, shuffle=False))
    seconds = time.perf_counter() - start
    tracker.close()
    result = {
        "numel": numel,
        "losses": measure.losses,
        "accounted": measure.accounted,
        "rss": tracker.stats()["rss"],
        "cgroup_start": cgroup_start,
        "cgroup_peak": _cgroup_usage(cgroup, "memory.max_usage_in_bytes"),
        "seconds": seconds,
    }
    finish_rank(out, rank, result)


# ---------------------------------------------------------------- the cgroups and the launcher


def own_memory_cgroup() -> Path | None:
    """This process's memory cgroup (v1) directory, or None without one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            where = CGROUP_ROOT / path.lstrip("/")
            return where if (where / "memory.limit_in_bytes").exists() else None
    return None


class Limits:
    """A memory cgroup per rank under this process's own, each limited to ``budget`` bytes (memory and
    memory plus swap), made by :meth:`make` and removed by :meth:`remove`."""

    def __init__(self, budget: int, world: int) -> None:
        parent = own_memory_cgroup()
        if parent is None:
            raise OSError("no memory cgroup (v1) of this process under /sys/fs/cgroup/memory")
        self.budget = budget
        self.top = parent / f"commstrats-fit-limit-{os.getpid()}"
        self.ranks = [self.top / f"rank{r}" for r in range(world)]

    def make(self) -> None:
        self.top.mkdir(exist_ok=True)
        for path in self.ranks:
            path.mkdir()
            (path / "memory.limit_in_bytes").write_text(str(self.budget))
            if (path / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: no escape into swap
                (path / "memory.memsw.limit_in_bytes").write_text(str(self.budget))
            if int((path / "memory.limit_in_bytes").read_text()) > self.budget:
                raise OSError(f"{path}: the limit did not hold")

    def oom_kills(self, rank: int) -> int:
        for line in (self.ranks[rank] / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def peak(self, rank: int) -> int:
        return int((self.ranks[rank] / "memory.max_usage_in_bytes").read_text())

    def remove(self) -> None:
        for path in [*self.ranks, self.top]:
            for _ in range(50):  # a killed process leaves its cgroup a moment after it is reaped
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def check_cgroups(budget: int) -> str | None:
    """Why a per-rank memory cgroup cannot be used here, or None when it can (one is made and removed)."""
    try:
        limits = Limits(budget, 1)
        limits.make()
        limits.remove()
    except OSError as e:
        return str(e)
    return None


def trial(k: int, layout: str, budget: int, cgroups: bool, fix_threshold: bool, timeout: float) -> dict[str, Any]:
    """Train rung ``k`` in ``layout`` on 4 ranks under the budget: ``{"fits": bool, ...}``."""
    out = Path(tempfile.mkdtemp(prefix="commstrats-fit-limit-"))
    spec = {"rung": k, "kwargs": LAYOUTS[layout], "fix_mmap_threshold": fix_threshold}
    env = localhost_env(WORLD, REPO)
    limits = Limits(budget, WORLD) if cgroups else None
    args = [sys.executable, str(Path(__file__).resolve()), "--rank", json.dumps(spec), str(out)]

    def start(r: int, log: Any) -> Any:
        if limits is None:
            return local_rank(args, env, r, log)
        target = limits.ranks[r] / "cgroup.procs"

        def enter() -> None:  # in the child, before it executes anything
            target.write_text(str(os.getpid()))

        return local_rank(args, {**env, "FIT_LIMIT_CGROUP": str(limits.ranks[r])}, r, log, preexec_fn=enter)

    began = time.perf_counter()
    try:
        if limits is not None:
            limits.make()
        procs = run_ranks(start, WORLD, out, timeout, grace=1.0)
        seconds = time.perf_counter() - began
        killed = [r for r in range(WORLD) if limits is not None and limits.oom_kills(r) > 0]
        cgroup_peaks = [limits.peak(r) for r in range(WORLD)] if limits is not None else None
        if killed:
            return {"fits": False, "killed": killed, "cgroup_peaks": cgroup_peaks, "seconds": seconds}
        if failed_ranks(procs):
            tails = rank_tails(procs, out, 4000)
            raise RuntimeError(f"rung {k}, {layout}: ranks failed, not by the memory limit:\n" + tails)
        ranks = read_rank_results(out, WORLD)
        hwm = [r["rss"]["peak"] for r in ranks]
        result = {
            "fits": limits is not None or max(hwm) <= budget,
            "ranks": ranks,
            "cgroup_peaks": cgroup_peaks,
            "hwm": hwm,
            "seconds": seconds,
        }
        if limits is None and not result["fits"]:
            result["over"] = [r for r, v in enumerate(hwm) if v > budget]
        return result
    finally:
        if limits is not None:
            limits.remove()
        shutil.rmtree(out, ignore_errors=True)


# ---------------------------------------------------------------- the search


def _peak(result: dict[str, Any]) -> int:
    return max(result["cgroup_peaks"]) if result.get("cgroup_peaks") else max(result["hwm"])


def _start(result: dict[str, Any]) -> int:
    ranks = result["ranks"]
    starts = [r["cgroup_start"] for r in ranks] if result.get("cgroup_peaks") else [r["rss"]["start"] for r in ranks]
    return max(s or 0 for s in starts)


def first_guess(layout: str, budget: int) -> int:
    per_rank = GUESS_BYTES_PER_PARAM / LAYOUTS[layout].get("group_size", 1)
    fitting = [k for k in LADDER if GUESS_BASE + per_rank * rung_params(k) <= budget]
    return fitting[-1] if fitting else LADDER[0]


def search(layout: str, budget: int, cgroups: bool, fix_threshold: bool, timeout: float, log: Any) -> dict[str, Any]:
    """The largest rung of :data:`LADDER` that trains in ``layout`` under ``budget`` (see the docstring)."""
    lo, hi = LADDER[0] - 1, LADDER[-1] + 1  # largest known to fit, smallest known not to
    tried: dict[int, dict[str, Any]] = {}
    k = first_guess(layout, budget)
    while hi - lo > 1:
        result = trial(k, layout, budget, cgroups, fix_threshold, timeout)
        tried[k] = result
        peak = f"{_peak(result) / MIB:,.0f} MiB" if result.get("cgroup_peaks") or result.get("hwm") else "-"
        verdict = "fits" if result["fits"] else f"does not fit (ranks {result.get('killed', result.get('over'))})"
        log(f"{layout}: rung {k} ({rung_params(k) / 1e6:.1f}M) {verdict}, peak {peak}, {result['seconds']:.0f}s")
        if result["fits"]:
            lo = k
        else:
            hi = k
        if hi - lo <= 1:
            break
        if lo in tried:  # extrapolate from the largest fit: linear in the parameters above the start
            fit = tried[lo]
            base = _start(fit)
            slope = (_peak(fit) - base) / rung_params(lo)
            predicted = max((j for j in LADDER if base + slope * rung_params(j) <= budget), default=lo)
            k = min(max(predicted, lo + 1), hi - 1)
            if not result["fits"] and k >= hi:
                k = (lo + hi) // 2
        else:
            k = max(hi - 1 if hi - lo == 2 else (lo + hi) // 2, lo + 1)
    return {"layout": layout, "largest": lo if lo >= LADDER[0] else None, "smallest_over": hi, "tried": tried}


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def table(found: list[dict[str, Any]], budget: int, cgroups: bool) -> str:
    by = "cgroup" if cgroups else "VmHWM"
    unsharded = next((f for f in found if f["layout"] == "unsharded" and f["largest"]), None)
    lines = [
        f"| layout | largest rung (d_model x blocks) | parameters | MB fp32 | peak per rank, cgroup (MiB)"
        f" | peak per rank, VmHWM (MiB) | before the build (MiB, {by}) | bytes per parameter above it"
        f" | loss step 1 -> {STEPS} | x unsharded | next rung: over the budget |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in found:
        k = f["largest"]
        over = f["smallest_over"]
        if over in f["tried"]:
            o = f["tried"][over]
            why = f"killed (ranks {o['killed']})" if o.get("killed") else f"VmHWM over (ranks {o.get('over')})"
            nxt = f"{over} ({rung_params(over) / 1e6:.1f}M): {why}"
        else:
            nxt = "-"
        if k is None:
            lines.append(f"| {f['layout']} | none fits | | | | | | | | | {nxt} |")
            continue
        r = f["tried"][k]
        n = rung_params(k)
        d = rung_dims(k)
        cg = f"{max(r['cgroup_peaks']) / MIB:,.0f}" if r.get("cgroup_peaks") else "-"
        losses = [sum(x["losses"][i] for x in r["ranks"]) / WORLD for i in (0, -1)]
        ratio = f"{n / rung_params(unsharded['largest']):.2f}" if unsharded else "-"
        lines.append(
            f"| {f['layout']} | {k} ({d['d_model']} x {d['num_layers']}) | {n / 1e6:.1f}M | {mb(4 * n)} | {cg}"
            f" | {max(r['hwm']) / MIB:,.0f} | {_start(r) / MIB:,.0f} | {(_peak(r) - _start(r)) / n:.1f}"
            f" | {losses[0]:.2f} -> {losses[1]:.2f} | {ratio}"
            f" | {nxt} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=int, default=768, help="per-rank memory limit (MiB)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--trial", type=int, default=None, help="train this rung alone in each layout")
    parser.add_argument("--no-cgroup", action="store_true", help="judge by VmHWM against the budget")
    parser.add_argument("--glibc-defaults", action="store_true", help="leave glibc's mmap threshold dynamic")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per trial")
    parser.add_argument("--out", type=Path, default=None, help="write results.md and results.json here")
    args = parser.parse_args()
    budget = args.budget_mib * MIB
    cgroups = not args.no_cgroup
    if cgroups:
        why = check_cgroups(budget)
        if why is not None:
            print(f"no per-rank memory cgroup ({why}): judging by each rank's VmHWM against the budget")
            cgroups = False
    how = "a memory cgroup per rank, limit = memsw limit" if cgroups else "VmHWM against the budget (no cgroup)"
    print(f"budget {args.budget_mib} MiB per rank, {how}; {WORLD} ranks, diloco every {SYNC_PERIOD} of {STEPS} steps")
    began = time.perf_counter()
    fix = not args.glibc_defaults
    if args.trial is not None:
        for layout in args.layouts:
            r = trial(args.trial, layout, budget, cgroups, fix, args.timeout)
            print(layout, json.dumps({k: v for k, v in r.items() if k != "ranks"}))
        return
    found = [search(layout, budget, cgroups, fix, args.timeout, print) for layout in args.layouts]
    seconds = time.perf_counter() - began
    text = table(found, budget, cgroups)
    print(text)
    print(f"{seconds:.0f}s in all")
    if args.out is not None:
        head = (
            f"Budget {args.budget_mib} MiB per rank ({how}); glibc mmap threshold"
            f" {'dynamic (defaults)' if args.glibc_defaults else 'fixed at 128 KiB'}; {WORLD} ranks;"
            f" search {seconds:.0f}s."
        )
        data = {
            "budget_mib": args.budget_mib,
            "cgroups": cgroups,
            "glibc_defaults": args.glibc_defaults,
            "seconds": seconds,
            "layouts": [
                {
                    "layout": f["layout"],
                    "largest": f["largest"],
                    "smallest_over": f["smallest_over"],
                    "tried": {str(k): {kk: vv for kk, vv in v.items()} for k, v in f["tried"].items()},
                }
                for f in found
            ],
        }
        write_results(args.out, f"{head}\n\n{text}", data)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3])
    else:
        main()
