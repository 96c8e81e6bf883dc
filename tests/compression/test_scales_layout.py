"""Scales per row or per column: the layout's round trip, and why rows suit vocabulary matrices."""

import torch

from lightning_commstrats.compression import ColumnCodec
from lightning_commstrats.compression.aggregation import MatrixLayout, column_major, from_lines


def _roundtrip_error(grad: torch.Tensor, by_rows: bool, bits: int) -> float:
    lay = MatrixLayout.of(grad.shape, 1, by_rows)
    lines = column_major(grad, lay)
    _, deq = ColumnCodec(bits).encode(lines)
    back = from_lines(deq, lay)
    return float((back - grad).norm() / grad.norm())


def test_lines_are_rows_or_columns_and_come_back_in_place():
    g = torch.arange(24.0).reshape(4, 6)
    rows = MatrixLayout.of(g.shape, 2, by_rows=True)
    cols = MatrixLayout.of(g.shape, 2)
    assert (rows.cols, rows.rows, rows.stripes) == (4, 6, ((0, 2), (2, 4)))  # 4 lines of 6 values
    assert (cols.cols, cols.rows, cols.stripes) == (6, 4, ((0, 3), (3, 6)))  # 6 lines of 4 values
    assert torch.equal(column_major(g, rows)[1], g[1])
    assert torch.equal(column_major(g, cols)[1], g[:, 1])
    for lay in (rows, cols):
        assert torch.equal(from_lines(column_major(g, lay), lay), g)


def test_rows_quantize_a_vocabulary_matrix_far_better_than_columns():
    # an embedding's update: rows (words) whose magnitudes span four decades, as frequent and rare words do
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(0, -4, 1000).unsqueeze(1)
    grad = torch.randn(1000, 64, generator=g) * scale
    for bits in (4, 8):
        by_rows, by_cols = _roundtrip_error(grad, True, bits), _roundtrip_error(grad, False, bits)
        assert by_rows < by_cols / 3, (bits, by_rows, by_cols)
