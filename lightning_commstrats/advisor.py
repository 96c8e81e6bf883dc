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

Memory: :func:`memory_per_rank` predicts the bytes one rank holds between optimizer steps: the
parameters, their gradients and the inner optimizer's state (AdamW's two moments unless told
otherwise), and the scheme's own state as the strategies allocate it (fused gradient buckets, error
feedback residuals, the periodic schemes' global copy and outer optimizer state, a fragment's
exchange in flight), on the device or in host memory (``outer_state``), unsharded or with
``shard="fsdp"`` over groups of ``shard`` ranks. Every :class:`Candidate` carries its
:class:`Memory`; the command prints it beside the step time (``--shard``, ``--outer-state``,
``--optimizer``). Not counted: activations, FSDP2's gathered units, the transient buffers of a sync
(flat copies of a fragment, the codec's scratch), module buffers, the allocator's slack.

Every registered strategy name is either advised (:data:`SCHEMES`) or out of the advisor's scope
with the reason (:data:`OUT_OF_SCOPE`).

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lightning_commstrats import cost_model
from lightning_commstrats.comm import Communicator, wire
from lightning_commstrats.comm.base import LocalCommunicator
from lightning_commstrats.compression.aggregation import MatrixLayout
from lightning_commstrats.compression.density import StatisticalAllGather, check_schedule
from lightning_commstrats.compression.exchange import EXCHANGE_BITS
from lightning_commstrats.compression.rows import resolve_count
from lightning_commstrats.compression.sparse import SPARSE_VALUE_BITS, TopKCodec
from lightning_commstrats.compression.sparse_tiles import TiledSparseAllGather
from lightning_commstrats.cost_model import ModelShape
from lightning_commstrats.models.base import declared_vocabulary
from lightning_commstrats.outer import OUTER_STATES
from lightning_commstrats.strategies.periodic import PSEUDO_GRAD_BITS, fragment_bounds
from lightning_commstrats.strategies.streaming_diloco import default_delay

SCHEMES = (
    "allreduce",
    "onebit_sgd",
    "onebit_adam",
    "zero_one_adam",
    "sampled_vocab",
    "model_averaging",
    "bmuf",
    "local_sgd",
    "diloco",
    "streaming_diloco",
    "sparseloco",
)
PERIODIC = ("model_averaging", "bmuf", "local_sgd", "diloco", "streaming_diloco", "sparseloco")
# The registered strategy names the advisor does not predict, and why.
OUT_OF_SCOPE = {
    "expert_parallel": (
        "a mixture-of-experts layout: its all-to-alls carry tokens, whose bytes depend on the routing,"
        " the capacity factor and the expert placement, not on the parameter shapes alone"
        " (benchmarks/moe_layout.py measures the layouts)"
    ),
    "parameter_server": (
        "the 2018 paper's baseline over RPC: its asynchronous mode's time depends on how pushes queue at"
        " the servers, which the cost model does not capture (cost_model.parameter_server gives a"
        " synchronous exchange's seconds)"
    ),
}
# The schemes that run on FSDP2 shards (shard="fsdp"): the strategies' `supports_shard`.
SHARDABLE = ("allreduce", "onebit_sgd", "model_averaging", "bmuf", "diloco", "streaming_diloco", "sparseloco")
# The inner optimizer's state per parameter: (buffers of the parameter's size and dtype, whether a
# step counter tensor of 4 bytes is kept per parameter tensor), as torch.optim allocates them.
INNER_OPTIMIZERS = {"adamw": (2, True), "adam": (2, True), "sgd_momentum": (1, False), "sgd": (0, False)}
PARAM_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACCELERATORS = ("gpu", "cpu")
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
    "onebit_adam": ("freeze_step", "num_quantization_bits", "small_tensor_numel"),
    "zero_one_adam": ("var_freeze_step", "local_step_clipper", "num_quantization_bits", "small_tensor_numel"),
    "sampled_vocab": ("alpha", "beta", "num_quantization_bits", "error_feedback"),
    "model_averaging": (
        "sync_period",
        "sync_period_unit",
        "pseudo_grad_bits",
        "pseudo_grad_scales",
        "small_tensor_numel",
    ),
    "bmuf": ("sync_period", "sync_period_unit", "pseudo_grad_bits", "pseudo_grad_scales", "small_tensor_numel"),
    "local_sgd": ("sync_period", "pseudo_grad_bits", "pseudo_grad_scales", "small_tensor_numel"),
    "diloco": (
        "sync_period",
        "sync_period_unit",
        "pseudo_grad_bits",
        "pseudo_grad_codec",
        "pseudo_grad_scales",
        "small_tensor_numel",
        "outer_momentum",
    ),
    "streaming_diloco": (
        "sync_period",
        "num_fragments",
        "fragment_sync_delay",
        "pseudo_grad_bits",
        "pseudo_grad_scales",
        "small_tensor_numel",
        "outer_momentum",
        "keep_local_progress",
    ),
    "sparseloco": (
        "sync_period",
        "sync_period_unit",
        "num_fragments",
        "fragment_sync_delay",
        "pseudo_grad_bits",
        "topk_chunk",
        "topk_per_chunk",
        "topk_form",
        "topk_tile",
        "topk_schedule",
        "small_tensor_numel",
        "keep_local_progress",
    ),
}


@dataclass(frozen=True)
class Memory:
    """The bytes one rank holds between optimizer steps (see :func:`memory_per_rank`).

    Attributes:
        parameters: this rank's parameters (its shards with ``shard > 1``).
        gradients: their gradients (``onebit_adam`` drops them after its own step; every backward
            makes them again).
        optimizer: the inner optimizer's state.
        scheme: the scheme's own state, as ``(what, bytes, where)``, ``where`` ``"device"`` or ``"host"``.
        on_device: where ``parameters``, ``gradients`` and ``optimizer`` live: ``"device"`` (a GPU
            run) or ``"host"`` (a CPU run, where everything is host memory).
        shard: the ranks a replica is sharded over (1: every rank holds the whole model).
        step_counts: the part of ``optimizer`` that is Adam's step count per tensor (4 bytes each):
            torch keeps them in host memory unless the optimizer is ``capturable`` or ``fused``.
    """

    parameters: int
    gradients: int
    optimizer: int
    scheme: tuple[tuple[str, int, str], ...]
    on_device: str = "device"
    shard: int = 1
    step_counts: int = 0

    def scheme_bytes(self, where: str | None = None) -> int:
        """The scheme's state in bytes: all of it, or what lives at ``where`` (``"device"``, ``"host"``)."""
        return sum(b for _, b, w in self.scheme if where is None or w == where)

    def _at(self, where: str) -> int:
        own = self.parameters + self.gradients + self.optimizer - self.step_counts if self.on_device == where else 0
        return own + (self.step_counts if where == "host" else 0) + self.scheme_bytes(where)

    @property
    def device(self) -> int:
        """Bytes of device (accelerator) memory."""
        return self._at("device")

    @property
    def host(self) -> int:
        """Bytes of host memory."""
        return self._at("host")

    @property
    def total(self) -> int:
        return self.device + self.host


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
        sharded_memory: the same with ``shard="fsdp"`` over groups of ``memory_options["shard"]``
            ranks, when asked and the scheme runs sharded (else ``None``).
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
    shard: int | None = None,
    optimizer: str = "adamw",
    param_dtype: str = "float32",
    outer_state: str = "host",
    accelerator: str = "gpu",
) -> Candidate:
    """The predicted step of ``scheme`` at ``settings`` (its constructor arguments; missing ones
    take the strategy's defaults, except ``sync_period``, which periodic schemes need) for
    ``model`` (a :class:`~lightning_commstrats.cost_model.ModelShape`, or what :func:`model_shape`
    takes), with the memory each rank holds (:func:`memory_per_rank`).

    ``tokens_per_rank`` (token ids in one rank's minibatch) and ``sampled_rows`` (rows exchanged per
    step, when measured) only matter for ``sampled_vocab``; see :func:`expected_sampled_rows`.
    ``shard``: also the memory with ``shard="fsdp"`` over groups of this many ranks (the step time
    stays the unsharded layout's); ``optimizer``, ``param_dtype``, ``outer_state``, ``accelerator``:
    see :func:`memory_per_rank`.

    Raises:
        ValueError: for an unknown scheme, a setting the scheme does not take or an unsupported
            value, a period in samples (the advisor counts steps), ``sampled_vocab`` on a model
            without a vocabulary, or a memory option :func:`memory_per_rank` refuses.
    """
    _check_inputs(bandwidth_bits, compute_seconds, ranks)
    if not isinstance(model, ModelShape):
        model = model_shape(model)
    settings = _checked_settings(scheme, settings)
    found = _predict_step(
        scheme, settings, model, bandwidth_bits, compute_seconds, ranks, tokens_per_rank, sampled_rows
    )
    options = {
        "ranks": ranks,
        "optimizer": optimizer,
        "param_dtype": param_dtype,
        "outer_state": outer_state,
        "accelerator": accelerator,
    }
    memory = memory_per_rank(scheme, settings, model, **options)
    if shard is not None:
        _check_shard(shard, ranks)
    sharded = None
    if shard is not None and scheme in SHARDABLE:
        sharded = memory_per_rank(scheme, settings, model, shard=shard, **options)
    return replace(found, memory=memory, sharded_memory=sharded)


def _checked_settings(scheme: str, settings: Mapping[str, Any] | None) -> dict[str, Any]:
    if scheme in OUT_OF_SCOPE:
        raise ValueError(f"the advisor does not predict {scheme!r}: {OUT_OF_SCOPE[scheme]}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not known to the advisor; choose one of {SCHEMES}")
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(SETTINGS[scheme]))
    if unknown:
        raise ValueError(f"settings {unknown} are not read by the advisor for {scheme}; it reads {SETTINGS[scheme]}")
    return settings


def _check_shard(shard: Any, ranks: int) -> None:
    if isinstance(shard, bool) or not isinstance(shard, int) or not 1 <= shard <= ranks or ranks % shard:
        raise ValueError(
            f"shard must be an int in [1, ranks={ranks}] that divides the ranks (the ranks a replica is sharded"
            f" over), got {shard!r}"
        )


def _predict_step(
    scheme: str,
    settings: dict[str, Any],
    model: ModelShape,
    bandwidth_bits: float,
    compute_seconds: float,
    ranks: int,
    tokens_per_rank: int,
    sampled_rows: float | None,
) -> Candidate:
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
    if scheme == "onebit_adam":  # past its fp32 warm-up: the momentum travels as onebit_sgd's gradients do
        bits = _int_setting(settings, "num_quantization_bits", 1, EXCHANGE_BITS)
        freeze = _int_setting(settings, "freeze_step", 400)
        nbytes = cost_model.exchange_bytes(model.shapes, n, bits, small_tensor_numel=small)
        wire_s = cost_model.seconds(nbytes, bw)
        note = (
            f"Adam's variance frozen after {freeze} fp32 steps, then {bits}-bit momentum with error feedback"
            " (Adam or AdamW only): quality must be checked"
        )
        return Candidate(scheme, settings, wire_s, compute_seconds + wire_s, nbytes, True, note)
    if scheme == "zero_one_adam":  # its steady state: a 1-bit round every local_step_clipper steps
        bits = _int_setting(settings, "num_quantization_bits", 1, EXCHANGE_BITS)
        freeze = _int_setting(settings, "var_freeze_step", 400)
        every = _int_setting(settings, "local_step_clipper", 16)
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


@dataclass(frozen=True)
class _Schedule:
    """A periodic scheme's settings with the strategy's defaults filled in."""

    period: int
    bits: int
    by_rows: bool
    fragments: int
    delay: int
    keep_local_progress: bool
    sparse: TopKCodec | None  # sparseloco's codec (topk_form="chunks")
    small: int
    # sparseloco's published form, or diloco's dense statistical codec: one rank's payload per tensors
    gather: TiledSparseAllGather | None = None


def _schedule(scheme: str, settings: Mapping[str, Any], tensors: int) -> _Schedule:
    """``settings`` of a periodic scheme with the strategy's defaults, checked as the strategy checks
    them; ``tensors``: the model's parameter tensors (fragments are runs of them)."""
    if "sync_period" not in settings:
        raise ValueError(f"settings: {scheme} needs sync_period (in optimizer steps)")
    period = _int_setting(settings, "sync_period", 0)
    if period < 1:
        raise ValueError(f"settings: sync_period must be an int >= 1 (optimizer steps), got {period!r}")
    unit = settings.get("sync_period_unit", "steps")
    if unit != "steps":
        raise ValueError(f"settings: the advisor counts periods in optimizer steps; sync_period_unit={unit!r}")
    published = scheme == "sparseloco" and settings.get("topk_form", "chunks") == "published"
    if scheme == "sparseloco" and settings.get("topk_form", "chunks") not in ("chunks", "published"):
        raise ValueError(
            f"settings: topk_form={settings['topk_form']!r} is not supported; choose 'chunks' or 'published'"
        )
    small = _int_setting(settings, "small_tensor_numel", 0 if published else 1024)
    codec = settings.get("pseudo_grad_codec", "uniform")
    if codec not in ("uniform", "e3m0", "statistical"):
        raise ValueError(
            f"settings: the advisor predicts pseudo_grad_codec 'uniform', 'e3m0' or 'statistical', got {codec!r}"
        )
    default_bits = {"streaming_diloco": 4, "sparseloco": 2}.get(scheme, 2 if codec == "statistical" else 32)
    allowed = SPARSE_VALUE_BITS if scheme == "sparseloco" else (2, 4, 8) if codec == "statistical" else PSEUDO_GRAD_BITS
    bits = _int_setting(settings, "pseudo_grad_bits", default_bits, allowed)
    gather = StatisticalAllGather(LocalCommunicator(), bits=bits) if codec == "statistical" else None
    scales = settings.get("pseudo_grad_scales", "rows")
    if scales not in ("rows", "columns"):
        raise ValueError(f"settings: pseudo_grad_scales={scales!r} is not supported; choose one of ('rows', 'columns')")
    fragments, delay, keep, sparse = 1, 0, False, None
    if scheme in ("streaming_diloco", "sparseloco"):
        streaming = scheme == "streaming_diloco"
        fragments = _int_setting(settings, "num_fragments", STREAMING_FRAGMENTS if streaming else 1)
        most = 5 if streaming else 1  # the strategies' default delays (or less where the period allows less)
        delay = _int_setting(settings, "fragment_sync_delay", default_delay(period, fragments, most=most))
        keep = settings.get("keep_local_progress", not streaming)
        if not isinstance(keep, bool):
            raise ValueError(f"settings: keep_local_progress must be True or False, got {keep!r}")
        if not 1 <= fragments <= min(period, tensors):
            raise ValueError(
                f"settings: num_fragments={fragments} must be in [1, min(sync_period, parameter tensors)]"
                f" = [1, {min(period, tensors)}]"
            )
        if delay < 0 or (delay and delay * fragments >= period):
            raise ValueError(
                f"settings: fragment_sync_delay={delay} must be >= 0 and < sync_period / num_fragments"
                f" = {period}/{fragments}"
            )
        if published:  # the steady state: the schedule's first syncs send more
            tile = _int_setting(settings, "topk_tile", 64)
            kept = _int_setting(settings, "topk_per_chunk", 64)
            if tile < 1 or not 1 <= kept <= tile * tile:
                raise ValueError(
                    f"settings: topk_tile={tile} must be >= 1 and topk_per_chunk={kept} in [1, topk_tile^2]"
                )
            check_schedule(settings.get("topk_schedule"), kept, tile * tile, name="settings: topk_schedule")
            gather = TiledSparseAllGather(LocalCommunicator(), tile=tile, k=kept, bits=bits)
        elif not streaming:
            chunk = _int_setting(settings, "topk_chunk", 4096)
            kept = _int_setting(settings, "topk_per_chunk", 64)
            if chunk < 2 or not 1 <= kept <= chunk:
                raise ValueError(
                    f"settings: topk_chunk={chunk} must be >= 2 and topk_per_chunk={kept} in [1, topk_chunk]"
                )
            sparse = TopKCodec(chunk, kept, bits)
    return _Schedule(period, bits, scales == "rows", fragments, delay, keep, sparse, small, gather)


def sparse_exchange_bytes(shapes: Sequence[tuple[int, ...]], n: int, codec: TopKCodec, small_tensor_numel: int) -> int:
    """Bytes one rank sends in one sparse averaging (``sparseloco``'s exchange): every tensor of more
    than ``small_tensor_numel`` values in chunks of ``codec.chunk`` (the last one of each tensor
    padded), one payload per rank all-gathered; the rest in an fp32 ring all-reduce."""
    sizes = [math.prod(s) for s in shapes]
    chunks = sum(-(-k // codec.chunk) for k in sizes if k > small_tensor_numel)
    dense = sum(k for k in sizes if k <= small_tensor_numel)
    payload = codec.payload_bytes(chunks) if chunks else 0
    return wire.all_gather_bytes(payload, 1, n) + wire.all_reduce_bytes(dense, 4, n)


def gathered_exchange_bytes(
    shapes: Sequence[tuple[int, ...]], n: int, gather: TiledSparseAllGather, small_tensor_numel: int
) -> int:
    """Bytes one rank sends in one averaging by ``gather`` (``sparseloco``'s published form, or the dense
    statistical codec): every tensor of more than ``small_tensor_numel`` values in one payload per rank,
    all-gathered; the rest in an fp32 ring all-reduce."""
    big = [tuple(s) for s in shapes if math.prod(s) > small_tensor_numel]
    dense = sum(math.prod(s) for s in shapes if math.prod(s) <= small_tensor_numel)
    payload = gather.payload_bytes(big) if big else 0
    return wire.all_gather_bytes(payload, 1, n) + wire.all_reduce_bytes(dense, 4, n)


def _periodic(
    scheme: str, settings: dict[str, Any], model: ModelShape, bw: float, compute: float, n: int, small: int
) -> Candidate:
    sched = _schedule(scheme, settings, len(model.shapes))
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


# ---------------------------------------------------------------------------------- memory


def memory_per_rank(
    scheme: str,
    settings: Mapping[str, Any] | None,
    model: ModelShape | Any,
    *,
    ranks: int,
    shard: int = 1,
    optimizer: str = "adamw",
    param_dtype: str = "float32",
    outer_state: str = "host",
    accelerator: str = "gpu",
) -> Memory:
    """The bytes one rank holds between optimizer steps under ``scheme`` at ``settings``, as the
    strategies and ``torch.optim`` allocate them (read from their code; ``tests/test_advisor.py``
    checks it against the tensors real strategies hold on two ranks).

    Every rank holds its parameters, their gradients and the inner optimizer's state (``optimizer``:
    ``"adamw"`` and ``"adam"`` two buffers of the parameters' size and a 4-byte step count per tensor,
    ``"sgd_momentum"`` one buffer, ``"sgd"`` none). The scheme's own state (with ``ranks > 1``):

    - ``allreduce``: its fused gradient buckets, kept from step to step (one copy of the gradients);
    - ``onebit_sgd`` (and ``sampled_vocab`` for the tensors outside the vocabulary): below 32 bits, the
      error-feedback residuals in float32, stage 1 the size of every quantized matrix, stage 2 the
      rank's stripe of it (a ``1/ranks`` share; rank 0's, the largest, is counted), plus the buckets
      of the tensors sent in full precision; at 32 bits the buckets of every gradient;
    - ``onebit_adam``: as ``onebit_sgd`` past the freeze (its momentum travels as ``onebit_sgd``'s
      gradients do; the fp32 warm-up's gradient buckets are released at the freeze);
    - ``zero_one_adam``: as ``onebit_adam``, with its cached preconditioner (one copy of the
      parameters) and, with local steps (``local_step_clipper`` > 1), the weights at the last
      synchronisation and the accumulated momentum (two more); without them, the fp32 rounds'
      gradient buckets (until ``var_freeze_step``);
    - ``sampled_vocab``: also a flag per word, the frequent words' ids, the last step's row ids (at
      most 8 bytes a word) and,
      with ``error_feedback``, the unsent rows (the vocabulary matrices' size);
    - the periodic schemes: the global model in float32 and the outer optimizer's state (``bmuf``'s
      block momentum, ``diloco`` and ``streaming_diloco``'s Nesterov momentum, none for
      ``model_averaging``, ``local_sgd`` and ``sparseloco``), at ``outer_state`` (``"host"``: pinned
      host memory on a GPU run; ``"device"``); below 32 bits the quantization residuals as above
      (stripes of the pseudo-gradient's rows), or ``sparseloco``'s error-feedback buffer (the synced
      tensors in float32, each padded to whole chunks where it is made, on the device); with a
      ``fragment_sync_delay``, the exchange in flight on the device for that many steps of every
      period: the largest fragment's pseudo-gradient, and its local weights at the launch with
      ``keep_local_progress``. The in-flight bytes are held only between an exchange's launch and
      its landing; they are counted here because that is the peak between steps.

    ``shard`` > 1 (``shard="fsdp"`` with ``group_size=shard``): every tensor is cut along its first
    dimension over the ``shard`` ranks of a group (rank 0's shard, the largest, counted); the scheme
    state is per local shard, and the quantization residuals' stripes are cut over the
    ``ranks / shard`` groups that exchange (none with a single group: nothing is exchanged).

    Not counted: module buffers, activations, FSDP2's gathered units and unsharded gradients during
    forward and backward, the transient buffers of a sync (flat copies of a fragment, the pseudo-gradient
    being made, the codec's scratch), the local weights set aside while validating a periodic scheme on
    the global model, and the allocator's slack.

    Args:
        scheme, settings, model: as :func:`predict`.
        ranks: the number of ranks.
        shard: the ranks a replica is sharded over (1: every rank holds the whole model).
        optimizer: the inner optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd_momentum"``, ``"sgd"``.
        param_dtype: the parameters' dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); gradients and
            the inner optimizer's state take it; the scheme state the strategies keep in float32 stays so.
        outer_state: where the periodic schemes keep their global copy, outer state and residuals
            (the strategies' ``outer_state``): ``"host"`` (default) or ``"device"``.
        accelerator: ``"gpu"`` (default: the training device is a GPU) or ``"cpu"`` (everything is
            host memory).

    Raises:
        ValueError: naming the argument: an unknown scheme or setting, ``shard`` that does not divide
            ``ranks``, ``shard > 1`` for a scheme that does not run sharded, an unknown optimizer,
            dtype, ``outer_state`` or accelerator.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    _check_shard(shard, ranks)
    if optimizer not in INNER_OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not supported; choose one of {tuple(INNER_OPTIMIZERS)}")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r} is not supported; choose one of {tuple(PARAM_DTYPES)}")
    if outer_state not in OUTER_STATES:
        raise ValueError(f"outer_state={outer_state!r} is not supported; choose one of {OUTER_STATES}")
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not supported; choose one of {ACCELERATORS}")
    if not isinstance(model, ModelShape):
        model = model_shape(model)
    settings = _checked_settings(scheme, settings)
    if shard > 1 and scheme not in SHARDABLE:
        raise ValueError(f"shard={shard}: {scheme} does not run sharded; the schemes that do: {SHARDABLE}")
    if scheme in ("onebit_adam", "zero_one_adam") and optimizer not in ("adam", "adamw"):
        raise ValueError(f"optimizer={optimizer!r}: {scheme} continues the user's Adam or AdamW")
    width = PARAM_DTYPES[param_dtype]
    local = [_local_shape(s, shard) for s in model.shapes]
    numel = sum(math.prod(s) for s in local)
    buffers, counts_steps = INNER_OPTIMIZERS[optimizer]
    params = numel * width
    counts = 4 * len(local) if counts_steps else 0
    inner = buffers * params + counts
    replicas = ranks // shard
    if scheme in PERIODIC:
        parts = _periodic_state(scheme, settings, local, replicas, outer_state, accelerator)
    elif ranks == 1:  # a one-rank run exchanges nothing and keeps nothing for it
        parts = []
    else:
        parts = _gradient_state(scheme, settings, model, local, replicas, width)
    if scheme == "zero_one_adam":
        parts = _zero_one_adam_state(settings, parts, numel * width, ranks)
    if accelerator == "cpu":
        parts = [(what, nbytes, "host") for what, nbytes, _ in parts]
    where = "host" if accelerator == "cpu" else "device"
    return Memory(params, params, inner, tuple(p for p in parts if p[1]), where, shard, counts)


def _local_shape(shape: tuple[int, ...], shard: int) -> tuple[int, ...]:
    """Rank 0's FSDP2 shard of a tensor of ``shape``: its first dimension cut in ``shard`` chunks."""
    if shard == 1 or not shape:
        return tuple(shape)
    return (-(-shape[0] // shard), *shape[1:])


def _stripe_numel(shape: tuple[int, ...], ranks: int, by_rows: bool) -> int:
    """Values of rank 0's stripe of a matrix in the two-stage quantized exchange over ``ranks``."""
    lay = MatrixLayout.of(torch.Size(shape), ranks, by_rows)
    c0, c1 = lay.stripes[0]
    return (c1 - c0) * lay.rows


def _residuals(shapes: Sequence[tuple[int, ...]], ranks: int, small: int, by_rows: bool) -> list[tuple[str, int]]:
    """The two stages' error-feedback residuals (float32) of the matrices a quantized exchange sends."""
    quantized = [s for s in shapes if len(s) >= 2 and math.prod(s) > small]
    return [
        ("error-feedback residuals, stage 1", 4 * sum(math.prod(s) for s in quantized)),
        (
            "error-feedback residuals, stage 2 (this rank's stripe)",
            4 * sum(_stripe_numel(s, ranks, by_rows) for s in quantized),
        ),
    ]


def _zero_one_adam_state(
    settings: Mapping[str, Any], parts: list[tuple[str, int, str]], params: int, ranks: int
) -> list[tuple[str, int, str]]:
    """``zero_one_adam``'s state at its largest: the quantized exchange's (as ``onebit_adam``'s), its
    cached preconditioner, and either the weights at the last synchronisation and ``u_i`` (with local
    steps; kept once made) or the fp32 rounds' gradient buckets (without: they are the larger then)."""
    parts = [*parts, ("the preconditioner sqrt(v) + eps, cached", params, "device")]
    if _int_setting(settings, "local_step_clipper", 16) > 1:
        return [
            *parts,
            ("the weights at the last synchronisation", params, "device"),
            ("the accumulated momentum u", params, "device"),
        ]
    if ranks > 1:
        parts.append(("gradient buckets of the fp32 rounds (until var_freeze_step)", params, "device"))
    return parts


def _gradient_state(
    scheme: str, settings: Mapping[str, Any], model: ModelShape, local: list[tuple[int, ...]], replicas: int, width: int
) -> list[tuple[str, int, str]]:
    numel = sum(math.prod(s) for s in local)
    if scheme == "allreduce":
        return [("gradient buckets kept between steps", width * numel, "device")]
    if scheme == "sampled_vocab":
        v, vw = model.vocab_size, model.vocab_width
        if not v or not vw:
            raise ValueError("sampled_vocab needs the model's vocab_size and vocab_width (no vocabulary is known)")
        if _int_setting(settings, "num_quantization_bits", 32) != 32:
            raise ValueError("settings: the advisor predicts sampled_vocab with num_quantization_bits=32 only")
        parts = [
            ("buckets of the tensors outside the vocabulary", width * (numel - v * vw), "device"),
            ("a flag per word of the vocabulary", v + 1, "device"),
            ("the frequent words' ids", 8 * resolve_count(settings.get("alpha", 2000), v, "alpha"), "device"),
            ("the last step's row ids (at most)", 8 * v, "device"),
        ]
        if settings.get("error_feedback", False):
            parts.append(("unsent vocabulary rows (error feedback)", width * v * vw, "device"))
        return parts
    parts = []  # (onebit_adam releases its fp32 warm-up's gradient buckets at the freeze)
    if replicas == 1:  # one group: the exchange across groups has no one to exchange with
        return parts
    bits = _int_setting(settings, "num_quantization_bits", 1, EXCHANGE_BITS)
    small = _int_setting(settings, "small_tensor_numel", 1024)
    full = [s for s in local if bits == 32 or not (len(s) >= 2 and math.prod(s) > small)]
    parts.append(("buckets of the tensors sent in full precision", width * sum(math.prod(s) for s in full), "device"))
    if bits < 32:
        parts += [(what, nbytes, "device") for what, nbytes in _residuals(local, replicas, small, by_rows=False)]
    return parts


def _periodic_state(
    scheme: str,
    settings: Mapping[str, Any],
    local: list[tuple[int, ...]],
    replicas: int,
    outer_state: str,
    accelerator: str,
) -> list[tuple[str, int, str]]:
    sched = _schedule(scheme, settings, len(local))
    home = "device" if outer_state == "device" else "host"
    sizes = [math.prod(s) for s in local]
    numel = sum(sizes)
    parts = [("global model (float32)", 4 * numel, home)]
    if scheme == "bmuf":
        parts.append(("block momentum", 4 * numel, home))
    elif scheme in ("diloco", "streaming_diloco"):
        momentum = settings.get("outer_momentum", 0.9)
        if not isinstance(momentum, (int, float)) or isinstance(momentum, bool) or not 0 <= momentum < 1:
            raise ValueError(f"settings: outer_momentum must be a number in [0, 1), got {momentum!r}")
        if momentum > 0:
            parts.append(("outer Nesterov momentum", 4 * numel, home))
    bounds = fragment_bounds(sizes, sched.fragments)
    if replicas > 1 and sched.gather is not None:  # made and kept unpadded, tensor by tensor
        parts.append(("error-feedback buffer (gathered exchange)", 4 * sum(k for k in sizes if k > sched.small), home))
    elif replicas > 1 and sched.sparse is not None:
        chunk, small = sched.sparse.chunk, sched.small
        # made on the device as one block per fragment, each tensor padded to whole chunks; kept there,
        # or copied unpadded to pinned host memory on a GPU run with outer_state="host"
        if home == "host" and accelerator == "gpu":
            nbytes = 4 * sum(k for k in sizes if k > small)
        else:
            nbytes = 4 * sum(-(-k // chunk) * chunk for k in sizes if k > small)
        parts.append(("error-feedback buffer (sparse exchange)", nbytes, home))
    elif replicas > 1 and sched.bits < 32:
        parts += [(what, nbytes, home) for what, nbytes in _residuals(local, replicas, sched.small, sched.by_rows)]
    if sched.delay:
        largest = 4 * max(sum(sizes[i0:i1]) for i0, i1 in bounds)
        parts.append(("exchange in flight: the largest fragment's pseudo-gradient", largest, "device"))
        if sched.keep_local_progress:
            parts.append(("exchange in flight: its local weights at the launch", largest, "device"))
    return parts


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
    shard: int | None = None,
    optimizer: str = "adamw",
    param_dtype: str = "float32",
    outer_state: str = "host",
    accelerator: str = "gpu",
) -> list[Candidate]:
    """Every candidate's predicted step, fastest first, with the memory each rank holds.

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
        tokens_per_rank, sampled_rows, shard: see :func:`predict`.
        optimizer, param_dtype, outer_state, accelerator: see :func:`memory_per_rank`.

    Raises:
        ValueError: naming the argument: ``bandwidth_bits <= 0``, ``compute_seconds < 0``,
            ``ranks < 1``, an unknown scheme in ``candidates``, a model without parameters.
    """
    _check_inputs(bandwidth_bits, compute_seconds, ranks)
    model = model_shape(model_or_shapes, vocab_size, vocab_width)
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
        raise ValueError(f"candidates must be a list of scheme names or (scheme, settings) pairs, got {candidates!r}")
    pairs: list[tuple[str, Mapping[str, Any]]] = []
    for item in candidates:
        name, settings = (item, None) if isinstance(item, str) else tuple(item)
        if name in OUT_OF_SCOPE:
            raise ValueError(f"candidates: the advisor does not predict {name!r}: {OUT_OF_SCOPE[name]}")
        if name not in SCHEMES:
            raise ValueError(f"candidates: unknown scheme {name!r}; choose from {SCHEMES}")
        if settings is None:
            grid = default_settings(
                name, model, bandwidth_bits=bandwidth_bits, compute_seconds=compute_seconds, ranks=ranks
            )
            pairs += [(name, s) for s in grid]
        else:
            pairs.append((name, settings))
    kw = {
        "bandwidth_bits": bandwidth_bits,
        "compute_seconds": compute_seconds,
        "ranks": ranks,
        "shard": shard,
        "optimizer": optimizer,
        "param_dtype": param_dtype,
        "outer_state": outer_state,
        "accelerator": accelerator,
    }
    out = [
        predict(name, s, model, tokens_per_rank=tokens_per_rank, sampled_rows=sampled_rows, **kw) for name, s in pairs
    ]
    return sorted(out, key=lambda c: (c.step_seconds, c.bytes_per_step, SCHEMES.index(c.scheme)))


def departure(c: Candidate) -> tuple[int, int, float]:
    """How far a candidate's optimisation is from synchronous SGD, for :func:`recommend`: exact
    first, then per-step gradient approximations (more bits first), then periodic schemes
    (shorter periods first, then more bits per synced value: ``sparseloco``'s bits count for the
    share of values it sends, 2 x 64 / 4096 by default)."""
    if not c.changes_optimisation:
        return (0, 0, 0)
    if c.scheme in PERIODIC:
        bits: float = c.settings.get("pseudo_grad_bits", {"streaming_diloco": 4, "sparseloco": 2}.get(c.scheme, 32))
        if c.scheme == "sparseloco":
            bits *= c.settings.get("topk_per_chunk", 64) / c.settings.get("topk_chunk", 4096)
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


def mib(nbytes: float) -> str:
    """Bytes as MiB with 4 significant digits (``"0"`` for none, ``"<0.001"`` for a few bytes: Adam's
    step counts on the host of a GPU run)."""
    if not nbytes:
        return "0"
    return f"{nbytes / 2**20:.4g}" if nbytes >= 2**20 / 1000 else "<0.001"


def table(candidates: Sequence[Candidate], top: int | None = None, shard: int | None = None) -> str:
    """The candidates as a markdown table (in the given order), with each one's speed-up over
    ``allreduce`` when ``allreduce`` is among them, and the device and host memory per rank
    (:attr:`Candidate.memory`); with ``shard``, also with ``shard="fsdp"`` over groups of that many
    ranks (``n/a`` for a scheme that does not run sharded)."""
    ref = next((c.step_seconds for c in candidates if c.scheme == "allreduce"), None)
    head = "| # | scheme | settings | predicted s/step | comm s/step (wire) | MB/step/rank | vs allreduce |"
    head += " device MiB/rank | host MiB/rank |"
    if shard:
        head += f" device MiB/rank, shard {shard} | host MiB/rank, shard {shard} |"
    head += " note |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, c in enumerate(candidates[:top] if top else candidates, 1):
        shown = ", ".join(f"{k}={v}" for k, v in c.settings.items() if k != "sync_period_unit") or "-"
        speedup = f"{ref / c.step_seconds:.2f}x" if ref and c.step_seconds > 0 else "-"
        memory = f" {mib(c.memory.device)} | {mib(c.memory.host)} |" if c.memory else " - | - |"
        if shard:
            m = c.sharded_memory
            memory += f" {mib(m.device)} | {mib(m.host)} |" if m else " n/a | n/a |"
        lines.append(
            f"| {i} | {c.scheme} | {shown} | {c.step_seconds:.4g} | {c.comm_seconds:.4g} |"
            f" {c.bytes_per_step / 1e6:.4g} | {speedup} |{memory} {c.note} |"
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
    args = parser.parse_args(argv)
    if not (args.bandwidth > 0 and math.isfinite(args.bandwidth)):
        parser.error(f"--bandwidth must be a finite rate > 0 Mbit/s, got {args.bandwidth:g}")
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
            shape, tokens = model_from_config(args.config)
            if not args.optimizer:
                optimizer, source = optimizer_from_config(args.config), "from the config"
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
            shard=args.shard,
            optimizer=optimizer,
            param_dtype=args.param_dtype,
            outer_state=args.outer_state,
            accelerator=args.accelerator,
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
    print(table(found, args.top, args.shard))
    states = INNER_OPTIMIZERS[optimizer][0]
    where = "a GPU" if args.accelerator == "gpu" else "the CPU (all of it host memory)"
    sharded = (
        f"; shard {args.shard}: shard='fsdp' with group_size={args.shard}, the time columns stay unsharded"
        if args.shard
        else ""
    )
    print(
        "\nPredicted s/step = compute + the communication not hidden behind it (bytes / link rate; no latency,"
        " no codec compute). Periodic schemes' bytes are spread over their period."
        f"\n\nMemory per rank, held between steps: the {args.param_dtype} model"
        f" ({mib(shape.numel * PARAM_DTYPES[args.param_dtype])} MiB), its gradients, {optimizer}'s state"
        f" ({states} buffer{'s' if states != 1 else ''} per parameter, {source}) and the scheme's own state,"
        f" training on {where}, the periodic schemes' outer state on the {args.outer_state}{sharded}."
        " Not counted: activations, buffers, a sync's transient copies."
    )
    return 0


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
