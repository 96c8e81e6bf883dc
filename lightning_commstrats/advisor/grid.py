"""Every candidate at once: the settings tried, the ranking and the table (:func:`advise`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_commstrats import cost_model
from lightning_commstrats.advisor.fsdp import FsdpUnits, fsdp_units
from lightning_commstrats.advisor.inputs import (
    AVERAGING_PERIODS,
    DILOCO_BITS,
    DILOCO_PERIODS,
    ONEBIT_BITS,
    OUT_OF_SCOPE,
    PERIODIC,
    SAMPLED_VOCAB,
    SCHEMES,
    STREAMING_BITS,
    STREAMING_FRAGMENTS,
    accepts_old_names,
    check_inputs,
    check_shard,
    model_shape,
    parse_size,
    resolve_links,
)
from lightning_commstrats.advisor.peak import activation_bytes
from lightning_commstrats.advisor.predict import Candidate, predict
from lightning_commstrats.cost_model import ModelShape
from lightning_commstrats.strategies.fragments import fragment_bounds


@accepts_old_names("bandwidth_bits")
def default_settings(
    scheme: str, model: ModelShape, *, bandwidth: float, compute_seconds: float, ranks: int
) -> list[dict[str, Any]]:
    """The settings tried for ``scheme`` when :func:`advise` is given its name alone.

    ``streaming_diloco`` gets, per period and bits, the smallest ``fragment_sync_delay`` that
    hides the largest fragment's exchange behind compute (at most what the period allows) on a link of
    ``bandwidth`` Mbit/s.
    """
    return _default_settings(scheme, model, bandwidth * 1e6, compute_seconds, ranks)


def _default_settings(
    scheme: str, model: ModelShape, bandwidth_bits: float, compute_seconds: float, ranks: int
) -> list[dict[str, Any]]:
    if scheme == "allreduce":
        return [{}]
    if scheme in ("onebit_sgd", "onebit_adam"):
        return [{"num_quantization_bits": b} for b in ONEBIT_BITS]
    if scheme == "zero_one_adam":
        return [{"num_quantization_bits": 1, "local_step_clipper": h} for h in (1, 4, 16)]
    if scheme == "sampled_vocab":
        return [dict(SAMPLED_VOCAB)]
    if scheme in ("model_averaging", "bmuf"):
        return [{"sync_period": h, "sync_period_unit": "steps"} for h in AVERAGING_PERIODS]
    if scheme == "local_sgd":
        return [{"sync_period": h} for h in AVERAGING_PERIODS]
    if scheme == "diloco":  # and SparseLoCo's quantizer sent dense, 2 bits a value
        grid = [{"sync_period": h, "pseudo_grad_bits": b} for h in DILOCO_PERIODS for b in DILOCO_BITS]
        return grid + [{"sync_period": h, "pseudo_grad_codec": "statistical"} for h in DILOCO_PERIODS]
    if scheme == "sparseloco":  # its defaults (top 64 of 4096 in 2 bits, behind one step), and the published form
        published = {"topk_form": "published", "topk_schedule": "run"}
        return [{"sync_period": h} for h in DILOCO_PERIODS] + [{"sync_period": h, **published} for h in DILOCO_PERIODS]
    out = []
    fragments = min(STREAMING_FRAGMENTS, len(model.shapes))
    for h in DILOCO_PERIODS:
        f = min(fragments, h)
        most = (h - 1) // f  # the longest delay the period allows
        for b in STREAMING_BITS:
            bounds = fragment_bounds([math.prod(s) for s in model.shapes], f)
            longest = max(
                cost_model.seconds(
                    cost_model.exchange_bytes(model.shapes[i0:i1], ranks, b, by_rows=True), bandwidth_bits
                )
                for i0, i1 in bounds
            )
            need = math.ceil(longest / compute_seconds) if compute_seconds > 0 else most
            delay = max(1, min(need, most)) if most >= 1 else 0
            out.append({"sync_period": h, "num_fragments": f, "fragment_sync_delay": delay, "pseudo_grad_bits": b})
    return out


@accepts_old_names("bandwidth_bits", "link_inside_bits", "link_between_bits", "candidates", "overhead")
def advise(
    model_or_shapes: Any,
    *,
    bandwidth: float | None = None,
    compute_seconds: float,
    ranks: int,
    vocab_size: int = 0,
    vocab_width: int = 0,
    schemes: Iterable[str | tuple[str, Mapping[str, Any]]] | None = None,
    tokens_per_rank: int = 0,
    sampled_rows: float | None = None,
    shard: int | None = None,
    optimizer: str = "adamw",
    param_dtype: str = "float32",
    outer_state: str = "host",
    accelerator: str = "gpu",
    link_inside: float | None = None,
    link_between: float | None = None,
    units: FsdpUnits | None = None,
    gather_dtype: str | None = None,
    reduce_dtype: str | None = None,
    reshard_after_forward: bool | None = None,
    memory_overhead: float | None = None,
    empty_init: bool = False,
    device_memory: int | str | None = None,
    activations: int | str | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
    process_bytes: int | None = None,
) -> list[Candidate]:
    """Every candidate's predicted step, fastest first (in the sharded layout's figures with ``shard``),
    with the memory each rank holds. The arguments are the command's flags (``--bandwidth`` is
    ``bandwidth``, ``--schemes`` ``schemes``, in the same units).

    Args:
        model_or_shapes: a ``torch.nn.Module``, a :class:`~lightning_commstrats.cost_model.ModelShape`
            or the shapes of the trainable parameters (tied ones once, in registration order).
        bandwidth: the link rate between ranks, Mbit/s in each direction: both links where
            ``link_inside`` or ``link_between`` is not given.
        compute_seconds: seconds of one training step on one rank with no communication (measured,
            e.g. a one-rank run; with several ranks per machine, measured with all of them busy).
        ranks: the number of ranks.
        vocab_size, vocab_width: the vocabulary matrices' rows and values per row (for
            ``sampled_vocab``; a module's declared ``vocab_parameters()`` give them).
        schemes: scheme names (each tried at :func:`default_settings`) and/or ``(scheme, settings)``
            pairs; default: every scheme but ``local_sgd`` (MPI only, the bytes of ``model_averaging``),
            and ``sampled_vocab`` only with a vocabulary.
        tokens_per_rank, sampled_rows, shard: see :func:`predict`.
        optimizer, param_dtype, outer_state, accelerator: see :func:`memory_per_rank`.
        link_inside, link_between: the links inside and between groups, Mbit/s: see :func:`predict`.
        units, gather_dtype, reduce_dtype, reshard_after_forward: the sharded layout's FSDP2 traffic.
        memory_overhead, empty_init, device_memory, process_bytes: the peak memory against a device's:
            see :func:`predict`.
        activations: the bytes (or a size, ``"3GiB"``) a rank's forward keeps for its backward. Default:
            with a module and ``batch_size`` and ``seq_len``, measured on the meta device
            (:func:`~lightning_commstrats.advisor.activation_bytes`, in ``gather_dtype`` when given, with a
            GPU's fused attention on a GPU), else none counted.
        batch_size, seq_len: a rank's micro-batch, sequences of token ids, to measure the activations.
        activation_checkpointing: the activations measured with every block checkpointed (see
            :func:`~lightning_commstrats.advisor.activation_bytes`).

    The old names ``bandwidth_bits``, ``link_inside_bits``, ``link_between_bits`` (bits per second),
    ``candidates`` and ``overhead`` are accepted for one more release, with a ``DeprecationWarning``.

    Raises:
        ValueError: naming the argument: ``bandwidth <= 0``, ``compute_seconds < 0``, ``ranks < 1``, an
            unknown scheme in ``schemes``, a model without parameters, a missing link, ``link_inside``
            without ``shard``, a bad ``device_memory``, activations that cannot be measured.
    """
    if shard is not None:
        check_shard(shard, ranks)
    flat, _, _ = resolve_links(bandwidth, link_inside, link_between, ranks, shard)
    check_inputs(flat, compute_seconds, ranks)
    module = model_or_shapes if isinstance(model_or_shapes, nn.Module) else None
    if units is None and module is not None:
        units = fsdp_units(module)
    model = model_shape(model_or_shapes, vocab_size, vocab_width)
    if activations is None:
        activations = 0
        if module is not None and batch_size is not None and seq_len is not None:
            activations = activation_bytes(
                module,
                batch_size,
                seq_len,
                checkpointing=activation_checkpointing,
                dtype=gather_dtype or param_dtype,
                attention="fused" if accelerator == "gpu" else "math",
            )
    elif activation_checkpointing:
        raise ValueError("activation_checkpointing: the activations were given; measure them checkpointed instead")
    candidates = schemes
    if candidates is None:
        vocab = model.vocab_size and model.vocab_width
        adam = optimizer in ("adam", "adamw")  # onebit_adam continues the user's Adam
        candidates = [
            s
            for s in SCHEMES
            if s != "local_sgd"
            and (vocab or s != "sampled_vocab")
            and (adam or s not in ("onebit_adam", "zero_one_adam"))
        ]
    elif isinstance(candidates, (str, bytes)):
        raise ValueError(f"schemes must be a list of scheme names or (scheme, settings) pairs, got {candidates!r}")
    pairs: list[tuple[str, Mapping[str, Any]]] = []
    for item in candidates:
        name, settings = (item, None) if isinstance(item, str) else tuple(item)
        if name in OUT_OF_SCOPE:
            raise ValueError(f"schemes: the advisor does not predict {name!r}: {OUT_OF_SCOPE[name]}")
        if name not in SCHEMES:
            raise ValueError(f"schemes: unknown scheme {name!r}; choose from {SCHEMES}")
        if settings is None:
            grid = _default_settings(name, model, flat, compute_seconds, ranks)
            pairs += [(name, s) for s in grid]
        else:
            pairs.append((name, settings))
    kw = {
        "bandwidth": bandwidth,
        "compute_seconds": compute_seconds,
        "ranks": ranks,
        "shard": shard,
        "optimizer": optimizer,
        "param_dtype": param_dtype,
        "outer_state": outer_state,
        "accelerator": accelerator,
        "link_inside": link_inside,
        "link_between": link_between,
        "units": units,
        "gather_dtype": gather_dtype,
        "reduce_dtype": reduce_dtype,
        "reshard_after_forward": reshard_after_forward,
        "memory_overhead": memory_overhead,
        "empty_init": empty_init,
        "device_memory": parse_size(device_memory) if device_memory is not None else None,
        "activations": activations,
        "process_bytes": process_bytes,
    }
    out = [
        predict(name, s, model, tokens_per_rank=tokens_per_rank, sampled_rows=sampled_rows, **kw) for name, s in pairs
    ]
    return sorted(out, key=lambda c: ranking(c, sharded=shard is not None))


def ranking(c: Candidate, sharded: bool = False) -> tuple[float, ...]:
    """The order candidates are shown in: fastest first, fewer bytes on ties; ``sharded``: by the sharded
    layout's figures (its step, then its bytes between the groups), a scheme that does not run sharded
    after every one that does."""
    if sharded:
        s = c.sharded
        if s is None:
            return (1, c.step_seconds, c.bytes_per_step, SCHEMES.index(c.scheme))
        return (0, s.step_seconds, s.between_bytes, SCHEMES.index(c.scheme))
    return (0, c.step_seconds, c.bytes_per_step, SCHEMES.index(c.scheme))


def departure(c: Candidate) -> tuple[int, int, int, float]:
    """How far a candidate's optimisation is from synchronous SGD, for :func:`recommend`: exact
    first, then per-step gradient approximations (more bits first), then periodic schemes
    (shorter periods first, then more bits per synced value: ``sparseloco``'s bits count for the
    share of values it sends, 2 x 64 / 4096 by default; the dense statistical codec, 2 bits by default, after
    the uniform pseudo-gradients of the same period at any bits). ``zero_one_adam`` with local steps
    (``local_step_clipper`` > 1) ranks with the periodic schemes at that period: its steady state is
    a round every ``local_step_clipper`` steps."""
    if not c.changes_optimisation:
        return (0, 0, 0, 0)
    if c.scheme == "zero_one_adam" and c.settings.get("local_step_clipper", 16) > 1:
        return (2, c.settings.get("local_step_clipper", 16), 0, -c.settings.get("num_quantization_bits", 1))
    if c.scheme in PERIODIC:
        statistical = c.settings.get("pseudo_grad_codec") == "statistical"
        default = 2 if statistical else {"streaming_diloco": 4, "sparseloco": 2}.get(c.scheme, 32)
        bits: float = c.settings.get("pseudo_grad_bits", default)
        if c.scheme == "sparseloco":
            bits *= c.settings.get("topk_per_chunk", 64) / c.settings.get("topk_chunk", 4096)
        # the dense statistical codec after the uniform one at any bits: measured (lstm_demo, 576 steps) at
        # +11.6% in 2 bits against diloco's uniform 2-bit +1.1% and 4-bit +0.09% (benchmarks/results/sparseloco)
        return (2, c.settings["sync_period"], int(statistical), -bits)
    return (1, 0, 0, -c.settings.get("num_quantization_bits", 32))


def recommend(candidates: Sequence[Candidate], tolerance: float = 0.05, sharded: bool = False) -> Candidate:
    """The candidate to start from: among those whose predicted step is within ``tolerance`` (a
    fraction) of the fastest, the one that departs least from synchronous SGD (:func:`departure`).

    ``sharded``: the sharded layout's steps (:attr:`Candidate.sharded`) instead of the unsharded ones,
    among the candidates that run sharded. A candidate whose peak memory does not fit its
    ``device_memory`` in that layout is left out.

    A heuristic: a few percent of step time rarely pays for a change of optimisation whose quality
    cost is unknown; beyond that the fastest is proposed, with its note saying what to check.

    Raises:
        ValueError: no candidate (in that layout), or none fits: the message says the smallest peak.
    """
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    laid = [c for c in candidates if c.sharded is not None] if sharded else list(candidates)
    if not laid:
        raise ValueError("candidates is empty: nothing to recommend" + (" sharded" if sharded else ""))
    fitting = [c for c in laid if c.fits(sharded) is not False]
    if not fitting:
        least = min(laid, key=lambda c: c.over(sharded) or 0)
        peak = least.sharded_peak if sharded else least.peak
        raise ValueError(
            f"no candidate fits device_memory={readable(least.device_memory or 0)} per rank"
            f"{' sharded' if sharded else ''}: the smallest peak is {readable(peak or 0)} ({least.label})"
        )

    def step(c: Candidate) -> float:
        return c.sharded.step_seconds if sharded and c.sharded else c.step_seconds

    best = min(step(c) for c in fitting)
    close = [c for c in fitting if step(c) <= best * (1 + tolerance)]
    return min(close, key=lambda c: (departure(c), step(c)))


def mib(nbytes: float) -> str:
    """Bytes as MiB with 4 significant digits (``"0"`` for none, ``"<0.001"`` for a few bytes: Adam's
    step counts on the host of a GPU run)."""
    if not nbytes:
        return "0"
    return f"{nbytes / 2**20:.4g}" if nbytes >= 2**20 / 1000 else "<0.001"


def readable(nbytes: float) -> str:
    """Bytes as a person reads them: ``"0"``, ``"512 B"``, ``"12.5 KiB"``, ``"850 MiB"``, ``"1.2 GiB"``,
    ``"80 GiB"`` (3 significant digits, whole numbers from 1000 up; powers of 1024)."""
    if not nbytes:
        return "0"
    sign, value = ("-" if nbytes < 0 else ""), abs(float(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    shown = f"{value:.0f}" if value >= 1000 or unit == "B" else f"{value:.3g}"
    return f"{sign}{shown} {unit}"


def _fit(c: Candidate, sharded: bool) -> str:
    peak, over = (c.sharded_peak if sharded else c.peak), c.over(sharded)
    if peak is None:
        return "n/a"
    if over is None:
        return readable(peak)
    return f"{readable(peak)}, fits" if over <= 0 else f"{readable(peak)}: **{readable(over)} over**"


def table(candidates: Sequence[Candidate], top: int | None = None, shard: int | None = None) -> str:
    """The candidates as a markdown table (in the given order), with each one's speed-up over
    ``allreduce`` when ``allreduce`` is among them, and the device and host memory per rank
    (:attr:`Candidate.memory`, as :func:`readable` prints it); with ``shard``, also the layout with
    ``shard="fsdp"`` over groups of that many ranks: its step, FSDP2's traffic inside the group and the
    scheme's across the groups, each on its own link, and its memory (``n/a`` for a scheme that does not
    run sharded). When the candidates carry a ``device_memory``, each layout's peak per rank against it."""
    ref = next((c.step_seconds for c in candidates if c.scheme == "allreduce"), None)
    device_memory = next((c.device_memory for c in candidates if c.device_memory is not None), None)
    head = "| # | scheme | settings | predicted s/step | comm s/step (wire) | MB/step/rank | vs allreduce |"
    head += " device/rank | host/rank |"
    if device_memory is not None:
        head += f" peak/rank vs {readable(device_memory)} |"
    if shard:
        head += (
            f" s/step, shard {shard} | in-group s/step (MB/rank) | cross-group s/step (MB/rank) |"
            f" device/rank, shard {shard} | host/rank, shard {shard} |"
        )
        if device_memory is not None:
            head += f" peak/rank vs {readable(device_memory)}, shard {shard} |"
    head += " note |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, c in enumerate(candidates[:top] if top else candidates, 1):
        shown = ", ".join(f"{k}={v}" for k, v in c.settings.items() if k != "sync_period_unit") or "-"
        speedup = f"{ref / c.step_seconds:.2f}x" if ref and c.step_seconds > 0 else "-"
        memory = f" {readable(c.memory.device)} | {readable(c.memory.host)} |" if c.memory else " - | - |"
        if device_memory is not None:
            memory += f" {_fit(c, False)} |"
        if shard:
            m, s = c.sharded_memory, c.sharded
            if s is not None:
                memory += (
                    f" {s.step_seconds:.4g} | {s.inside_seconds:.4g} ({s.inside_bytes / 1e6:.4g}) |"
                    f" {s.between_seconds:.4g} ({s.between_bytes / 1e6:.4g}) |"
                )
            else:
                memory += " n/a | n/a | n/a |"
            memory += f" {readable(m.device)} | {readable(m.host)} |" if m else " n/a | n/a |"
            if device_memory is not None:
                memory += f" {_fit(c, True)} |"
        lines.append(
            f"| {i} | {c.scheme} | {shown} | {c.step_seconds:.4g} | {c.comm_seconds:.4g} |"
            f" {c.bytes_per_step / 1e6:.4g} | {speedup} |{memory} {c.note} |"
        )
    return "\n".join(lines)
