"""``commstrats-advise``, and the link measured between running ranks."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_commstrats.advisor.fsdp import FsdpUnits, fsdp_units
from lightning_commstrats.advisor.grid import advise, readable, recommend, table
from lightning_commstrats.advisor.inputs import (
    ACCELERATORS,
    INNER_OPTIMIZERS,
    PARAM_DTYPES,
    SCHEMES,
    model_shape,
    parse_size,
)
from lightning_commstrats.advisor.peak import ALLOCATOR_SLACK, HOST_PROCESS_BYTES, activation_bytes
from lightning_commstrats.advisor.predict import Candidate
from lightning_commstrats.comm import Communicator, wire
from lightning_commstrats.cost_model import ModelShape
from lightning_commstrats.outer import OUTER_STATES


def measure_bandwidth(comm: Communicator, numel: int = 1 << 22, repeats: int = 3) -> float:
    """The link rate between the ranks of ``comm``, bits per second, from timed all-reduces.

    Every rank must call it (a collective). One all-reduce of ``numel`` float32 values on
    ``comm.device`` warms the channel up, then ``repeats`` are timed, each after a barrier; the
    rate is the bytes one rank sends in a ring all-reduce (:mod:`~lightning_commstrats.comm.wire`)
    over the fastest repeat of the slowest rank, so every rank returns the same number. It
    includes everything a real all-reduce pays (protocol, latency, the reduction itself), so it is
    what the cost model should be given. The traffic is charged to the tag ``"bandwidth_probe"``.
    """
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


def model_from_config(value: str) -> tuple[ModelShape, int]:
    """The parameter shapes of the model a training config describes (a packaged config's name or
    a YAML file), built on the meta device (no memory, no data), and the token ids in one rank's
    minibatch. The vocabulary is the config's ``data.max_vocab_size`` (the cap; a corpus with fewer
    distinct words gets a smaller one)."""
    module, tokens = module_from_config(value)
    return model_shape(module.net), tokens


def module_from_config(value: str) -> tuple[torch.nn.Module, int]:
    """The ``LanguageModel`` a training config describes, on the meta device, and the token ids in one
    rank's minibatch (see :func:`model_from_config`)."""
    from lightning_commstrats.models import LanguageModel

    model_args, data = _config(value)
    model_args.update(vocab_size=data["max_vocab_size"], order=data["order"], max_seq_len=data["seq_len"])
    with torch.device("meta"):
        module = LanguageModel(**model_args)
    ngram = model_args.get("arch", "lstm") == "ffn"
    tokens = data["batch_size"] * (data["order"] if ngram else data["seq_len"] + 1)
    return module, tokens


def batch_from_config(value: str) -> tuple[int, int]:
    """A rank's minibatch of a training config as its model's forward takes it: ``(sequences, token ids
    per sequence)`` (the n-gram model's context of ``order - 1`` words, else ``seq_len`` tokens)."""
    model_args, data = _config(value)
    ngram = model_args.get("arch", "lstm") == "ffn"
    return data["batch_size"], data["order"] - 1 if ngram else data["seq_len"]


def _config(value: str) -> tuple[dict, dict]:
    import yaml

    from lightning_commstrats.cli import resolve_config
    from lightning_commstrats.data import LMDataModule

    path = Path(resolve_config(value))
    if not path.is_file():
        raise ValueError(f"--config: {value!r} is not a file or a packaged config")
    config = yaml.safe_load(path.read_text()) or {}
    data_defaults = {
        name: p.default for name, p in inspect.signature(LMDataModule.__init__).parameters.items() if name != "self"
    }
    return dict(config.get("model") or {}), {**data_defaults, **(config.get("data") or {})}


def model_from_json(path: str, vocab_size: int = 0, vocab_width: int = 0) -> ModelShape:
    """Parameter shapes from a JSON file: a list of shapes, or an object with ``shapes`` (or the
    race's ``param_shapes``) and optionally ``vocab_size`` and ``vocab_width``."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        shapes = data.get("shapes", data.get("param_shapes"))
        if shapes is None:
            raise ValueError(f"--shapes: {path} has no 'shapes' list")
        vocab_size = vocab_size or int(data.get("vocab_size", 0))
        vocab_width = vocab_width or int(data.get("vocab_width", 0))
    else:
        shapes = data
    return model_shape(shapes, vocab_size, vocab_width)


def units_from_json(path: str) -> FsdpUnits | None:
    """The FSDP2 units a shapes file gives: ``{"units": [[tensor indices], ...], "root": [...]}`` (the
    indices into its ``shapes``; ``root`` defaults to the tensors no unit names); ``None`` without."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "units" not in data:
        return None
    try:
        units = tuple(tuple(int(i) for i in u) for u in data["units"])
        named = {i for u in units for i in u}
        count = len(data.get("shapes", data.get("param_shapes", ())))
        root = tuple(int(i) for i in data.get("root", [i for i in range(count) if i not in named]))
    except (TypeError, ValueError) as err:
        raise ValueError(f"--shapes: {path}'s 'units' must be lists of tensor indices: {err}") from None
    return FsdpUnits(units, root)


def main(argv: Sequence[str] | None = None) -> int:
    """``commstrats-advise``: print every candidate's predicted step and memory per rank as a markdown table."""
    parser = argparse.ArgumentParser(
        prog="commstrats-advise",
        description=(
            "Predict the seconds per training step and the memory per rank of every communication scheme of"
            " lightning-commstrats for a model, link rate, compute time per step and number of ranks (the cost"
            " model: bytes over the link rate, no latency; the memory the strategies hold between steps),"
            " fastest first. A faster periodic or compressed scheme trains differently: check its quality"
            " (benchmarks/compare.py)."
        ),
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--config", help="a training config: a packaged name (lstm_demo) or a YAML file")
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
    parser.add_argument("--tokens-per-rank", type=int, help="token ids in a rank's minibatch (default: from --config)")
    parser.add_argument("--sampled-rows", type=float, help="measured rows sampled_vocab sends per step")
    parser.add_argument("--top", type=int, help="print only the fastest TOP candidates")
    parser.add_argument("--tolerance", type=float, default=0.05, help="see the recommendation (default 0.05)")
    parser.add_argument(
        "--shard",
        type=int,
        metavar="N",
        help="also show the memory per rank with shard='fsdp' over groups of N ranks (group_size=N)",
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
            " --config's batch; none counted with --shapes)"
        ),
    )
    parser.add_argument(
        "--empty-init",
        action="store_true",
        help="the model is built empty (init_module(empty_init=True) or on meta): no whole model on a sharded rank",
    )
    parser.add_argument(
        "--gather-dtype", choices=tuple(PARAM_DTYPES), help="FSDP2's all-gather dtype (default --param-dtype)"
    )
    parser.add_argument(
        "--reduce-dtype", choices=tuple(PARAM_DTYPES), help="FSDP2's reduce-scatter dtype (default --param-dtype)"
    )
    args = parser.parse_args(argv)
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

    def size(name: str) -> int | None:
        """The size argument ``--<name>`` in bytes (None when not given); a bad one is a usage error."""
        value = getattr(args, name)
        if value is None:
            return None
        try:
            return parse_size(value, name)
        except ValueError as err:
            parser.error(f"--{name.replace('_', '-')}: {err}")

    device_memory = size("device_memory")
    if args.memory_overhead is not None and not (args.memory_overhead >= 1 and math.isfinite(args.memory_overhead)):
        parser.error(f"--memory-overhead must be a finite number >= 1, got {args.memory_overhead:g}")
    activations = size("activations")
    if not (args.compute_seconds >= 0 and math.isfinite(args.compute_seconds)):
        parser.error(f"--compute-seconds must be a finite number of seconds >= 0, got {args.compute_seconds:g}")
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.shard is not None and not (1 <= args.shard <= args.ranks and args.ranks % args.shard == 0):
        parser.error(
            f"--shard must divide --ranks={args.ranks} (the ranks a replica is sharded over), got {args.shard}"
        )
    try:
        optimizer, source = args.optimizer or "adamw", "given" if args.optimizer else "assumed"
        if args.config:
            module, tokens = module_from_config(args.config)
            shape, units, unit_source = model_shape(module.net), fsdp_units(module), "the default shard policy's"
            if not args.optimizer:
                optimizer, source = optimizer_from_config(args.config), "from the config"
        else:
            shape, tokens = model_from_json(args.shapes, args.vocab_size, args.vocab_width), 0
            units, unit_source = units_from_json(args.shapes), "the shapes file's"
            if units is None:
                unit_source = "guessed from the shapes (every tensor of 65,536 values or more a unit of its own)"
        if args.tokens_per_rank is not None:
            tokens = args.tokens_per_rank
        measured = ""
        if activations is None and args.config:
            try:
                activations = activation_bytes(module, *batch_from_config(args.config))
                measured = ", measured on the meta device for the config's batch"
            except ValueError:
                measured = ""  # a forward that does not run on meta: left out, and said so below
        mbit = {"bandwidth": args.bandwidth, "link_inside": args.link_inside, "link_between": args.link_between}
        rates = {f"{k}_bits": v * 1e6 if v is not None else None for k, v in mbit.items()}
        found = advise(
            shape,
            compute_seconds=args.compute_seconds,
            ranks=args.ranks,
            candidates=args.schemes,
            tokens_per_rank=tokens,
            sampled_rows=args.sampled_rows,
            shard=args.shard,
            optimizer=optimizer,
            param_dtype=args.param_dtype,
            outer_state=args.outer_state,
            accelerator=args.accelerator,
            units=units,
            gather_dtype=args.gather_dtype,
            reduce_dtype=args.reduce_dtype,
            overhead=args.memory_overhead,
            empty_init=args.empty_init,
            device_memory=device_memory,
            activations=activations or 0,
            **rates,
        )
    except (ValueError, OSError) as err:
        parser.error(str(err))
    between = args.link_between if args.link_between is not None else args.bandwidth
    inside = args.link_inside if args.link_inside is not None else args.bandwidth
    links = f"{between:g} Mbit/s links"
    if args.shard and inside != between:
        links = f"links {inside:g} Mbit/s inside groups of {args.shard}, {between:g} Mbit/s between them"
    vocab = f", vocabulary {shape.vocab_size} x {shape.vocab_width}" if shape.vocab_size else ""
    print(
        f"# Advice: {shape.numel:,} parameters in {len(shape.shapes)} tensors{vocab}; {args.ranks} ranks,"
        f" {links}, {args.compute_seconds:g} s compute per step\n"
    )
    fitting = _recommendations(found, args.tolerance, args.shard, device_memory)
    print(table(found, args.top, args.shard))
    states = INNER_OPTIMIZERS[optimizer][0]
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
        f" ({readable(shape.numel * PARAM_DTYPES[args.param_dtype])}), its gradients, {optimizer}'s state"
        f" ({states} buffer{'s' if states != 1 else ''} per parameter, {source}) and the scheme's own state,"
        f" training on {where}, the periodic schemes' outer state on the {args.outer_state}{sharded}."
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
            f" {args.ranks // args.shard} groups on the link between. Units: {unit_source}."
        )
    if device_memory is not None:
        built = (
            " (the model built empty: no rank holds it whole)"
            if args.empty_init
            else ", or the whole model built on every rank before it is sharded if more (--empty-init: built empty)"
        )
        slack = args.memory_overhead if args.memory_overhead is not None else ALLOCATOR_SLACK[args.accelerator]
        process = f" + {readable(HOST_PROCESS_BYTES)} the process grows by" if args.accelerator == "cpu" else ""
        acts = (
            f"activations {readable(activations)}{measured if args.activations is None else ', given'}"
            if activations
            else "activations not counted (unknown: give --activations)"
        )
        print(
            f"\nPeak per rank on the training device = {slack:.3g} x (the tensors held + the largest phase of a"
            f" step on top of them){process}: the forward ({acts}; sharded, FSDP2's root and a unit gathered),"
            " the backward (sharded: the root and a unit gathered with their gradients unsharded, the next unit"
            " prefetched), the optimizer step's temporaries, a sync's buffers in flight (measured factors; see"
            f" docs/advisor.md){built}. Against {readable(device_memory)} a rank, above what the process holds"
            " before the model is built."
        )
    return 0 if fitting else 1


def _recommendations(found: list[Candidate], tolerance: float, shard: int | None, device_memory: int | None) -> bool:
    """Print the recommendation of each layout; whether any candidate fits ``device_memory``."""
    fitting = False
    layouts = [False, True] if shard else [False]
    for sharded in layouts:
        where = f", sharded (shard='fsdp', group_size={shard})" if sharded else ""
        try:
            pick = recommend(found, tolerance, sharded=sharded)
        except ValueError as err:
            print(f"{str(err)[0].upper()}{str(err)[1:]}.\n")
            continue
        fitting = True
        if sharded and pick.sharded is not None:
            s = pick.sharded
            step = (
                f"{s.step_seconds:.4g} s/step (in-group {s.inside_seconds:.4g} s, cross-group"
                f" {s.between_seconds:.4g} s)"
            )
        else:
            step = f"{pick.step_seconds:.4g} s/step"
        fit = f", peak {readable(pick.sharded_peak if sharded else pick.peak)} a rank" if device_memory else ""
        print(
            f"Recommended{where}: **{pick.label}**, predicted {step}{fit} ({pick.note}). The fastest"
            f" within {tolerance:.0%} of the best that departs least from synchronous SGD"
            f"{' among those that fit' if device_memory else ''}.\n"
        )
    return fitting


def optimizer_from_config(value: str) -> str:
    """The inner optimizer a training config's model uses, as :func:`memory_per_rank` names it."""
    import yaml

    from lightning_commstrats.cli import resolve_config

    config = yaml.safe_load(Path(resolve_config(value)).read_text()) or {}
    model = config.get("model") or {}
    name = model.get("optimizer", "adam")  # LanguageModel's default
    if name == "sgd":
        return "sgd_momentum" if model.get("momentum", 0) else "sgd"
    return name


if __name__ == "__main__":
    sys.exit(main())
