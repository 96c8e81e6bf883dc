"""Which scheme to train with: every candidate's predicted step time from the cost model, ranked.

Given a model (or its parameter shapes), the link rate between the ranks, the measured compute
time of one training step (one rank, no communication) and the number of ranks,
:func:`advise` predicts the seconds per optimizer step of each candidate scheme and setting
(period, bits, sampled rows) and returns them fastest first; ``commstrats-advise`` prints them as
a markdown table::

    commstrats-advise --config lstm_demo --bandwidth 100 --compute-seconds 0.63 --ranks 4
    commstrats-advise --shapes shapes.json --bandwidth 1000 --compute-seconds 0.2 --ranks 8 \\
        --schemes diloco streaming_diloco

The step time is ``compute + communication``: this package's strategies do not overlap their
collectives with compute, except ``streaming_diloco``, whose fragment exchanges run in the
background for ``fragment_sync_delay`` inner steps and only stall training for what is left of
them. Communication seconds are bytes over the link rate (:mod:`lightning_commstrats.cost_model`:
the bytes the strategies put on the wire, no latency, the link the only bottleneck).

What it does not know: a scheme's own compute (quantizing, selecting rows, the outer step), the
link's protocol overhead, latency, and above all quality. A periodic or compressed scheme that
steps faster is not equally good per step: every candidate whose optimisation differs from
synchronous SGD says so in its note, and its quality must be checked (``benchmarks/compare.py``
races them to a target perplexity). :func:`recommend` therefore prefers, among the candidates
within a tolerance of the fastest, the one that departs least from synchronous SGD.

To measure the link between running ranks, :func:`measure_bandwidth` times an all-reduce of a
known size on the ranks' :class:`~lightning_commstrats.comm.Communicator`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_commstrats import cost_model
from lightning_commstrats.comm import Communicator, wire
from lightning_commstrats.compression.exchange import EXCHANGE_BITS
from lightning_commstrats.compression.rows import resolve_count
from lightning_commstrats.cost_model import ModelShape
from lightning_commstrats.models.base import declared_vocabulary
from lightning_commstrats.strategies.periodic import PSEUDO_GRAD_BITS, fragment_bounds

SCHEMES = (
    "allreduce",
    "onebit_sgd",
    "sampled_vocab",
    "model_averaging",
    "bmuf",
    "local_sgd",
    "diloco",
    "streaming_diloco",
)
PERIODIC = ("model_averaging", "bmuf", "local_sgd", "diloco", "streaming_diloco")
# The default grid: what a first look should cover.
ONEBIT_BITS = (1, 2, 4, 8)
AVERAGING_PERIODS = (4, 8, 16, 32)
DILOCO_PERIODS = (8, 16, 32, 64)
DILOCO_BITS = (32, 8, 4, 2)
STREAMING_BITS = (8, 4, 2)
STREAMING_FRAGMENTS = 4
SAMPLED_VOCAB = {"alpha": 0.2, "beta": 0.1}  # the race's setting: 20% frequent words, 10% random ones
# The settings each scheme's prediction reads (a subset of the strategy's constructor arguments).
SETTINGS = {
    "allreduce": (),
    "onebit_sgd": ("num_quantization_bits", "small_tensor_numel"),
    "sampled_vocab": ("alpha", "beta", "num_quantization_bits"),
    "model_averaging": (
        "sync_period",
        "sync_period_unit",
        "pseudo_grad_bits",
        "pseudo_grad_scales",
        "small_tensor_numel",
    ),
    "bmuf": ("sync_period", "sync_period_unit", "pseudo_grad_bits", "pseudo_grad_scales", "small_tensor_numel"),
    "local_sgd": ("sync_period", "pseudo_grad_bits", "pseudo_grad_scales", "small_tensor_numel"),
    "diloco": ("sync_period", "sync_period_unit", "pseudo_grad_bits", "pseudo_grad_scales", "small_tensor_numel"),
    "streaming_diloco": (
        "sync_period",
        "num_fragments",
        "fragment_sync_delay",
        "pseudo_grad_bits",
        "pseudo_grad_scales",
        "small_tensor_numel",
    ),
}


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
    """

    scheme: str
    settings: dict[str, Any]
    comm_seconds: float
    step_seconds: float
    bytes_per_step: float
    changes_optimisation: bool
    note: str

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


# ---------------------------------------------------------------------------------- inputs


def model_shape(model_or_shapes: Any, vocab_size: int = 0, vocab_width: int = 0) -> ModelShape:
    """A :class:`~lightning_commstrats.cost_model.ModelShape` from a module, a ``ModelShape`` or
    parameter shapes.

    For a module the vocabulary comes from its ``vocab_parameters()`` (this package's language
    models declare them; tied matrices once) unless ``vocab_size`` is given; the shapes are its
    trainable parameters in registration order (tied ones once). Given ``vocab_size`` and
    ``vocab_width`` override what the module or ``ModelShape`` says.
    """
    for name, value in (("vocab_size", vocab_size), ("vocab_width", vocab_width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if isinstance(model_or_shapes, ModelShape):
        shape = model_or_shapes
    elif isinstance(model_or_shapes, torch.nn.Module):
        shape = ModelShape.of(model_or_shapes, *vocabulary_of(model_or_shapes))
    else:
        try:
            shapes = tuple(tuple(int(d) for d in s) for s in model_or_shapes)
        except TypeError as err:
            raise ValueError(
                "model_or_shapes must be a torch.nn.Module, a ModelShape or a sequence of parameter shapes,"
                f" got {type(model_or_shapes).__name__}"
            ) from err
        shape = ModelShape(shapes)
    if any(d < 0 for s in shape.shapes for d in s):
        raise ValueError(f"model_or_shapes: parameter shapes must not have negative sizes, got {shape.shapes}")
    if shape.numel == 0:
        raise ValueError("model_or_shapes has no trainable parameters: there is nothing to communicate")
    size = vocab_size or shape.vocab_size
    width = vocab_width or shape.vocab_width
    if size * width > shape.numel:
        raise ValueError(
            f"vocab_size x vocab_width = {size} x {width} is more than the model's {shape.numel} parameters"
        )
    return ModelShape(shape.shapes, size, width)


def vocabulary_of(module: torch.nn.Module) -> tuple[int, int]:
    """(rows, values per row summed over the distinct matrices) of the vocabulary parameters a
    module declares with ``vocab_parameters()``; ``(0, 0)`` when none does."""
    unique = declared_vocabulary(module)
    if not unique:
        return 0, 0
    rows = unique[0].shape[0]
    return rows, sum(p.numel() // rows for p in unique)


def _check_inputs(bandwidth_bits: float, compute_seconds: float, ranks: int) -> None:
    if isinstance(bandwidth_bits, bool) or not isinstance(bandwidth_bits, (int, float)):
        raise ValueError(f"bandwidth_bits must be a number of bits per second > 0, got {bandwidth_bits!r}")
    if not (bandwidth_bits > 0 and math.isfinite(bandwidth_bits)):
        raise ValueError(f"bandwidth_bits must be a finite number of bits per second > 0, got {bandwidth_bits!r}")
    if isinstance(compute_seconds, bool) or not isinstance(compute_seconds, (int, float)):
        raise ValueError(f"compute_seconds must be a number of seconds >= 0, got {compute_seconds!r}")
    if not (compute_seconds >= 0 and math.isfinite(compute_seconds)):
        raise ValueError(f"compute_seconds must be a finite number of seconds >= 0, got {compute_seconds!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")


# ---------------------------------------------------------------------------------- sampled rows


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


# ---------------------------------------------------------------------------------- one prediction


def _int_setting(settings: Mapping[str, Any], name: str, default: int, allowed: Sequence[int] | None = None) -> int:
    value = settings.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"settings: {name} must be an int, got {value!r}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"settings: {name}={value!r} is not supported; choose one of {tuple(allowed)}")
    return value


def predict(
    scheme: str,
    settings: Mapping[str, Any] | None,
    model: ModelShape | Any,
    *,
    bandwidth_bits: float,
    compute_seconds: float,
    ranks: int,
    tokens_per_rank: int = 0,
    sampled_rows: float | None = None,
) -> Candidate:
    """The predicted step of ``scheme`` at ``settings`` (its constructor arguments; missing ones
    take the strategy's defaults, except ``sync_period``, which periodic schemes need) for
    ``model`` (a :class:`~lightning_commstrats.cost_model.ModelShape`, or what :func:`model_shape`
    takes).

    ``tokens_per_rank`` (token ids in one rank's minibatch) and ``sampled_rows`` (rows exchanged per
    step, when measured) only matter for ``sampled_vocab``; see :func:`expected_sampled_rows`.

    Raises:
        ValueError: for an unknown scheme, a setting the scheme does not take or an unsupported
            value, a period in samples (the advisor counts steps), or ``sampled_vocab`` on a model
            without a vocabulary.
    """
    _check_inputs(bandwidth_bits, compute_seconds, ranks)
    if not isinstance(model, ModelShape):
        model = model_shape(model)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not known to the advisor; choose one of {SCHEMES}")
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(SETTINGS[scheme]))
    if unknown:
        raise ValueError(f"settings {unknown} are not read by the advisor for {scheme}; it reads {SETTINGS[scheme]}")
    n, bw = ranks, bandwidth_bits
    small = _int_setting(settings, "small_tensor_numel", 1024)
    if small < 0:
        raise ValueError(f"settings: small_tensor_numel must be an int >= 0, got {small}")
    if scheme == "allreduce":
        nbytes = wire.all_reduce_bytes(model.numel, 4, n)
        wire_s = cost_model.seconds(nbytes, bw)
        return Candidate(
            scheme, settings, wire_s, compute_seconds + wire_s, nbytes, False, "synchronous SGD: the reference"
        )
    if scheme == "onebit_sgd":
        bits = _int_setting(settings, "num_quantization_bits", 1, EXCHANGE_BITS)
        nbytes = cost_model.exchange_bytes(model.shapes, n, bits, small_tensor_numel=small)
        wire_s = cost_model.seconds(nbytes, bw)
        note = f"{bits}-bit gradients with error feedback (a warm start in fp32 helps): quality must be checked"
        return Candidate(scheme, settings, wire_s, compute_seconds + wire_s, nbytes, bits < 32, note)
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
    if _int_setting(settings, "num_quantization_bits", 32) != 32:
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
    if "sync_period" not in settings:
        raise ValueError(f"settings: {scheme} needs sync_period (in optimizer steps)")
    period = _int_setting(settings, "sync_period", 0)
    if period < 1:
        raise ValueError(f"settings: sync_period must be an int >= 1 (optimizer steps), got {period!r}")
    unit = settings.get("sync_period_unit", "steps")
    if unit != "steps":
        raise ValueError(f"settings: the advisor counts periods in optimizer steps; sync_period_unit={unit!r}")
    default_bits = 4 if scheme == "streaming_diloco" else 32
    bits = _int_setting(settings, "pseudo_grad_bits", default_bits, PSEUDO_GRAD_BITS)
    scales = settings.get("pseudo_grad_scales", "rows")
    if scales not in ("rows", "columns"):
        raise ValueError(f"settings: pseudo_grad_scales={scales!r} is not supported; choose one of ('rows', 'columns')")
    by_rows = scales == "rows"
    fragments, delay = 1, 0
    if scheme == "streaming_diloco":
        fragments = _int_setting(settings, "num_fragments", STREAMING_FRAGMENTS)
        delay = _int_setting(settings, "fragment_sync_delay", 5)
        if not 1 <= fragments <= min(period, len(model.shapes)):
            raise ValueError(
                f"settings: num_fragments={fragments} must be in [1, min(sync_period, parameter tensors)]"
                f" = [1, {min(period, len(model.shapes))}]"
            )
        if delay < 0 or (delay and delay * fragments >= period):
            raise ValueError(
                f"settings: fragment_sync_delay={delay} must be >= 0 and < sync_period / num_fragments"
                f" = {period}/{fragments}"
            )
    bounds = fragment_bounds([math.prod(s) for s in model.shapes], fragments)
    per_sync = [
        cost_model.exchange_bytes(model.shapes[i0:i1], n, bits, by_rows=by_rows, small_tensor_numel=small)
        for i0, i1 in bounds
    ]
    wire_s = math.fsum(cost_model.seconds(b, bw) for b in per_sync) / period
    # a fragment's exchange runs behind `delay` inner steps; only what is left of it stalls training
    stall = math.fsum(max(0.0, cost_model.seconds(b, bw) - delay * compute) for b in per_sync) / period
    if scheme == "bmuf":
        what = "block momentum on the averaged model"
    elif scheme == "diloco":
        what = "an outer Nesterov step"
    elif scheme == "streaming_diloco":
        what = f"{fragments} fragments, each exchange behind {delay} inner steps"
        if stall > 0:
            what += f" (not all hidden: {stall * period:.3g} s of stall a period)"
    else:
        what = "the models averaged" + (" (MPI only)" if scheme == "local_sgd" else "")
    note = f"{period} local steps between syncs, {what}"
    note += f", {bits}-bit pseudo-gradients" if bits < 32 else ""
    note += ": changes the optimisation, quality must be checked"
    return Candidate(scheme, settings, wire_s, compute + stall, sum(per_sync) / period, True, note)


# ---------------------------------------------------------------------------------- the grid


def default_settings(
    scheme: str, model: ModelShape, *, bandwidth_bits: float, compute_seconds: float, ranks: int
) -> list[dict[str, Any]]:
    """The settings tried for ``scheme`` when :func:`advise` is given its name alone.

    ``streaming_diloco`` gets, per period and bits, the smallest ``fragment_sync_delay`` that
    hides the largest fragment's exchange behind compute (at most what the period allows).
    """
    if scheme == "allreduce":
        return [{}]
    if scheme == "onebit_sgd":
        return [{"num_quantization_bits": b} for b in ONEBIT_BITS]
    if scheme == "sampled_vocab":
        return [dict(SAMPLED_VOCAB)]
    if scheme in ("model_averaging", "bmuf"):
        return [{"sync_period": h, "sync_period_unit": "steps"} for h in AVERAGING_PERIODS]
    if scheme == "local_sgd":
        return [{"sync_period": h} for h in AVERAGING_PERIODS]
    if scheme == "diloco":
        return [{"sync_period": h, "pseudo_grad_bits": b} for h in DILOCO_PERIODS for b in DILOCO_BITS]
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


def advise(
    model_or_shapes: Any,
    *,
    bandwidth_bits: float,
    compute_seconds: float,
    ranks: int,
    vocab_size: int = 0,
    vocab_width: int = 0,
    candidates: Iterable[str | tuple[str, Mapping[str, Any]]] | None = None,
    tokens_per_rank: int = 0,
    sampled_rows: float | None = None,
) -> list[Candidate]:
    """Every candidate's predicted step, fastest first.

    Args:
        model_or_shapes: a ``torch.nn.Module``, a :class:`~lightning_commstrats.cost_model.ModelShape`
            or the shapes of the trainable parameters (tied ones once, in registration order).
        bandwidth_bits: the link rate between ranks, bits per second in each direction.
        compute_seconds: seconds of one training step on one rank with no communication (measured,
            e.g. a one-rank run; with several ranks per machine, measured with all of them busy).
        ranks: the number of ranks.
        vocab_size, vocab_width: the vocabulary matrices' rows and values per row (for
            ``sampled_vocab``; a module's declared ``vocab_parameters()`` give them).
        candidates: scheme names (each tried at :func:`default_settings`) and/or
            ``(scheme, settings)`` pairs; default: every scheme but ``local_sgd`` (MPI only, the
            bytes of ``model_averaging``), and ``sampled_vocab`` only with a vocabulary.
        tokens_per_rank, sampled_rows: see :func:`predict`.

    Raises:
        ValueError: naming the argument: ``bandwidth_bits <= 0``, ``compute_seconds < 0``,
            ``ranks < 1``, an unknown scheme in ``candidates``, a model without parameters.
    """
    _check_inputs(bandwidth_bits, compute_seconds, ranks)
    model = model_shape(model_or_shapes, vocab_size, vocab_width)
    if candidates is None:
        vocab = model.vocab_size and model.vocab_width
        candidates = [s for s in SCHEMES if s != "local_sgd" and (vocab or s != "sampled_vocab")]
    elif isinstance(candidates, (str, bytes)):
        raise ValueError(f"candidates must be a list of scheme names or (scheme, settings) pairs, got {candidates!r}")
    pairs: list[tuple[str, Mapping[str, Any]]] = []
    for item in candidates:
        name, settings = (item, None) if isinstance(item, str) else tuple(item)
        if name not in SCHEMES:
            raise ValueError(f"candidates: unknown scheme {name!r}; choose from {SCHEMES}")
        if settings is None:
            grid = default_settings(
                name, model, bandwidth_bits=bandwidth_bits, compute_seconds=compute_seconds, ranks=ranks
            )
            pairs += [(name, s) for s in grid]
        else:
            pairs.append((name, settings))
    kw = {"bandwidth_bits": bandwidth_bits, "compute_seconds": compute_seconds, "ranks": ranks}
    out = [
        predict(name, s, model, tokens_per_rank=tokens_per_rank, sampled_rows=sampled_rows, **kw) for name, s in pairs
    ]
    return sorted(out, key=lambda c: (c.step_seconds, c.bytes_per_step, SCHEMES.index(c.scheme)))


def departure(c: Candidate) -> tuple[int, int, int]:
    """How far a candidate's optimisation is from synchronous SGD, for :func:`recommend`: exact
    first, then per-step gradient approximations (more bits first), then periodic schemes
    (shorter periods first, then more bits)."""
    if not c.changes_optimisation:
        return (0, 0, 0)
    if c.scheme in PERIODIC:
        bits = c.settings.get("pseudo_grad_bits", 4 if c.scheme == "streaming_diloco" else 32)
        return (2, c.settings["sync_period"], -bits)
    return (1, 0, -c.settings.get("num_quantization_bits", 32))


def recommend(candidates: Sequence[Candidate], tolerance: float = 0.05) -> Candidate:
    """The candidate to start from: among those whose predicted step is within ``tolerance`` (a
    fraction) of the fastest, the one that departs least from synchronous SGD (:func:`departure`).

    A heuristic: a few percent of step time rarely pays for a change of optimisation whose quality
    cost is unknown; beyond that the fastest is proposed, with its note saying what to check.
    """
    if not candidates:
        raise ValueError("candidates is empty: nothing to recommend")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    best = min(c.step_seconds for c in candidates)
    close = [c for c in candidates if c.step_seconds <= best * (1 + tolerance)]
    return min(close, key=lambda c: (departure(c), c.step_seconds))


def table(candidates: Sequence[Candidate], top: int | None = None) -> str:
    """The candidates as a markdown table (in the given order), with each one's speed-up over
    ``allreduce`` when ``allreduce`` is among them."""
    ref = next((c.step_seconds for c in candidates if c.scheme == "allreduce"), None)
    lines = [
        "| # | scheme | settings | predicted s/step | comm s/step (wire) | MB/step/rank | vs allreduce | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, c in enumerate(candidates[:top] if top else candidates, 1):
        shown = ", ".join(f"{k}={v}" for k, v in c.settings.items() if k != "sync_period_unit") or "-"
        speedup = f"{ref / c.step_seconds:.2f}x" if ref and c.step_seconds > 0 else "-"
        lines.append(
            f"| {i} | {c.scheme} | {shown} | {c.step_seconds:.4g} | {c.comm_seconds:.4g} |"
            f" {c.bytes_per_step / 1e6:.4g} | {speedup} | {c.note} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- measuring the link


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


# ---------------------------------------------------------------------------------- the command


def model_from_config(value: str) -> tuple[ModelShape, int]:
    """The parameter shapes of the model a training config describes (a packaged config's name or
    a YAML file), built on the meta device (no memory, no data), and the token ids in one rank's
    minibatch. The vocabulary is the config's ``data.max_vocab_size`` (the cap; a corpus with fewer
    distinct words gets a smaller one)."""
    import yaml

    from lightning_commstrats.cli import resolve_config
    from lightning_commstrats.data import LMDataModule
    from lightning_commstrats.models import LanguageModel

    path = Path(resolve_config(value))
    if not path.is_file():
        raise ValueError(f"--config: {value!r} is not a file or a packaged config")
    config = yaml.safe_load(path.read_text()) or {}
    model_args = dict(config.get("model") or {})
    data_defaults = {
        name: p.default for name, p in inspect.signature(LMDataModule.__init__).parameters.items() if name != "self"
    }
    data = {**data_defaults, **(config.get("data") or {})}
    model_args.update(vocab_size=data["max_vocab_size"], order=data["order"], max_seq_len=data["seq_len"])
    with torch.device("meta"):
        module = LanguageModel(**model_args)
    ngram = model_args.get("arch", "lstm") == "ffn"
    tokens = data["batch_size"] * (data["order"] if ngram else data["seq_len"] + 1)
    return model_shape(module.net), tokens


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


def main(argv: Sequence[str] | None = None) -> int:
    """``commstrats-advise``: print every candidate's predicted step as a markdown table."""
    parser = argparse.ArgumentParser(
        prog="commstrats-advise",
        description=(
            "Predict the seconds per training step of every communication scheme of lightning-commstrats"
            " for a model, link rate, compute time per step and number of ranks (the cost model: bytes over"
            " the link rate, no latency), fastest first. A faster periodic or compressed scheme trains"
            " differently: check its quality (benchmarks/compare.py)."
        ),
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--config", help="a training config: a packaged name (lstm_demo) or a YAML file")
    model.add_argument("--shapes", help="a JSON file: a list of parameter shapes, or {'shapes': [...], ...}")
    parser.add_argument("--bandwidth", type=float, required=True, help="link rate between ranks, Mbit/s")
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
    args = parser.parse_args(argv)
    if not (args.bandwidth > 0 and math.isfinite(args.bandwidth)):
        parser.error(f"--bandwidth must be a finite rate > 0 Mbit/s, got {args.bandwidth:g}")
    if not (args.compute_seconds >= 0 and math.isfinite(args.compute_seconds)):
        parser.error(f"--compute-seconds must be a finite number of seconds >= 0, got {args.compute_seconds:g}")
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    try:
        if args.config:
            shape, tokens = model_from_config(args.config)
        else:
            shape, tokens = model_from_json(args.shapes, args.vocab_size, args.vocab_width), 0
        if args.tokens_per_rank is not None:
            tokens = args.tokens_per_rank
        found = advise(
            shape,
            bandwidth_bits=args.bandwidth * 1e6,
            compute_seconds=args.compute_seconds,
            ranks=args.ranks,
            candidates=args.schemes,
            tokens_per_rank=tokens,
            sampled_rows=args.sampled_rows,
        )
        pick = recommend(found, args.tolerance)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    vocab = f", vocabulary {shape.vocab_size} x {shape.vocab_width}" if shape.vocab_size else ""
    print(
        f"# Advice: {shape.numel:,} parameters in {len(shape.shapes)} tensors{vocab}; {args.ranks} ranks,"
        f" {args.bandwidth:g} Mbit/s links, {args.compute_seconds:g} s compute per step\n"
    )
    print(
        f"Recommended: **{pick.label}**, predicted {pick.step_seconds:.4g} s/step ({pick.note}). The fastest"
        f" within {args.tolerance:.0%} of the best that departs least from synchronous SGD.\n"
    )
    print(table(found, args.top))
    print(
        "\nPredicted s/step = compute + the communication not hidden behind it (bytes / link rate; no latency,"
        " no codec compute). Periodic schemes' bytes are spread over their period."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
