"""A non-finite gradient reaches the quantized all-reduce's average whatever the codec makes of it.

:class:`~lightning_commstrats.compression.QuantizedAllReduce` takes any line codec of its payload layout
(float32 scales per line, then packed codes), and a codec may squash an inf into finite codes: one that
clips its input to a range does. The aggregation does not rely on its codec: a rank whose input holds an
inf or a NaN sends NaN for the whole matrix (a NaN survives a clip), so the average is non-finite on
every rank, the name is reported and no residual moves (the module's documented rule). The package's own
codecs would carry an inf through their scales anyway (1-bit's means, the uniform grid's mean and
standard deviation, E3M0's largest magnitude), so this takes a codec that does not.

Ranks run as threads over ``test_aggregation``'s in-memory communicator.
"""

from __future__ import annotations

import math

import torch
from test_aggregation import ThreadRanks
from torch import Tensor

from lightning_commstrats.compression import ColumnCodec, QuantizedAllReduce


class ClippingCodec(ColumnCodec):
    """The 8-bit uniform grid on its input clipped to [-1, 1] first: an inf is sent as 1, a NaN stays NaN."""

    def encode(self, block: Tensor) -> tuple[Tensor, Tensor]:
        return super().encode(block.clamp(-1.0, 1.0))


def test_the_clipping_codec_squashes_an_inf_into_finite_values():
    _, rebuilt = ClippingCodec(8).encode(torch.tensor([[0.5, math.inf, -0.25, 0.0]]))
    assert torch.isfinite(rebuilt).all()


def test_an_inf_on_one_rank_makes_the_average_non_finite_everywhere_and_keeps_the_residuals():
    ranks = ThreadRanks(2)
    aggregations = [QuantizedAllReduce(ClippingCodec(8), ranks.comm(r)) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    finite = [torch.randn(8, 6, generator=g) * 0.1 for _ in range(2)]
    poisoned = [t.clone() for t in finite]
    poisoned[1][3, 2] = math.inf  # rank 1 only

    def average(grads: list[Tensor]) -> list[Tensor]:
        return ranks.run(lambda r: aggregations[r]({"w": grads[r].clone()})["w"])

    for avg in average(finite):
        assert torch.isfinite(avg).all()
    kept = [{name: r.clone() for name, r in a.residuals.items()} for a in aggregations]
    assert all(bool(k["w"].abs().sum() > 0) for k in kept)  # 8 bits leave a residual to keep

    for r, avg in enumerate(average(poisoned)):
        assert not torch.isfinite(avg).all(), f"rank {r}: the inf on rank 1 was averaged into finite values"
        assert aggregations[r].nonfinite == ["w"]
        assert torch.equal(aggregations[r].residuals["w"], kept[r]["w"]), f"rank {r}: a residual moved"
