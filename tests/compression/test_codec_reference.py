"""The codecs against reference encoders written here from their definitions, bit for bit.

Each reference works on one line (a row of the ``[lines, values]`` block) at a time in numpy, and
packs the codes by hand; the package's payload bytes and dequantized block must equal it exactly.
The uniform grid's two scales come from a mean and a standard deviation, whose float32 sums run in
an order of torch's choosing: the reference computes them exactly (float64) and checks the sent
scales to a few float32 rounding steps, then rebuilds everything else from the *sent* scales, bit
for bit. E3M0's scale is a maximum, exact, so its whole payload is rebuilt independently.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression import ColumnCodec, E3M0Codec, TensorExchange

F32 = np.float32
CLIP = {2: 2.0, 4: 2.7, 8: 4.0}  # the uniform grid's [lo, hi] = mean +- CLIP std, within [min, max]


def pack(codes: list[int], bits: int) -> bytes:
    """``8 / bits`` codes per byte, the first code in the most significant bits, the last byte zero-padded."""
    per_byte = 8 // bits
    out = bytearray(math.ceil(len(codes) * bits / 8))
    for i, code in enumerate(codes):
        assert 0 <= code < 1 << bits
        out[i // per_byte] |= code << (8 - bits * (i % per_byte + 1))
    return bytes(out)


def floats(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def lines_of(block: torch.Tensor) -> list[np.ndarray]:
    return [row.astype(F32) for row in block.numpy()]


# ---------------------------------------------------------------- the uniform grid (and 1 bit)


def exact_uniform_scales(line: np.ndarray, bits: int) -> tuple[float, float]:
    """``[lo, hi]`` of the definition, in float64: ``mean +- k std`` (population std) within ``[min, max]``."""
    x = line.astype(np.float64)
    mean = x.mean()
    std = math.sqrt(((x - mean) ** 2).mean())
    return max(mean - CLIP[bits] * std, x.min()), min(mean + CLIP[bits] * std, x.max())


def uniform_line(line: np.ndarray, lo: np.float32, hi: np.float32, bits: int) -> tuple[list[int], np.ndarray]:
    """Codes and rebuilt values of one line on the grid ``[lo, hi]``, in float32 as the definition says:
    ``step = (hi - lo) / 2^bits``, ``inv = 1 / step`` (0 for a zero step), bin = ``(x - lo) * inv``
    (each operation rounded) truncated into ``[0, 2^bits - 1]``, rebuilt as ``lo + (bin + 0.5) * step``."""
    levels = 1 << bits
    step = F32(F32(hi - lo) / F32(levels))
    inv = F32(1) / step if step > 0 else F32(0)
    codes, rebuilt = [], np.empty(len(line), dtype=F32)
    for i, x in enumerate(line):
        t = F32(F32(x - lo) * inv)
        code = min(max(math.trunc(float(t)), 0), levels - 1)
        codes.append(code)
        rebuilt[i] = F32(lo + F32(F32(F32(code) + F32(0.5)) * step))
    return codes, rebuilt


def one_bit_line(line: np.ndarray) -> tuple[float, float, list[int]]:
    """The exact means of the negative and the non-negative values (0 for none), and the sign codes."""
    x = line.astype(np.float64)
    neg, pos = x[x < 0], x[x >= 0]
    return (neg.mean() if neg.size else 0.0), (pos.mean() if pos.size else 0.0), [int(v >= 0) for v in line]


def check_uniform(block: torch.Tensor, bits: int) -> None:
    codec = ColumnCodec(bits)
    payload, deq = codec.encode(block)
    cols, rows = block.shape
    sent = payload.numpy().tobytes()
    scales = np.frombuffer(sent[: 8 * cols], dtype="<f4").reshape(2, cols)  # lo of every line, then hi
    codes, rebuilt = [], []
    for j, line in enumerate(lines_of(block)):
        lo, hi = scales[0, j], scales[1, j]
        if bits == 1:
            neg, pos, line_codes = one_bit_line(line)
            exact = (neg, pos)
            values = np.where(np.array(line_codes) == 1, hi, lo).astype(F32)  # lo = negative mean, hi = positive
        else:
            exact = exact_uniform_scales(line, bits)
            line_codes, values = uniform_line(line, lo, hi, bits)
            assert line.min() <= lo <= hi <= line.max(), (j, lo, hi)
        # the sent scales: a few float32 rounding steps from the exact ones (sums in torch's order)
        spread = float(np.abs(line.astype(np.float64)).max())
        for got, want in zip((lo, hi), exact, strict=True):
            assert abs(float(got) - want) <= 1e-6 * spread, (j, float(got), want)
        if bits > 1 and line.min() == line.max():  # a constant line: an empty grid at its value
            assert lo == hi == line[0]
        codes += line_codes
        rebuilt.append(values)
    assert sent == scales.tobytes() + pack(codes, bits)
    expected = torch.from_numpy(np.stack(rebuilt)) if rebuilt else torch.empty(cols, rows)
    assert torch.equal(deq, expected)
    assert torch.equal(codec.decode(payload, cols, rows), expected)


def edge_blocks(seed: int) -> list[torch.Tensor]:
    """Blocks of lines that are random at several scales, constant, zero, negative only, with an outlier,
    or too short for statistics."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for length in (1, 2, 3, 5, 16, 33, 257, 1000):
        lines = [torch.randn(length, generator=g) * s for s in (1e-15, 1e-3, 1.0, 7.0, 1e12)]
        lines += [
            torch.full((length,), 0.1),
            torch.full((length,), -3.3e9),
            torch.zeros(length),
            -torch.rand(length, generator=g) * 1e-4,  # negative only
            torch.rand(length, generator=g) + 100.0,  # positive, far from zero
            torch.randn(length, generator=g).exp() * torch.randn(length, generator=g),  # heavy tails
        ]
        outlier = torch.randn(length, generator=g)
        outlier[length // 2] = 1e4
        lines.append(outlier)
        blocks.append(torch.stack(lines).contiguous())
    return blocks


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_uniform_codec_equals_the_reference_bit_for_bit(bits):
    for seed in range(2):
        for block in edge_blocks(seed):
            check_uniform(block, bits)


def test_uniform_codes_sit_at_the_grid_boundaries_as_defined():
    # values exactly on the bin boundaries of a grid whose float32 arithmetic is exact: lo = -8, hi = 8
    # (the line's min and max; mean +- 2.7 std lies beyond them), step 1 at 4 bits
    line = torch.tensor([-8.0, 8.0, *[float(v) for v in range(-8, 9)], -7.5, 7.999, -0.0])
    block = torch.stack([line, line.flip(0)]).contiguous()
    check_uniform(block, 4)
    _, deq = ColumnCodec(4).encode(block)
    # bin k holds [lo + k step, lo + (k + 1) step): a boundary value opens the bin above it; hi is clipped into the last
    assert deq[0, :19].tolist() == [-7.5, 7.5, *[min(v + 0.5, 7.5) for v in range(-8, 9)]]
    # the bin is (x - lo) * inv with both operations rounded: here 5.0 exactly, where one fused
    # x * inv - lo * inv gives 4.9999995 (the grid is the line's [min, max])
    lo, hi, x = -1.1594513654708862, 2.419018507003784, -0.04117954894900322
    block = torch.tensor([[lo, hi, x]])
    check_uniform(block, 4)
    step = (hi - lo) / 16
    assert ColumnCodec(4).encode(block)[1][0, 2].item() == pytest.approx(lo + 5.5 * step, rel=1e-6)


# ---------------------------------------------------------------- E3M0


def e3m0_line(line: np.ndarray) -> tuple[np.float32, list[int], np.ndarray]:
    """Scale, codes and rebuilt values of one line in E3M0, from the definition: ``v = |x| / max|x|``
    (float32), rounded to the nearest of 0 and 2^-6 ... 2^0 (ties to the larger); code = sign bit
    (8, for a negative value not rounded to zero) + exponent field (0 for zero, e + 7 for 2^e)."""
    scale = F32(np.abs(line).max()) if line.size else F32(0)
    levels = [0.0] + [2.0**e for e in range(-6, 1)]
    codes, rebuilt = [], np.empty(len(line), dtype=F32)
    for i, x in enumerate(line):
        v = float(F32(abs(x)) / scale) if scale > 0 else 0.0
        distances = [abs(v - level) for level in levels]  # exact in float64
        field = max(f for f in range(8) if distances[f] == min(distances))  # ties: the larger level
        negative = x < 0 and field > 0
        codes.append(8 * negative + field)
        rebuilt[i] = F32(scale * F32(-levels[field] if negative else levels[field]))
    return scale, codes, rebuilt


def check_e3m0(block: torch.Tensor) -> None:
    codec = E3M0Codec()
    payload, deq = codec.encode(block)
    cols, rows = block.shape
    scales, codes, rebuilt = [], [], []
    for line in lines_of(block):
        scale, line_codes, values = e3m0_line(line)
        scales.append(scale)
        codes += line_codes
        rebuilt.append(values)
    assert payload.numpy().tobytes() == floats(scales) + pack(codes, 4)
    expected = torch.from_numpy(np.stack(rebuilt))
    assert torch.equal(deq, expected)
    assert torch.equal(codec.decode(payload, cols, rows), expected)


def test_e3m0_codec_equals_the_reference_bit_for_bit():
    for seed in range(2):
        for block in edge_blocks(seed):
            check_e3m0(block)
    g = torch.Generator().manual_seed(2)
    tiny_and_huge = torch.stack([(torch.rand(64, generator=g) * 2 - 1) * s for s in (1e-37, 1e-30, 1e30, 3e38)])
    check_e3m0(tiny_and_huge.contiguous())


def test_e3m0_rounds_to_the_nearest_level_ties_away_from_zero():
    # scale 1: the midpoints 2^-7 (between 0 and 2^-6) and 0.75 * 2^k are ties and go up; just below, down
    below = float(np.nextafter(F32(0.75), F32(0)))
    line = torch.tensor([1.0, 0.75, below, -0.375, 2.0**-7, float(np.nextafter(F32(2.0**-7), F32(0))), 0.6, -1e-3])
    block = line.unsqueeze(0).contiguous()
    check_e3m0(block)
    _, deq = E3M0Codec().encode(block)
    assert deq[0].tolist() == [1.0, 1.0, 0.5, -0.5, 2.0**-6, 0.0, 0.5, -0.0]
    assert not math.copysign(1.0, deq[0, -1].item()) < 0  # a value rounded to zero is +0: code 0, not 8
    # v is |x| / scale, one rounding: 45.75 / 61 is 0.75 exactly (a tie, up), 45.75 * (1 / 61) is just below
    block = torch.tensor([[61.0, 45.75]])
    check_e3m0(block)
    assert E3M0Codec().encode(block)[1].tolist() == [[61.0, 61.0]]


def test_e3m0_payload_is_half_a_byte_per_value_and_one_float_per_line():
    codec = E3M0Codec()
    for cols, rows in ((1, 1), (3, 7), (16, 32), (5, 1001)):
        payload, _ = codec.encode(torch.randn(cols, rows))
        assert payload.dtype == torch.uint8
        assert payload.numel() == 4 * cols + math.ceil(cols * rows / 2) == codec.payload_bytes(cols, rows)


def test_e3m0_non_finite_lines_decode_non_finite():
    block = torch.randn(3, 20)
    block[0, 3], block[1, 7] = math.nan, math.inf
    payload, deq = E3M0Codec().encode(block)
    assert not torch.isfinite(deq[0]).any() and not torch.isfinite(deq[1]).all()
    assert torch.isfinite(deq[2]).all()
    assert torch.equal(E3M0Codec().decode(payload, 3, 20).isnan(), deq.isnan())


@pytest.mark.parametrize("codec", [ColumnCodec(4), E3M0Codec()], ids=["uniform", "e3m0"])
def test_error_feedback_sends_everything_over_time(codec):
    # what is sent over T rounds is the sum of the inputs minus the last residual: nothing is lost
    g = torch.Generator().manual_seed(0)
    residual = torch.zeros(6, 50)
    sent = torch.zeros(6, 50, dtype=torch.float64)
    true = torch.zeros(6, 50, dtype=torch.float64)
    for _ in range(40):
        grad = torch.randn(6, 50, generator=g) * torch.logspace(-3, 1, 6).unsqueeze(1)
        v = grad + residual
        payload, deq = codec.encode(v)
        residual = v - deq
        sent += codec.decode(payload, 6, 50).double()
        true += grad.double()
    torch.testing.assert_close(sent, true - residual.double(), rtol=0, atol=1e-4)
    # and the residual stays about one quantization error, relative to each line's scale
    assert (residual.abs().amax(1) / torch.logspace(-3, 1, 6)).max() < 1.5


# ---------------------------------------------------------------- choosing the codec


class Alone(Communicator):
    """Rank 0 of 2 that never talks: enough to build an exchange."""

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=2)

    def _silent(self, *args):
        raise AssertionError("no collective expected")

    _all_reduce = _reduce_scatter = _all_gather = _all_to_all = _broadcast = _barrier = _silent


def test_the_exchange_builds_the_codec_it_is_asked_for():
    assert isinstance(TensorExchange(Alone(), 4, codec="e3m0").quantized.codec, E3M0Codec)
    uniform = TensorExchange(Alone(), 4).quantized.codec
    assert isinstance(uniform, ColumnCodec) and uniform.bits == 4
    with pytest.raises(
        ValueError, match=r"codec='fp4' is not supported; choose one of \('uniform', 'e3m0', 'topk', 'statistical'\)"
    ):
        TensorExchange(Alone(), 4, codec="fp4")
    for bits in (2, 8, 16, 32):
        with pytest.raises(ValueError, match=f"codec='e3m0' is a 4-bit format: it needs bits=4, got bits={bits}"):
            TensorExchange(Alone(), bits, codec="e3m0")
