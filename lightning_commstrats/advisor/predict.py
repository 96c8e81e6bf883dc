"""One scheme at one setting: its predicted step time, bytes and memory (:func:`predict`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from lightning_commstrats import cost_model
from lightning_commstrats.advisor.fsdp import FsdpUnits, check_units, fsdp_traffic, fsdp_units, units_by_size
from lightning_commstrats.advisor.inputs import (
    SHARDABLE,
    accepts_old_names,
    check_inputs,
    check_shard,
    checked_settings,
    int_setting,
    model_shape,
    parse_size,
    resolve_links,
)
from lightning_commstrats.advisor.memory import Memory, _local_shape, memory_per_rank
from lightning_commstrats.advisor.names import PARAM_DTYPES
from lightning_commstrats.advisor.peak import Peak, check_bytes, check_overhead, peak_phases
from lightning_commstrats.advisor.schedule import gathered_exchange_bytes, schedule_of, sparse_exchange_bytes
from lightning_commstrats.comm import wire
from lightning_commstrats.compression.density import StatisticalAllGather
from lightning_commstrats.compression.exchange import EXCHANGE_BITS
from lightning_commstrats.compression.rows import resolve_count
from lightning_commstrats.cost_model import ModelShape
from lightning_commstrats.strategies.fragments import fragment_bounds


@dataclass(frozen=True)
class Sharded:
    """The sharded layout's step (``shard="fsdp"`` over groups of ``group`` ranks), each link's part apart.

    Attributes:
        group: the ranks of a group (FSDP2 shards over them).
        step_seconds: predicted seconds per optimizer step: compute, FSDP2's in-group traffic (not
            hidden: an upper bound) and the cross-group exchange not hidden behind them.
        inside_seconds, inside_bytes: FSDP2's traffic inside the group per step, on the link inside
            (:func:`~lightning_commstrats.advisor.fsdp_traffic`).
        between_seconds, between_bytes: the scheme's exchange of this rank's shards with the same shards of
            the other groups per step (a periodic exchange spread over its period), on the link between.
        note: what to know before picking it in this layout: its stall, when the exchange between the
            groups is not all hidden, is this layout's (the unsharded one's is in :attr:`Candidate.note`).
    """

    group: int
    step_seconds: float
    inside_seconds: float
    inside_bytes: float
    between_seconds: float
    between_bytes: float
    note: str = ""


@dataclass(frozen=True)
class Candidate:
    """One scheme at one setting, with what the cost model predicts for it.

    Attributes:
        scheme: the strategy's registry name (``Trainer(strategy=scheme)``).
        settings: the strategy's constructor arguments that the prediction assumed
            (:meth:`strategy` builds it with them).
        comm_seconds: seconds per step on the wire (a periodic exchange spread over its period).
        step_seconds: predicted seconds per optimizer step: compute plus the communication that
            is not hidden behind it.
        bytes_per_step: bytes one rank sends per step (a periodic exchange spread over its period).
        changes_optimisation: whether the scheme trains differently from synchronous SGD.
        note: what to know before picking it.
        memory: the bytes one rank holds (:func:`memory_per_rank`), every rank holding the whole model.
        sharded_memory: the same with ``shard="fsdp"`` over groups of ``shard`` ranks, when asked and
            the scheme runs sharded (else ``None``).
        sharded: that layout's step, its in-group and cross-group traffic each on its own link (else ``None``).
        peak, sharded_peak: the most memory a rank reaches on the device it trains on, each layout, in
            bytes (:attr:`Peak.total <lightning_commstrats.advisor.Peak.total>`).
        peak_parts, sharded_peak_parts: what makes each (:class:`~lightning_commstrats.advisor.Peak`: the
            tensors held, each phase of a step on top of them, the allocator's factor, the process's growth).
        device_memory: the memory a rank's device has, when given: :meth:`over` says by how much a layout
            exceeds it.
    """

    scheme: str
    settings: dict[str, Any]
    comm_seconds: float
    step_seconds: float
    bytes_per_step: float
    changes_optimisation: bool
    note: str
    memory: Memory | None = None
    sharded_memory: Memory | None = None
    sharded: Sharded | None = None
    peak: int | None = None
    sharded_peak: int | None = None
    device_memory: int | None = None
    peak_parts: Peak | None = None
    sharded_peak_parts: Peak | None = None

    def over(self, sharded: bool = False) -> int | None:
        """Bytes by which a layout's peak exceeds ``device_memory`` (0 or less: it fits; ``None``: no
        device memory given, or no such layout)."""
        peak = self.sharded_peak if sharded else self.peak
        if self.device_memory is None or peak is None:
            return None
        return peak - self.device_memory

    def fits(self, sharded: bool = False) -> bool | None:
        """Whether a layout's peak fits ``device_memory`` (``None`` when unknown)."""
        over = self.over(sharded)
        return None if over is None else over <= 0

    def strategy(self, **kwargs: Any) -> Any:
        """A new strategy instance of this scheme with these settings (``kwargs`` add more)."""
        from lightning_commstrats.strategies import STRATEGIES

        cls = next(c for c in STRATEGIES if c.strategy_name == self.scheme)
        return cls(**self.settings, **kwargs)

    @property
    def label(self) -> str:
        """``scheme`` with its settings, e.g. ``diloco(sync_period=32, pseudo_grad_bits=4)``."""
        shown = {k: v for k, v in self.settings.items() if k != "sync_period_unit"}
        return f"{self.scheme}({', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else self.scheme


def zipf_probabilities(vocab_size: int) -> list[float]:
    """Word probabilities by frequency rank under Zipf's law with exponent 1: ``p_r ~ 1 / r``."""
    harmonic = math.fsum(1.0 / r for r in range(1, vocab_size + 1))
    return [1.0 / (r * harmonic) for r in range(1, vocab_size + 1)]


def expected_distinct(vocab_size: int, tokens: int) -> float:
    """Expected distinct words among ``tokens`` independent Zipf-distributed tokens."""
    return math.fsum(-math.expm1(tokens * math.log1p(-p)) for p in zipf_probabilities(vocab_size))


def expected_sampled_rows(vocab_size: int, alpha: int, beta: int, tokens: int) -> float:
    """Expected rows ``sampled_vocab`` exchanges per step: the ``alpha`` most frequent words, plus
    each other word that is among the ``beta`` random ones or in one of the step's ``tokens``
    (all ranks), with Zipf-distributed tokens (see :func:`zipf_probabilities`).

    An estimate: a corpus is only roughly Zipfian. On Brown (10k words, 2 ranks x 32 windows of
    36 tokens, alpha 2000, beta 1000) it gives 3131 rows; the measured bytes say about 3070
    (``benchmarks/results/sampled_vocab/vocab_sweep.md``). Pass ``sampled_rows`` to
    :func:`advise` when the rows were measured (``SampledVocabStrategy.last_rows``).
    """
    miss_beta = 1.0 - beta / vocab_size
    probs = zipf_probabilities(vocab_size)[alpha:]
    return alpha + math.fsum(1.0 - miss_beta * math.exp(tokens * math.log1p(-p)) for p in probs)


@accepts_old_names("bandwidth_bits", "link_inside_bits", "link_between_bits", "overhead")
def predict(
    scheme: str,
    settings: Mapping[str, Any] | None,
    model: ModelShape | Any,
    *,
    bandwidth: float | None = None,
    compute_seconds: float,
    ranks: int,
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
    activations: int | str = 0,
    process_bytes: int | None = None,
) -> Candidate:
    """The predicted step of ``scheme`` at ``settings`` (its constructor arguments; missing ones
    take the strategy's defaults, except ``sync_period``, which periodic schemes need) for
    ``model`` (a :class:`~lightning_commstrats.cost_model.ModelShape`, or what :func:`model_shape`
    takes), with the memory each rank holds (:func:`memory_per_rank`).

    ``tokens_per_rank`` (token ids in one rank's minibatch) and ``sampled_rows`` (rows exchanged per
    step, when measured) only matter for ``sampled_vocab``; see :func:`expected_sampled_rows`.
    ``optimizer``, ``param_dtype``, ``outer_state``, ``accelerator``: see :func:`memory_per_rank`.

    The links, Mbit/s a rank sends at (the command's ``--link-inside``, ``--link-between``,
    ``--bandwidth``; with every rank of its group sending at once: where a group's ranks share one network
    card to the other groups, each gets its share): ``link_inside`` inside a group, ``link_between``
    between groups; ``bandwidth`` is both where one is not given. The old names ``bandwidth_bits``,
    ``link_inside_bits``, ``link_between_bits`` (bits per second) and ``overhead`` are accepted for one
    more release, with a ``DeprecationWarning``. The unsharded layout (:attr:`Candidate.step_seconds`) runs
    its exchange over every rank, at the slower link when the ranks span several groups (see
    :func:`~lightning_commstrats.advisor.inputs.resolve_links`).

    ``shard``: also the sharded layout, ``shard="fsdp"`` over groups of this many ranks
    (:attr:`Candidate.sharded`, :attr:`Candidate.sharded_memory`): FSDP2's traffic inside the group
    (:func:`~lightning_commstrats.advisor.fsdp_traffic` of ``units``, in ``gather_dtype`` and
    ``reduce_dtype``, default ``param_dtype``, with ``reshard_after_forward``) on the link inside, and
    the scheme's exchange of the rank's shards over the ``ranks / shard`` groups on the link between.
    ``units``: which tensors each FSDP2 unit holds; default: the package's default
    :class:`~lightning_commstrats.sharding.ShardPolicy` of ``model`` when it is a module, else a guess
    from the shapes (:func:`~lightning_commstrats.advisor.units_by_size`).

    Memory peak (:attr:`Candidate.peak`, :attr:`Candidate.sharded_peak`, with their parts in
    :attr:`Candidate.peak_parts` and :attr:`Candidate.sharded_peak_parts`): the tensors held between steps
    plus the largest phase of a step on top of them (:func:`~lightning_commstrats.advisor.peak_phases`:
    ``activations``, the bytes (or a size such as ``"3GiB"``) a rank's forward keeps for its backward, from
    :func:`~lightning_commstrats.advisor.activation_bytes`, 0 leaving them out; FSDP2's gathers in the
    sharded layout; the optimizer's temporaries; a sync's buffers in flight), times ``memory_overhead`` (the
    allocator's factor: default 1.0 on a CPU host, 1.10 on a GPU, measured), plus ``process_bytes`` (the
    process's own growth: default 37 MiB on a CPU host, 0 on a GPU, measured); and, unless ``empty_init``
    (the model built on the meta device, only shards materialised), at least the whole model built on every
    rank before it is sharded. ``device_memory`` (bytes, or a size such as ``"80GiB"``): the memory to fit
    above what the process holds before the model is built (a CPU host: the interpreter and libraries,
    270 MiB in ``benchmarks/results/fit_limit``; a GPU: the CUDA context and the communication's buffers).

    Raises:
        ValueError: for an unknown scheme, a setting the scheme does not take or an unsupported
            value, a period in samples (the advisor counts steps), ``sampled_vocab`` on a model
            without a vocabulary, a link that is missing or not a rate > 0, ``link_inside``
            without ``shard``, a bad ``device_memory``, ``memory_overhead``, ``activations``, ``process_bytes``
            or dtype, or a memory option :func:`memory_per_rank` refuses.
    """
    if shard is not None:
        check_shard(shard, ranks)
    flat, inside, between = resolve_links(bandwidth, link_inside, link_between, ranks, shard)
    check_inputs(flat, compute_seconds, ranks)
    module = model if not isinstance(model, ModelShape) and hasattr(model, "named_modules") else None
    if not isinstance(model, ModelShape):
        model = model_shape(model)
    settings = checked_settings(scheme, settings)
    if device_memory is not None:
        device_memory = parse_size(device_memory)
    gather_width, reduce_width = (
        _width(name, value or param_dtype)
        for name, value in (("gather_dtype", gather_dtype), ("reduce_dtype", reduce_dtype))
    )
    if not isinstance(empty_init, bool):
        raise ValueError(f"empty_init must be True or False, got {empty_init!r}")
    if memory_overhead is not None:
        check_overhead(memory_overhead, "memory_overhead")
    if isinstance(activations, str):
        activations = parse_size(activations, "activations")
    check_bytes("activations", activations)
    if process_bytes is not None:
        check_bytes("process_bytes", process_bytes)
    found = _predict_step(scheme, settings, model, flat, compute_seconds, ranks, tokens_per_rank, sampled_rows)
    options = {
        "ranks": ranks,
        "optimizer": optimizer,
        "param_dtype": param_dtype,
        "outer_state": outer_state,
        "accelerator": accelerator,
    }
    memory = memory_per_rank(scheme, settings, model, **options)
    peaks = {
        "ranks": ranks,
        "optimizer": optimizer,
        "param_width": PARAM_DTYPES[param_dtype],
        "outer_state": outer_state,
        "activations": activations,
        "overhead": memory_overhead,
        "process": process_bytes,
    }
    parts = peak_phases(scheme, settings, model.shapes, memory, **peaks)
    out = replace(found, memory=memory, peak=parts.total, peak_parts=parts, device_memory=device_memory)
    if shard is None or scheme not in SHARDABLE:
        return out
    if units is None:
        units = fsdp_units(module) if module is not None else units_by_size(model.shapes)
    check_units(units, len(model.shapes))
    fsdp = {"gather_bytes": gather_width, "reduce_bytes": reduce_width, "reshard_after_forward": reshard_after_forward}
    traffic = fsdp_traffic(model.shapes, units, shard, **fsdp)
    inside_s = cost_model.seconds(traffic.total, inside)
    local = ModelShape(tuple(_local_shape(s, shard) for s in model.shapes))
    across = _predict_step(
        scheme, settings, local, between, compute_seconds + inside_s, ranks // shard, tokens_per_rank, sampled_rows
    )
    sharded = Sharded(
        shard, across.step_seconds, inside_s, traffic.total, across.comm_seconds, across.bytes_per_step, across.note
    )
    sharded_memory = memory_per_rank(scheme, settings, model, shard=shard, **options)
    built = 0 if empty_init else model.numel * PARAM_DTYPES[param_dtype]
    gathers = {"units": units, "gather_bytes": gather_width, "reduce_bytes": reduce_width}
    rest = {"reshard_after_forward": reshard_after_forward, "built": built}
    parts = peak_phases(scheme, settings, model.shapes, sharded_memory, **gathers, **rest, **peaks)
    return replace(
        out,
        sharded_memory=sharded_memory,
        sharded=sharded,
        sharded_peak=parts.total,
        sharded_peak_parts=parts,
    )


def _width(name: str, dtype: str) -> int:
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"{name}={dtype!r} is not supported; choose one of {tuple(PARAM_DTYPES)}")
    return PARAM_DTYPES[dtype]


def _predict_step(
    scheme: str,
    settings: dict[str, Any],
    model: ModelShape,
    bits_per_second: float,
    compute_seconds: float,
    ranks: int,
    tokens_per_rank: int,
    sampled_rows: float | None,
) -> Candidate:
    n, bw = ranks, bits_per_second
    small = int_setting(settings, "small_tensor_numel", 1024)
    if small < 0:
        raise ValueError(f"settings: small_tensor_numel must be an int >= 0, got {small}")
    if scheme == "allreduce":
        nbytes = wire.all_reduce_bytes(model.numel, 4, n)
        wire_s = cost_model.seconds(nbytes, bw)
        return Candidate(
            scheme, settings, wire_s, compute_seconds + wire_s, nbytes, False, "synchronous SGD: the reference"
        )
    if scheme == "onebit_sgd":
        bits = int_setting(settings, "num_quantization_bits", 1, EXCHANGE_BITS)
        nbytes = cost_model.exchange_bytes(model.shapes, n, bits, small_tensor_numel=small)
        wire_s = cost_model.seconds(nbytes, bw)
        note = f"{bits}-bit gradients with error feedback (a warm start in fp32 helps): quality must be checked"
        return Candidate(scheme, settings, wire_s, compute_seconds + wire_s, nbytes, bits < 32, note)
    if scheme == "onebit_adam":  # past its fp32 warm-up: the momentum travels as onebit_sgd's gradients do
        bits = int_setting(settings, "num_quantization_bits", 1, EXCHANGE_BITS)
        freeze = int_setting(settings, "freeze_step", 400)
        nbytes = cost_model.exchange_bytes(model.shapes, n, bits, small_tensor_numel=small)
        wire_s = cost_model.seconds(nbytes, bw)
        note = (
            f"Adam's variance frozen after {freeze} fp32 steps, then {bits}-bit momentum with error feedback"
            " (Adam or AdamW only): quality must be checked"
        )
        return Candidate(scheme, settings, wire_s, compute_seconds + wire_s, nbytes, True, note)
    if scheme == "zero_one_adam":  # its steady state: a 1-bit round every local_step_clipper steps
        bits = int_setting(settings, "num_quantization_bits", 1, EXCHANGE_BITS)
        freeze = int_setting(settings, "var_freeze_step", 400)
        every = int_setting(settings, "local_step_clipper", 16)
        if every < 1:
            raise ValueError(f"settings: local_step_clipper must be an int >= 1, got {every}")
        nbytes = cost_model.exchange_bytes(model.shapes, n, bits, small_tensor_numel=small) / every
        wire_s = cost_model.seconds(nbytes, bw)
        note = (
            f"after step {freeze} (before it, fp32 rounds on the variance's doubling schedule and {bits}-bit ones"
            f" between): a {bits}-bit round of the momentum every {every} steps, local steps between (Adam or"
            " AdamW only): quality must be checked"
        )
        return Candidate(scheme, settings, wire_s, compute_seconds + wire_s, nbytes, True, note)
    if scheme == "sampled_vocab":
        return _sampled_vocab(settings, model, bw, compute_seconds, n, tokens_per_rank, sampled_rows)
    return _periodic(scheme, settings, model, bw, compute_seconds, n, small)


def _sampled_vocab(
    settings: dict[str, Any],
    model: ModelShape,
    bw: float,
    compute: float,
    n: int,
    tokens_per_rank: int,
    sampled_rows: float | None,
) -> Candidate:
    v = model.vocab_size
    if not v or not model.vocab_width:
        raise ValueError("sampled_vocab needs the model's vocab_size and vocab_width (no vocabulary is known)")
    if int_setting(settings, "num_quantization_bits", 32) != 32:
        raise ValueError("settings: the advisor predicts sampled_vocab with num_quantization_bits=32 only")
    alpha = resolve_count(settings.get("alpha", 2000), v, "alpha")
    beta = resolve_count(settings.get("beta", 1000), v, "beta")
    if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int) or tokens_per_rank < 0:
        raise ValueError(f"tokens_per_rank must be an int >= 0, got {tokens_per_rank!r}")
    if sampled_rows is not None:
        if not 0 <= sampled_rows <= v:
            raise ValueError(f"sampled_rows must be in [0, vocab_size={v}], got {sampled_rows!r}")
        rows, how = sampled_rows, f"{sampled_rows:.0f} rows a step (given)"
    else:
        rows = expected_sampled_rows(v, alpha, beta, n * tokens_per_rank)
        how = f"about {rows:.0f} of {v} rows a step (Zipf estimate"
        how += (
            f", {tokens_per_rank} tokens a rank)"
            if tokens_per_rank
            else "; the minibatch words not counted: a low estimate)"
        )
    ids = expected_distinct(v, tokens_per_rank) if tokens_per_rank else 0.0
    rest = model.numel - v * model.vocab_width
    nbytes = (
        wire.all_reduce_bytes(math.ceil(rows * model.vocab_width), 4, n)
        + wire.all_reduce_bytes(rest, 4, n)
        + wire.all_gather_bytes(1, 8, n)
        + wire.all_gather_bytes(math.ceil(ids), 4, n)
    )
    wire_s = cost_model.seconds(nbytes, bw)
    note = f"{how}; unselected output rows skip the step: quality must be checked"
    return Candidate("sampled_vocab", settings, wire_s, compute + wire_s, nbytes, True, note)


def _periodic(
    scheme: str, settings: dict[str, Any], model: ModelShape, bw: float, compute: float, n: int, small: int
) -> Candidate:
    sched = schedule_of(scheme, settings, len(model.shapes))
    period, bits, fragments, delay = sched.period, sched.bits, sched.fragments, sched.delay
    bounds = fragment_bounds([math.prod(s) for s in model.shapes], fragments)
    if sched.sparse is not None:
        per_sync = [sparse_exchange_bytes(model.shapes[i0:i1], n, sched.sparse, small) for i0, i1 in bounds]
    elif sched.gather is not None:
        per_sync = [gathered_exchange_bytes(model.shapes[i0:i1], n, sched.gather, sched.small) for i0, i1 in bounds]
    else:
        per_sync = [
            cost_model.exchange_bytes(model.shapes[i0:i1], n, bits, by_rows=sched.by_rows, small_tensor_numel=small)
            for i0, i1 in bounds
        ]
    wire_s = math.fsum(cost_model.seconds(b, bw) for b in per_sync) / period
    # a fragment's exchange runs behind `delay` inner steps; only what is left of it stalls training
    stall = math.fsum(max(0.0, cost_model.seconds(b, bw) - delay * compute) for b in per_sync) / period
    if scheme == "bmuf":
        what = "block momentum on the averaged model"
    elif scheme == "diloco":
        what = "an outer Nesterov step"
    elif scheme in ("streaming_diloco", "sparseloco"):
        plural = "s" if fragments > 1 else ""
        what = f"{fragments} fragment{plural}, each exchange behind {delay} inner step{'s' if delay != 1 else ''}"
        if stall > 0:
            what += f" (not all hidden: {stall * period:.3g} s of stall a period)"
    else:
        what = "the models averaged" + (" (MPI only)" if scheme == "local_sgd" else "")
    note = f"{period} local steps between syncs, {what}"
    if sched.sparse is not None:
        codec = sched.sparse
        note += f", top {codec.k} of {codec.chunk} values in {bits} bits with error feedback"
    elif isinstance(sched.gather, StatisticalAllGather):
        note += f", every value in {bits} bits on a statistical grid with error feedback"
    elif sched.gather is not None:
        tile = sched.gather.tile
        note += f", top {sched.gather.k} per tile of {tile} x {tile} in {bits} bits with error feedback"
        if settings.get("topk_schedule") is not None:
            note += f" (denser at the first syncs: topk_schedule={settings['topk_schedule']!r}, not counted here)"
    elif bits < 32:
        note += f", {bits}-bit pseudo-gradients"
    note += ": changes the optimisation, quality must be checked"
    return Candidate(scheme, settings, wire_s, compute + stall, sum(per_sync) / period, True, note)
