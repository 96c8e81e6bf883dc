"""The advisor's inputs: the schemes it advises and the settings it reads, the model's shape, and the
checks every entry point applies to them."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from lightning_commstrats.advisor.names import SCHEMES
from lightning_commstrats.cost_model import ModelShape
from lightning_commstrats.models.base import declared_vocabulary

F = TypeVar("F", bound=Callable[..., Any])
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
    "onebit_adam": ("freeze_step", "num_quantization_bits", "small_tensor_numel", "settling_warning"),
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


def check_inputs(flat_bits: float, compute_seconds: float, ranks: int) -> None:
    """The checks every entry point applies to the compute time and the ranks (``flat_bits``, the rate
    :func:`resolve_links` resolved, is checked there)."""
    if not (flat_bits > 0 and math.isfinite(flat_bits)):
        raise ValueError(f"the link must be a finite rate > 0, got {flat_bits!r} bits per second")
    if isinstance(compute_seconds, bool) or not isinstance(compute_seconds, (int, float)):
        raise ValueError(f"compute_seconds must be a number of seconds >= 0, got {compute_seconds!r}")
    if not (compute_seconds >= 0 and math.isfinite(compute_seconds)):
        raise ValueError(f"compute_seconds must be a finite number of seconds >= 0, got {compute_seconds!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")


# Keyword arguments renamed to the command's flags: old name -> (new name, factor from the old unit to the new).
RENAMED = {
    "bandwidth_bits": ("bandwidth", 1e-6),
    "link_inside_bits": ("link_inside", 1e-6),
    "link_between_bits": ("link_between", 1e-6),
    "candidates": ("schemes", None),
    "overhead": ("memory_overhead", None),
}


def accepts_old_names(*old: str) -> Callable[[F], F]:
    """Let a function take its arguments' old names (:data:`RENAMED`) for one more release: each is
    converted to the new name (and unit: the old rates were bits per second, the new ones Mbit/s, as the
    command's flags) with a ``DeprecationWarning`` naming the new one."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for name in old:
                if name not in kwargs:
                    continue
                new, factor = RENAMED[name]
                if new in kwargs:
                    raise TypeError(f"{fn.__name__}() got both {name}= and its new name {new}=: give {new}= alone")
                unit = " (Mbit/s, not bits per second)" if factor else ""
                warnings.warn(
                    f"{fn.__name__}({name}=...) is deprecated and will be removed in the next release:"
                    f" use {new}={unit}, as the command's --{new.replace('_', '-')}",
                    DeprecationWarning,
                    stacklevel=2,
                )
                value = kwargs.pop(name)
                numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
                kwargs[new] = value * factor if factor and numeric else value
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def int_setting(settings: Mapping[str, Any], name: str, default: int, allowed: Sequence[int] | None = None) -> int:
    value = settings.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"settings: {name} must be an int, got {value!r}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"settings: {name}={value!r} is not supported; choose one of {tuple(allowed)}")
    return value


def checked_settings(scheme: str, settings: Mapping[str, Any] | None) -> dict[str, Any]:
    if scheme in OUT_OF_SCOPE:
        raise ValueError(f"the advisor does not predict {scheme!r}: {OUT_OF_SCOPE[scheme]}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not known to the advisor; choose one of {SCHEMES}")
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(SETTINGS[scheme]))
    if unknown:
        raise ValueError(f"settings {unknown} are not read by the advisor for {scheme}; it reads {SETTINGS[scheme]}")
    return settings


def check_shard(shard: Any, ranks: int) -> None:
    if isinstance(shard, bool) or not isinstance(shard, int) or not 1 <= shard <= ranks or ranks % shard:
        raise ValueError(
            f"shard must be an int in [1, ranks={ranks}] that divides the ranks (the ranks a replica is sharded"
            f" over), got {shard!r}"
        )


def _rate(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite rate > 0 Mbit/s, got {value!r}")
    return float(value) * 1e6


def resolve_links(
    bandwidth: float | None,
    link_inside: float | None,
    link_between: float | None,
    ranks: int,
    shard: int | None,
) -> tuple[float, float, float]:
    """``(flat, inside, between)`` in bits per second a rank, from the links in Mbit/s (the command's
    ``--bandwidth``, ``--link-inside``, ``--link-between``): the rate the unsharded layout's exchange over
    every rank runs at, the link inside a group of ``shard`` ranks and the link between groups.

    ``bandwidth`` is both links where one is not given. The unsharded layout's ring crosses the groups
    when there are several: it goes at the slower link; within one group (``shard == ranks``) at the
    inside link; without ``shard`` (no groups known) at the link between.
    """
    between = link_between if link_between is not None else bandwidth
    inside = link_inside if link_inside is not None else bandwidth
    if between is None:
        raise ValueError("link_between (or bandwidth, both links) is needed: the link between ranks, Mbit/s")
    between = _rate("link_between" if link_between is not None else "bandwidth", between)
    if link_inside is not None and shard is None:
        raise ValueError(
            "link_inside needs shard (the ranks of a group, whose FSDP2 traffic runs on that link);"
            " without groups give bandwidth or link_between"
        )
    if shard is None:
        return between, between, between
    if inside is None:
        raise ValueError(f"shard={shard} prices FSDP2's in-group traffic: give link_inside (or bandwidth, both links)")
    inside = _rate("link_inside" if link_inside is not None else "bandwidth", inside)
    flat = inside if shard == ranks else min(inside, between)
    return flat, inside, between


UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: Any, name: str = "device_memory") -> int:
    """Bytes from an int of bytes or a string with a unit: ``"80GiB"``, ``"40 GB"``, ``"850MiB"``
    (``B``, ``KB``/``MB``/``GB``/``TB`` in powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` of 1024, any
    case). A bare number in a string is refused: a unit says what it means."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name} must be bytes (an int) or a size such as '80GiB', got {value!r}")
    text = value.strip().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(number) :].lower()
    if unit not in UNITS:
        raise ValueError(
            f"{name}={value!r}: give a number and a unit, e.g. 80GiB, 40GB or 850MiB (units: B, KB, MB, GB, TB,"
            " KiB, MiB, GiB, TiB)"
        )
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"{name}={value!r}: {number!r} is not a number; e.g. 80GiB") from None
    if not (amount > 0 and math.isfinite(amount)):
        raise ValueError(f"{name}={value!r} must be a size > 0, e.g. 80GiB")
    return math.ceil(amount * UNITS[unit])
