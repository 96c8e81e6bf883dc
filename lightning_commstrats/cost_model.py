"""Predicted communication time per training step, per scheme, from the model and the link rate.

Pure Python. Every function returns seconds per optimizer step for ``n`` ranks whose links carry
``bandwidth`` bits per second in each direction (full duplex), ignoring latency and assuming the
link is the only bottleneck (compute and communication do not overlap in this package's
strategies). Bytes come from :mod:`lightning_commstrats.comm.wire`, so a prediction is the same
number the strategies count, divided by the rate.

- parameter server (``parameter_server``, servers hosted on the training ranks): pushes, then
  replies, through the busiest server link: ``2 (n - 1) K / B`` with one server,
  ``2 (n - 1) K / (n B)`` with ``n`` (the 2018 NLM paper modelled ``2 n K / B``: a separate server
  whose link carries ``n`` gradients in and ``n`` models out);
- ring all-reduce: ``2 (n-1) K / (n B)``;
- 1-bit (n-bit) SGD: the ring volume of the quantized matrices (bits per value + two floats per
  column and stripe) plus the ring all-reduce of the small tensors;
- sampled rows: the ring all-reduce of the selected rows of the vocabulary matrices and of the
  rest of the model, plus the all-gather of the word ids;
- periodic (model averaging, BMUF, local SGD): the model's ring all-reduce divided by the period;
- DiLoCo: one exchange of the pseudo-gradient every period: the matrices through the two-stage
  quantized all-reduce with per-row scales (bits per value + two floats per row and stripe), the
  small tensors in an fp32 ring all-reduce (fp32 throughout at 32 bits);
- for checking the peers of the race: torch's PowerSGD hook (the rank-``r`` factors ``P`` and
  ``Q`` of every compressed matrix and the uncompressed tensors, three fp32 all-reduces) and
  DDP's fp16 hook (the ring at 2 bytes a value).

The quantized byte counts use the codec's own payload size
(:meth:`~lightning_commstrats.compression.ColumnCodec.payload_bytes`) and the aggregator's own
stripes (:class:`~lightning_commstrats.compression.MatrixLayout`), so they follow the code. The
fp32 parts are counted as one fused all-reduce; the strategies cut them into buckets (25 MiB by
default), each rounded up to a multiple of ``N`` values: at most ``2 (N-1) 4`` bytes more per
bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lightning_commstrats.comm import wire
from lightning_commstrats.compression.aggregation import MatrixLayout
from lightning_commstrats.compression.quantizers import ColumnCodec


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know of a model.

    Attributes:
        shapes: the shape of every trainable parameter (tied ones once).
        vocab_size: rows of the vocabulary matrices (0 if none).
        vocab_width: values per vocabulary row, summed over the vocabulary matrices
            (embedding + output weight + output bias: ``E + H + 1``; tied: ``H + 1``).
    """

    shapes: tuple[tuple[int, ...], ...]
    vocab_size: int = 0
    vocab_width: int = 0

    @classmethod
    def of(cls, module, vocab_size: int = 0, vocab_width: int = 0) -> ModelShape:
        params = {id(p): p for p in module.parameters() if p.requires_grad}
        return cls(tuple(tuple(p.shape) for p in params.values()), vocab_size, vocab_width)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def seconds(nbytes: float, bandwidth: float) -> float:
    """Seconds to send ``nbytes`` over a link of ``bandwidth`` bits per second."""
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bits/s, got {bandwidth}")
    return nbytes * 8 / bandwidth


def parameter_server(model: ModelShape, n: int, bandwidth: float, num_servers: int = 1) -> float:
    """Seconds of one exchange of ``parameter_server`` (sync mode, or one async sync of every worker).

    Shard ``s`` of ``K_s`` values is served by rank ``s``. The exchange has two phases one after the
    other (a server replies once every push is in): the pushes, where a server's link receives
    ``(n - 1) K_s`` values while it sends its own ``K - K_s`` to the other servers, then the
    replies, the same the other way. Links are full duplex, so each phase takes the busiest link's
    larger direction: ``2 (n - 1) K`` values' time with one server (the 2018 paper's baseline;
    its own model counted ``2 n K`` through a separate server), ``2 (n - 1) K / n`` with every rank
    a server, as a ring all-reduce; a rank that serves nothing moves ``K`` each way."""
    if n == 1:
        return 0.0
    if not 1 <= num_servers <= n:
        raise ValueError(f"num_servers must be in [1, n={n}], got {num_servers}")
    k = model.numel
    shard = math.ceil(k / num_servers)
    phase = max((n - 1) * shard, k - shard, k if num_servers < n else 0)
    return seconds(2 * phase * 4, bandwidth)


def ring_allreduce(model: ModelShape, n: int, bandwidth: float, element_size: int = 4) -> float:
    """Seconds of a ring all-reduce of the whole model at ``element_size`` bytes a value (4: fp32,
    ``allreduce`` and DDP; 2: DDP's fp16 compression hook)."""
    return seconds(wire.all_reduce_bytes(model.numel, element_size, n), bandwidth)


def quantized_bytes(shapes: Iterable[tuple[int, ...]], n: int, bits: int, *, by_rows: bool = False) -> int:
    """Bytes rank 0 sends in one two-stage quantized all-reduce of matrices of these shapes.

    ``by_rows=False``: one scale pair per column (1-bit SGD's layout, the gradient schemes);
    ``by_rows=True``: per row (the periodic schemes' pseudo-gradients by default). The lines of a
    matrix are cut into ``N`` stripes (:class:`~lightning_commstrats.compression.MatrixLayout`),
    each stripe's payload is the codec's; stage 1 sends every stripe but rank 0's own (an
    all-to-all), stage 2 all-gathers the owners' payloads padded to the largest.
    """
    codec = ColumnCodec(bits)
    total = 0
    for shape in shapes:
        lay = MatrixLayout.of(torch.Size(shape), n, by_rows)
        per_stripe = [codec.payload_bytes(c1 - c0, lay.rows) if c1 > c0 else 0 for c0, c1 in lay.stripes]
        total += sum(per_stripe) - per_stripe[0] + (n - 1) * max(per_stripe)
    return total


def exchange_bytes(
    shapes: Iterable[tuple[int, ...]], n: int, bits: int, *, by_rows: bool = False, small_tensor_numel: int = 1024
) -> int:
    """Bytes rank 0 sends in one averaging of tensors of these shapes at ``bits`` (what
    :class:`~lightning_commstrats.compression.TensorExchange` sends): at 32 bits everything in an
    fp32 ring all-reduce; below, the matrices of more than ``small_tensor_numel`` values through
    :func:`quantized_bytes` and the rest (vectors, small matrices) in an fp32 ring all-reduce."""
    shapes = [tuple(s) for s in shapes]
    if n == 1:
        return 0
    if bits == 32:
        return wire.all_reduce_bytes(sum(math.prod(s) for s in shapes), 4, n)
    large = [s for s in shapes if len(s) >= 2 and math.prod(s) > small_tensor_numel]
    small = sum(math.prod(s) for s in shapes if not (len(s) >= 2 and math.prod(s) > small_tensor_numel))
    return quantized_bytes(large, n, bits, by_rows=by_rows) + wire.all_reduce_bytes(small, 4, n)


def onebit(model: ModelShape, n: int, bandwidth: float, bits: int = 1, small_tensor_numel: int = 1024) -> float:
    """Seconds per step of ``onebit_sgd`` at ``bits`` (per-column scales), past its warm start."""
    return seconds(exchange_bytes(model.shapes, n, bits, small_tensor_numel=small_tensor_numel), bandwidth)


def sampled_rows(model: ModelShape, n: int, bandwidth: float, rows: int, ids_per_rank: int = 0) -> float:
    """``rows`` selected vocabulary rows per step; ``ids_per_rank``: distinct words in a rank's minibatch."""
    rest = model.numel - model.vocab_size * model.vocab_width
    ids = wire.all_gather_bytes(1, 8, n) + wire.all_gather_bytes(ids_per_rank, 4, n)
    payload = wire.all_reduce_bytes(rows * model.vocab_width, 4, n) + wire.all_reduce_bytes(rest, 4, n)
    return seconds(payload + ids, bandwidth)


def periodic(model: ModelShape, n: int, bandwidth: float, period_steps: float) -> float:
    if not period_steps > 0:
        raise ValueError(f"period_steps must be > 0, got {period_steps}")
    return ring_allreduce(model, n, bandwidth) / period_steps


def diloco(
    model: ModelShape,
    n: int,
    bandwidth: float,
    period_steps: float,
    bits: int = 32,
    *,
    by_rows: bool = True,
    small_tensor_numel: int = 1024,
) -> float:
    """Seconds per step of one pseudo-gradient exchange of the whole model every ``period_steps``
    (``diloco``, and ``model_averaging`` / ``bmuf`` at their ``pseudo_grad_bits``), blocking."""
    if not period_steps > 0:
        raise ValueError(f"period_steps must be > 0, got {period_steps}")
    nbytes = exchange_bytes(model.shapes, n, bits, by_rows=by_rows, small_tensor_numel=small_tensor_numel)
    return seconds(nbytes, bandwidth) / period_steps


def powersgd_bytes(shapes: Iterable[tuple[int, ...]], n: int, rank: int, min_compression_rate: float = 2.0) -> int:
    """Bytes one rank sends per step under torch's ``powerSGD_hook`` (past its warm start), the
    model in one DDP bucket.

    Every tensor is viewed as a ``[shape[0], rest]`` matrix with approximation rank
    ``r = min(shape[0], rest, rank)``; it is compressed when ``(rows + cols) r min_compression_rate
    < rows cols`` (torch's ``_should_compress``), else sent whole (vectors always are). Three fp32
    ring all-reduces: the uncompressed tensors, the ``P`` factors (``rows x r``), the ``Q``
    factors (``cols x r``).
    """
    uncompressed = ps = qs = 0
    for shape in shapes:
        rows = shape[0] if len(shape) else 1
        cols = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(rows, cols, rank)
        if (rows + cols) * r * min_compression_rate < rows * cols:
            ps += rows * r
            qs += cols * r
        else:
            uncompressed += rows * cols
    return sum(wire.all_reduce_bytes(k, 4, n) for k in (uncompressed, ps, qs))


def powersgd(model: ModelShape, n: int, bandwidth: float, rank: int = 1, min_compression_rate: float = 2.0) -> float:
    """Seconds per step of DDP with torch's PowerSGD hook at ``rank`` (see :func:`powersgd_bytes`)."""
    return seconds(powersgd_bytes(model.shapes, n, rank, min_compression_rate), bandwidth)
