"""``commstrats-advise``, and the link measured between running ranks.

The command answers in one line first (fits or not, what to run, its bytes and step), then a short table of
the best few; ``--full`` prints every candidate and column, both layouts. The parser is built from plain
data (:mod:`~lightning_commstrats.advisor.names`): torch is imported only once a model is read.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_commstrats.advisor.names import ACCELERATORS, INNER_OPTIMIZERS, OUTER_STATES, PARAM_DTYPES, SCHEMES

# A step's compute with every block's forward done again in backward: the forward is about a third of a step
# (forward 1, backward 2 in matrix products), so 4/3 (ShardPolicy.activation_checkpointing says the same).
RECOMPUTE = 4 / 3

if TYPE_CHECKING:
    from torch import nn

    from lightning_commstrats.advisor.answer import Change, Extras, Row
    from lightning_commstrats.advisor.fsdp import FsdpUnits
    from lightning_commstrats.advisor.predict import Candidate
    from lightning_commstrats.comm import Communicator
    from lightning_commstrats.cost_model import ModelShape


def measure_bandwidth(comm: Communicator, numel: int = 1 << 22, repeats: int = 3) -> float:
    """The link rate between the ranks of ``comm``, bits per second, from timed all-reduces.

    Every rank must call it (a collective). One all-reduce of ``numel`` float32 values on
    ``comm.device`` warms the channel up, then ``repeats`` are timed, each after a barrier; the
    rate is the bytes one rank sends in a ring all-reduce (:mod:`~lightning_commstrats.comm.wire`)
    over the fastest repeat of the slowest rank, so every rank returns the same number. It
    includes everything a real all-reduce pays (protocol, latency, the reduction itself), so it is
    what the cost model should be given (divided by 1e6: the advisor's ``bandwidth`` is in Mbit/s). The
    traffic is charged to the tag ``"bandwidth_probe"``.
    """
    import torch

    from lightning_commstrats.comm import wire

    if comm.world_size < 2:
        raise ValueError(f"measure_bandwidth needs at least 2 ranks, comm has {comm.world_size}")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < comm.world_size:
        raise ValueError(f"numel must be an int >= the number of ranks ({comm.world_size}), got {numel!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    buf = torch.zeros(numel, dtype=torch.float32, device=comm.device)
    comm.all_reduce(buf, tag="bandwidth_probe")
    best = math.inf
    for _ in range(repeats):
        comm.barrier()
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        start = time.perf_counter()
        comm.all_reduce(buf, tag="bandwidth_probe")
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        best = min(best, time.perf_counter() - start)
    slowest = comm.all_reduce(torch.tensor([best], dtype=torch.float64, device=comm.device), "max", tag="control")
    return wire.all_reduce_bytes(numel, 4, comm.world_size) * 8 / float(slowest.item())


def build_parser() -> argparse.ArgumentParser:
    """``commstrats-advise``'s options (no torch needed to build them)."""
    parser = argparse.ArgumentParser(
        prog="commstrats-advise",
        description=(
            "Which communication scheme of lightning-commstrats to train with, and whether it fits: the answer in"
            " one line, then the best few candidates. Predicts each scheme's seconds per step (compute + the bytes"
            " it sends over the link rate, no latency) and peak memory per rank. A faster periodic or compressed"
            " scheme trains differently: check its quality (benchmarks/compare.py)."
        ),
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--config", help="a training config: a packaged name (lstm_demo) or a YAML file")
    model.add_argument(
        "--model",
        help=(
            "a model, built on the meta device: a packaged config's name, a LitGPT configuration (pythia-160m,"
            " Llama-3.1-8B: needs litgpt), hf:NAME (a Hugging Face configuration: needs transformers), or"
            " package.module:Class / file.py:Class (a torch.nn.Module class, or a function returning a module)"
        ),
    )
    model.add_argument("--shapes", help="a JSON file: a list of parameter shapes, or {'shapes': [...], ...}")
    parser.add_argument(
        "--bandwidth", type=float, help="link rate between ranks, Mbit/s: both links where one is not given"
    )
    parser.add_argument(
        "--link-inside",
        type=float,
        metavar="MBIT",
        help="link inside a group of --shard ranks, Mbit/s a rank (FSDP2's gathers and reduce-scatters)",
    )
    parser.add_argument(
        "--link-between",
        type=float,
        metavar="MBIT",
        help="link between groups, Mbit/s a rank with every rank of its group sending (the scheme's exchange)",
    )
    parser.add_argument(
        "--compute-seconds", type=float, required=True, help="seconds of one step on one rank without communication"
    )
    parser.add_argument("--ranks", type=int, required=True, help="number of ranks")
    parser.add_argument("--schemes", nargs="+", metavar="SCHEME", help=f"schemes to try (default: all); {SCHEMES}")
    parser.add_argument("--vocab-size", type=int, default=0, help="vocabulary rows (with --shapes)")
    parser.add_argument("--vocab-width", type=int, default=0, help="values per vocabulary row, all matrices (--shapes)")
    parser.add_argument("--tokens-per-rank", type=int, help="token ids in a rank's minibatch (default: from the batch)")
    parser.add_argument("--sampled-rows", type=float, help="measured rows sampled_vocab sends per step")
    parser.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="sequences in a rank's micro-batch, to measure the activations (default: --config's)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="L",
        help="token ids a sequence, to measure the activations (default: --config's)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help=(
            "every block recomputes its activations in backward (shard_policy={'activation_checkpointing': True}):"
            " the activations measured so, each block keeping its input"
        ),
    )
    parser.add_argument("--top", type=int, help="rows to show (default 8; with --full: every candidate)")
    parser.add_argument(
        "--full", "--all", action="store_true", help="every candidate, both layouts, every column and note"
    )
    parser.add_argument("--tolerance", type=float, default=0.05, help="see the recommendation (default 0.05)")
    parser.add_argument(
        "--shard",
        type=int,
        metavar="N",
        help="shard='fsdp' over groups of N ranks (group_size=N): the answer and the table in that layout",
    )
    parser.add_argument(
        "--outer-state",
        choices=OUTER_STATES,
        default="host",
        help="where the periodic schemes keep their global model and outer state on a GPU (default host)",
    )
    parser.add_argument(
        "--optimizer",
        choices=tuple(INNER_OPTIMIZERS),
        help="the inner optimizer, for its state (default: the config's, else adamw)",
    )
    parser.add_argument(
        "--param-dtype", choices=tuple(PARAM_DTYPES), default="float32", help="the parameters' dtype (default float32)"
    )
    parser.add_argument(
        "--accelerator",
        choices=ACCELERATORS,
        default="gpu",
        help="gpu (default): device and host memory apart; cpu: all of it host memory",
    )
    parser.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="the memory of a rank's device (80GiB, 40GB, 850MiB): say whether each candidate's peak fits it",
    )
    parser.add_argument(
        "--memory-overhead",
        type=float,
        metavar="X",
        help=(
            "the allocator's factor on the itemized peak (default: measured, 1.0 on a CPU host with glibc's"
            " mmap threshold fixed, 1.10 on a GPU; see docs/advisor.md)"
        ),
    )
    parser.add_argument(
        "--activations",
        metavar="SIZE",
        help=(
            "bytes a rank's forward keeps for its backward (e.g. 70MiB; default: measured on the meta device for"
            " the batch of --config, or --model with --batch-size and --seq-len; none counted with --shapes)"
        ),
    )
    parser.add_argument(
        "--empty-init",
        action="store_true",
        help="the model is built empty (init_module(empty_init=True) or on meta): no whole model on a sharded rank",
    )
    parser.add_argument(
        "--gather-dtype",
        choices=tuple(PARAM_DTYPES),
        help="FSDP2's all-gather dtype, the forward's (mixed precision; default --param-dtype)",
    )
    parser.add_argument(
        "--reduce-dtype", choices=tuple(PARAM_DTYPES), help="FSDP2's reduce-scatter dtype (default --param-dtype)"
    )
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The usage errors argparse's types do not catch."""
    for flag in ("bandwidth", "link_inside", "link_between"):
        rate = getattr(args, flag)
        if rate is not None and not (rate > 0 and math.isfinite(rate)):
            parser.error(f"--{flag.replace('_', '-')} must be a finite rate > 0 Mbit/s, got {rate:g}")
    if args.link_between is None and args.bandwidth is None:
        parser.error("--bandwidth or --link-between is required (Mbit/s)")
    if args.link_inside is not None and args.shard is None:
        parser.error("--link-inside needs --shard N (the ranks of a group, whose FSDP2 traffic runs on that link)")
    if args.shard is not None and args.link_inside is None and args.bandwidth is None:
        parser.error(
            f"--shard {args.shard} prices FSDP2's in-group traffic: give --link-inside (or --bandwidth for both links)"
        )
    if args.memory_overhead is not None and not (args.memory_overhead >= 1 and math.isfinite(args.memory_overhead)):
        parser.error(f"--memory-overhead must be a finite number >= 1, got {args.memory_overhead:g}")
    if not (args.compute_seconds >= 0 and math.isfinite(args.compute_seconds)):
        parser.error(f"--compute-seconds must be a finite number of seconds >= 0, got {args.compute_seconds:g}")
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.shard is not None and not (1 <= args.shard <= args.ranks and args.ranks % args.shard == 0):
        parser.error(
            f"--shard must divide --ranks={args.ranks} (the ranks a replica is sharded over), got {args.shard}"
        )
    for flag in ("batch_size", "seq_len", "top"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.activation_checkpointing and args.activations is not None:
        parser.error(
            "--activation-checkpointing measures the activations of the model's blocks; with --activations give"
            " the checkpointed figure instead"
        )
    if args.activation_checkpointing and args.shapes:
        parser.error("--activation-checkpointing needs the model (--config or --model) to measure its blocks")


@dataclass
class _Run:
    """The command's inputs resolved: the model, its units and batch, and :func:`advise`'s other arguments;
    :meth:`evaluate` predicts them with some changed (what would fit)."""

    shape: ModelShape
    units: FsdpUnits | None
    unit_source: str
    module: nn.Module | None  # what the forward runs, to measure the activations
    batch: tuple[int, int] | None
    given_activations: int | None
    tokens: int
    optimizer: str
    optimizer_source: str
    options: dict[str, Any]
    measured: dict[tuple[Any, ...], int | None] = field(default_factory=dict)

    def activations(self, options: Mapping[str, Any]) -> int | None:
        """The activations for ``options``: given, measured (cached), or ``None`` when unknown."""
        if self.given_activations is not None:
            return self.given_activations
        if self.module is None or self.batch is None:
            return None
        from lightning_commstrats.advisor.peak import activation_bytes

        batch = options.get("batch_size", self.batch[0])
        dtype = options.get("gather_dtype") or options["param_dtype"]
        checkpointing = bool(options.get("activation_checkpointing"))
        attention = "fused" if options["accelerator"] == "gpu" else "math"
        key = (batch, self.batch[1], dtype, checkpointing, attention)
        if key not in self.measured:
            try:
                self.measured[key] = activation_bytes(
                    self.module, batch, self.batch[1], checkpointing=checkpointing, dtype=dtype, attention=attention
                )
            except ValueError:
                self.measured[key] = None  # a forward that does not run on meta: left out, and said so
        return self.measured[key]

    def evaluate(self, changes: Mapping[str, Any] | None = None) -> tuple[list[Candidate], bool, Extras]:
        """Every candidate with ``changes`` made to the options; whether the answer reads the sharded layout;
        what the run needs besides the strategy."""
        from lightning_commstrats.advisor.answer import Extras
        from lightning_commstrats.advisor.grid import advise

        changes = changes or {}
        options = {**self.options, **changes}
        activations = self.activations(options) or 0
        tokens = self.tokens
        if "batch_size" in changes and self.batch is not None:  # the compute time scaled with the batch
            tokens = self.tokens * options["batch_size"] // self.batch[0]
            options["compute_seconds"] *= options["batch_size"] / self.batch[0]
        if changes.get("activation_checkpointing") and not self.options["activation_checkpointing"]:
            options["compute_seconds"] *= RECOMPUTE  # one more forward of every block in backward
        advised = {k: v for k, v in options.items() if k not in ("batch_size", "activation_checkpointing")}
        found = advise(self.shape, units=self.units, activations=activations, tokens_per_rank=tokens, **advised)
        extras = Extras(
            checkpointing=bool(options.get("activation_checkpointing")),
            bf16_gathers=options.get("gather_dtype") == "bfloat16" and options["param_dtype"] == "float32",
        )
        return found, options.get("shard") is not None, extras


def _resolve(args: argparse.Namespace) -> _Run:
    """Read the model and put :func:`advise`'s arguments together (``ValueError`` on a bad input)."""
    from lightning_commstrats.advisor.fsdp import fsdp_units
    from lightning_commstrats.advisor.inputs import model_shape, parse_size
    from lightning_commstrats.advisor.sources import (
        batch_from_config,
        is_packaged_config,
        model_from_json,
        module_from_config,
        module_from_name,
        optimizer_from_config,
        units_from_json,
    )

    optimizer, source = args.optimizer or "adamw", "given" if args.optimizer else "assumed"
    config = args.config or (args.model if args.model and is_packaged_config(args.model) else None)
    batch: tuple[int, int] | None = None
    module = None
    if config:
        module, tokens = module_from_config(config)
        shape, units, unit_source = model_shape(module.net), fsdp_units(module), "the default shard policy's"
        batch = batch_from_config(config)
        if not args.optimizer:
            optimizer, source = optimizer_from_config(config), "from the config"
    elif args.model:
        module = module_from_name(args.model)
        shape, units, unit_source = model_shape(module), fsdp_units(module), "the default shard policy's"
        tokens = 0
    else:
        shape, tokens = model_from_json(args.shapes, args.vocab_size, args.vocab_width), 0
        units, unit_source = units_from_json(args.shapes), "the shapes file's"
        if units is None:
            unit_source = "guessed from the shapes (every tensor of 65,536 values or more a unit of its own)"
    if module is not None and (args.batch_size or args.seq_len):
        if batch is None and not (args.batch_size and args.seq_len):
            raise ValueError("--model's activations need both --batch-size and --seq-len")
        batch = (args.batch_size or batch[0], args.seq_len or batch[1])  # type: ignore[index]
        tokens = batch[0] * (batch[1] + 1)
    if args.tokens_per_rank is not None:
        tokens = args.tokens_per_rank
    if args.activation_checkpointing and batch is None:
        raise ValueError("--activation-checkpointing measures the activations: give --batch-size and --seq-len")

    def size(name: str) -> int | None:
        value = getattr(args, name)
        try:
            return parse_size(value, name) if value is not None else None
        except ValueError as err:
            raise ValueError(f"--{name.replace('_', '-')}: {err}") from None

    given = size("activations")
    options = {
        "bandwidth": args.bandwidth,
        "link_inside": args.link_inside,
        "link_between": args.link_between,
        "compute_seconds": args.compute_seconds,
        "ranks": args.ranks,
        "schemes": args.schemes,
        "sampled_rows": args.sampled_rows,
        "shard": args.shard,
        "optimizer": optimizer,
        "param_dtype": args.param_dtype,
        "outer_state": args.outer_state,
        "accelerator": args.accelerator,
        "gather_dtype": args.gather_dtype,
        "reduce_dtype": args.reduce_dtype,
        "memory_overhead": args.memory_overhead,
        "empty_init": args.empty_init,
        "device_memory": size("device_memory"),
        "activation_checkpointing": args.activation_checkpointing,
    }
    return _Run(shape, units, unit_source, module, batch, given, tokens, optimizer, source, options)


def main(argv: Sequence[str] | None = None) -> int:
    """``commstrats-advise``: the answer in one line, then the best few candidates (``--full``: all of them).
    Exits 0 when a candidate fits (or no device memory was given), 1 when none does, 2 on a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    try:
        run = _resolve(args)
        found, sharded, extras = run.evaluate()
    except (ValueError, OSError) as err:
        parser.error(str(err))
    from lightning_commstrats.advisor.answer import answer_line, pick_row

    pick = pick_row(found, args.tolerance, sharded)
    if sharded:  # every rank whole instead, when that fits and is faster beyond the tolerance
        whole = pick_row(found, args.tolerance, False)
        if whole is not None and (pick is None or whole.step_seconds < pick.step_seconds * (1 - args.tolerance)):
            pick = whole
    if pick is not None:
        print(answer_line(pick, extras))
    else:
        print(_no_fit(run, found, sharded, args.tolerance))
    print(f"\n{_context(run, args)}\n")
    if args.full:
        _print_full(run, args, found)
    else:
        _print_short(run, args, found, sharded, pick)
    return 0 if pick is not None else 1


def _no_fit(run: _Run, found: list[Candidate], sharded: bool, tolerance: float) -> str:
    """``fits: no — ...``: the closest candidate, and the changes that would make one fit, tried in the model."""
    from lightning_commstrats.advisor.answer import answer_line, closest, figures, rows, what_would_fit
    from lightning_commstrats.advisor.grid import readable

    near = closest(rows(found, sharded)) or closest(rows(found, False))
    device = readable(run.options["device_memory"])
    where = ", sharded" if near is not None and near.sharded else ""
    line = f"fits: no — nothing fits {device} a rank"
    if near is not None:
        line += f" (closest: {near.label}{where}, peak {readable(near.peak or 0)})"
    fits, last = what_would_fit(run.evaluate, _changes(run, sharded), tolerance)
    if fits:
        line += "; fits with " + " or ".join(f"`{f.flags}`" for f in fits) + ":"
        for f in fits:
            said = f" ({f.note})" if f.note else ""
            line += f"\n  - `{f.flags}`{said}: {answer_line(f.row, f.extras).removeprefix('fits: yes — ')}"
    elif last is not None:
        line += f"; with every change the advisor can make, still {readable(last.over() or 0)} over: {figures(last)}"
    else:
        line += "; the advisor knows no change that would make it fit"
    return line


def _changes(run: _Run, sharded: bool) -> list[Change]:
    """What to try when nothing fits, in this order: activation checkpointing, bf16 gathers, the model built
    empty, the outer state on the host, a smaller micro-batch, larger groups."""
    from lightning_commstrats.advisor.answer import Change

    o = run.options
    out = []
    if not o["activation_checkpointing"] and run.module is not None and run.batch is not None:
        again = f"compute {o['compute_seconds'] * RECOMPUTE:.3g} s a step: every block's forward again"
        out.append(Change("--activation-checkpointing", {"activation_checkpointing": True}, note=again))
    if sharded and (o["gather_dtype"] or o["param_dtype"]) == "float32":
        out.append(Change("--gather-dtype bfloat16", {"gather_dtype": "bfloat16"}))
    if sharded and not o["empty_init"]:
        out.append(Change("--empty-init", {"empty_init": True}))
    if o["outer_state"] == "device":
        out.append(Change("--outer-state host", {"outer_state": "host"}))
    if run.given_activations is None and run.module is not None and run.batch is not None:
        b = run.batch[0] // 2
        while b >= 1:
            share = f"compute {o['compute_seconds'] * b / run.batch[0]:.3g} s a step, {b} of {run.batch[0]} sequences"
            out.append(Change(f"--batch-size {b}", {"batch_size": b}, ladder="batch", note=share))
            b //= 2
    ranks, now = o["ranks"], o["shard"] or 1
    for g in (g for g in range(now + 1, ranks + 1) if ranks % g == 0):
        changed: dict[str, Any] = {"shard": g}
        flags = f"--shard {g}"
        if o["link_inside"] is None and o["bandwidth"] is None:  # no inside link known: the link between, a guess
            changed["link_inside"] = o["link_between"]
            flags += f" --link-inside {o['link_between']:g}"
        out.append(Change(flags, changed, ladder="shard"))
    return out


def _context(run: _Run, args: argparse.Namespace) -> str:
    """The inputs as the advisor read them, in one line."""
    from lightning_commstrats.advisor.grid import readable

    shape = run.shape
    between = args.link_between if args.link_between is not None else args.bandwidth
    inside = args.link_inside if args.link_inside is not None else args.bandwidth
    links = f"{between:g} Mbit/s links"
    if args.shard and inside != between:
        links = f"links {inside:g} Mbit/s inside groups of {args.shard}, {between:g} Mbit/s between them"
    vocab = f", vocabulary {shape.vocab_size} x {shape.vocab_width}" if shape.vocab_size else ""
    acts = run.activations(run.options)
    if run.given_activations is not None:
        said = f"activations {readable(acts)} a rank, given"
    elif acts is not None and run.batch is not None:
        how = ", checkpointed" if args.activation_checkpointing else ""
        said = f"activations {readable(acts)} a rank ({run.batch[0]} x {run.batch[1]} tokens, measured on meta{how})"
    else:
        said = "activations not counted (give --activations, or --batch-size and --seq-len with --model)"
    return (
        f"# Advice: {shape.numel:,} parameters in {len(shape.shapes)} tensors{vocab}; {args.ranks} ranks,"
        f" {links}, {args.compute_seconds:g} s compute per step; {said}"
    )


def _print_short(run: _Run, args: argparse.Namespace, found: list[Candidate], sharded: bool, pick: Row | None) -> None:
    from lightning_commstrats.advisor.answer import closest, pick_row, rows, short_table
    from lightning_commstrats.advisor.grid import readable

    layout = pick.sharded if pick is not None else sharded
    laid = rows(found, layout) or rows(found, False)
    layout = laid[0].sharded if laid else False
    first = pick if pick is not None and pick.sharded == layout else None
    if pick is None:
        first = closest(laid)
    sharding = f"Sharded (shard='fsdp', group_size={args.shard})"
    title = sharding if layout else "Every rank holding the whole model"
    print(f"{title}, {'the recommendation' if pick is not None else 'the closest to fitting'} first:\n")
    print(short_table(laid, first, args.top or 8))
    if sharded:  # the other layout in one line
        other = not layout
        best, near = pick_row(found, args.tolerance, other), closest(rows(found, other))
        name = sharding if other else "Every rank whole"
        if best is not None:
            peak = f", peak {readable(best.peak)}" if best.peak is not None else ""
            print(f"\n{name} instead: {best.label}, {best.step_seconds:.3g} s/step{peak}")
        elif near is not None:
            print(f"\n{name} instead: nothing fits (the smallest peak {readable(near.peak or 0)}).")
    fsdp = " + FSDP2's in-group traffic (not hidden: an upper bound)" if layout else ""
    print(
        f"\ns/step = compute{fsdp} + the exchange not hidden behind compute (bytes / link rate; no latency, no codec"
        " compute); a periodic exchange's bytes are spread over its period. The peak: tensors held between steps +"
        " the largest phase of a step, times the allocator's factor (docs/advisor.md). --full: every candidate,"
        " both layouts, every column and note."
    )


def _print_full(run: _Run, args: argparse.Namespace, found: list[Candidate]) -> None:
    """The full output: both layouts' recommendations, every candidate with every column, and how each figure
    is made."""
    from lightning_commstrats.advisor.grid import readable, table
    from lightning_commstrats.advisor.peak import ALLOCATOR_SLACK, HOST_PROCESS_BYTES

    device_memory = run.options["device_memory"]
    _recommendations(found, args.tolerance, args.shard, device_memory)
    print(table(found, args.top, args.shard))
    states = INNER_OPTIMIZERS[run.optimizer][0]
    where = "a GPU" if args.accelerator == "gpu" else "the CPU (all of it host memory)"
    sharded = (
        f"; shard {args.shard}: shard='fsdp' with group_size={args.shard}, the shard columns that layout"
        if args.shard
        else ""
    )
    print(
        "\nPredicted s/step = compute + the communication not hidden behind it (bytes / link rate; no latency,"
        " no codec compute). Periodic schemes' bytes are spread over their period."
        f"\n\nMemory per rank, held between steps: the {args.param_dtype} model"
        f" ({readable(run.shape.numel * PARAM_DTYPES[args.param_dtype])}), its gradients, {run.optimizer}'s state"
        f" ({states} buffer{'s' if states != 1 else ''} per parameter, {run.optimizer_source}) and the scheme's own"
        f" state, training on {where}, the periodic schemes' outer state on the {args.outer_state}{sharded}."
        " Not counted: activations, buffers, a sync's transient copies."
    )
    if args.shard:
        gather, reduce = args.gather_dtype or args.param_dtype, args.reduce_dtype or args.param_dtype
        print(
            f"\nSharded: the unsharded time columns run the exchange over all {args.ranks} ranks"
            f"{' at the slower link' if args.shard < args.ranks else ' inside the one group'}; shard {args.shard}"
            f" adds FSDP2's in-group traffic (every unit all-gathered in forward and again in backward, the root"
            f" once, gradients reduce-scattered; {gather} gathers, {reduce} reductions; not hidden behind compute:"
            f" an upper bound) on the link inside, and the scheme's exchange of a rank's shards over the"
            f" {args.ranks // args.shard} groups on the link between. Units: {run.unit_source}."
        )
    if device_memory is not None:
        built = (
            " (the model built empty: no rank holds it whole)"
            if args.empty_init
            else ", or the whole model built on every rank before it is sharded if more (--empty-init: built empty)"
        )
        slack = args.memory_overhead if args.memory_overhead is not None else ALLOCATOR_SLACK[args.accelerator]
        process = f" + {readable(HOST_PROCESS_BYTES)} the process grows by" if args.accelerator == "cpu" else ""
        activations = run.activations(run.options)
        if run.given_activations is not None:
            acts = f"activations {readable(activations)}, given"
        elif activations:
            acts = f"activations {readable(activations)}, measured on the meta device for the batch"
        else:
            acts = "activations not counted (unknown: give --activations)"
        print(
            f"\nPeak per rank on the training device = {slack:.3g} x (the tensors held + the largest phase of a"
            f" step on top of them){process}: the forward ({acts}; sharded, FSDP2's root and a unit gathered),"
            " the backward (sharded: the root and a unit gathered with their gradients unsharded, the next unit"
            " prefetched), the optimizer step's temporaries, a sync's buffers in flight (measured factors; see"
            f" docs/advisor.md){built}. Against {readable(device_memory)} a rank, above what the process holds"
            " before the model is built."
        )


def _recommendations(found: list[Candidate], tolerance: float, shard: int | None, device_memory: int | None) -> None:
    """Print the recommendation of each layout, every figure from that layout's row."""
    from lightning_commstrats.advisor.answer import Row
    from lightning_commstrats.advisor.grid import readable, recommend

    layouts = [False, True] if shard else [False]
    for sharded in layouts:
        where = f", sharded (shard='fsdp', group_size={shard})" if sharded else ""
        try:
            row = Row(recommend(found, tolerance, sharded=sharded), sharded)
        except ValueError as err:
            print(f"{str(err)[0].upper()}{str(err)[1:]}.\n")
            continue
        step = f"{row.step_seconds:.4g} s/step"
        if sharded:
            step += f" (in-group {row.inside_seconds:.4g} s, cross-group {row.exchange_seconds:.4g} s)"
        fit = f", peak {readable(row.peak)} a rank" if device_memory and row.peak is not None else ""
        print(
            f"Recommended{where}: **{row.label}**, predicted {step}{fit} ({row.note}). The fastest"
            f" within {tolerance:.0%} of the best that departs least from synchronous SGD"
            f"{' among those that fit' if device_memory else ''}.\n"
        )


if __name__ == "__main__":
    sys.exit(main())
