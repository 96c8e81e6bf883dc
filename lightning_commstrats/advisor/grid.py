"""Every candidate at once: the settings tried, the ranking and the table (:func:`advise`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_commstrats import cost_model
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
    check_inputs,
    model_shape,
)
from lightning_commstrats.advisor.predict import Candidate, predict
from lightning_commstrats.cost_model import ModelShape
from lightning_commstrats.strategies.fragments import fragment_bounds


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
    check_inputs(bandwidth_bits, compute_seconds, ranks)
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
    share of values it sends, 2 x 64 / 4096 by default). ``zero_one_adam`` with local steps
    (``local_step_clipper`` > 1) ranks with the periodic schemes at that period: its steady state is
    a round every ``local_step_clipper`` steps."""
    if not c.changes_optimisation:
        return (0, 0, 0)
    if c.scheme == "zero_one_adam" and c.settings.get("local_step_clipper", 16) > 1:
        return (2, c.settings.get("local_step_clipper", 16), -c.settings.get("num_quantization_bits", 1))
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
