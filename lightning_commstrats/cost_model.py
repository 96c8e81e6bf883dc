"""Predicted communication time per training step, per scheme, from the model and the link rate.

Pure Python. Every function returns seconds per optimizer step for ``n`` ranks whose links carry
``bandwidth`` bits per second in each direction (full duplex), ignoring latency and assuming the
link is the only bottleneck (compute and communication do not overlap in this package's
strategies). Bytes come from :mod:`lightning_commstrats.comm.wire`, so a prediction is the same
number the strategies count, divided by the rate.

- parameter server: ``2 n K / B`` (the 2018 NLM paper's model: the server's link carries ``n``
  gradients in and ``n`` models out per step);
- ring all-reduce: ``2 (n-1) K / (n B)``;
- 1-bit (n-bit) SGD: the ring volume of the quantized matrices (bits per value + two floats per
  column and stripe) plus the ring all-reduce of the small tensors;
- sampled rows: the ring all-reduce of the selected rows of the vocabulary matrices and of the
  rest of the model, plus the all-gather of the word ids;
- periodic (model averaging, BMUF, local SGD): the model's ring all-reduce divided by the period.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_commstrats.comm import wire
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


def parameter_server(model: ModelShape, n: int, bandwidth: float) -> float:
    return seconds(2 * n * model.numel * 4, bandwidth)


def ring_allreduce(model: ModelShape, n: int, bandwidth: float) -> float:
    return seconds(wire.all_reduce_bytes(model.numel, 4, n), bandwidth)


def quantized_bytes(shapes: Iterable[tuple[int, ...]], n: int, bits: int) -> int:
    """Bytes rank 0 sends per step in the two-stage quantized all-reduce of these matrices."""
    total = 0
    for shape in shapes:
        rows, cols = shape[0], math.prod(shape[1:])
        width = -(-cols // n)
        stripes = [max(0, min((k + 1) * width, cols) - k * width) for k in range(n)]
        per_stripe = [0 if c == 0 else ColumnCodec(bits).payload_bytes(c, rows) for c in stripes]
        # stage 1 sends every stripe but its own; stage 2 all-gathers the largest (padded) payload
        total += sum(per_stripe) - per_stripe[0] + (n - 1) * max(per_stripe)
    return total


def onebit(model: ModelShape, n: int, bandwidth: float, bits: int = 1, small_tensor_numel: int = 1024) -> float:
    if n == 1:
        return 0.0
    large = [s for s in model.shapes if len(s) >= 2 and math.prod(s) > small_tensor_numel]
    small = sum(math.prod(s) for s in model.shapes if s not in large)
    return seconds(quantized_bytes(large, n, bits) + wire.all_reduce_bytes(small, 4, n), bandwidth)


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
