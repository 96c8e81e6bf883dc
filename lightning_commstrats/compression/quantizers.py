"""Line-wise gradient quantizers with bit packing: 1-bit SGD's (Seide et al., Interspeech 2014), uniform
n-bit grids, and Streaming DiLoCo's 4-bit float E3M0.

Pure tensor code. A gradient matrix is viewed as ``[rows, cols]`` (a parameter of shape
``(d0, d1, ...)`` as ``[d0, d1 * ...]``; PyTorch's ``Linear.weight`` is ``[out, in]``, so a column
holds every output's weight from one input, as in CNTK). Each column is quantized on its own
(the exchange can also hand rows over as the lines, see
:class:`~lightning_commstrats.compression.MatrixLayout`). :class:`ColumnCodec`:

- **1 bit** (``bits=1``): threshold at 0; the two reconstruction values are the mean of the column's
  non-negative entries and the mean of its negative entries, so the dequantized column keeps the
  column's mean exactly. Wire: 1 bit per value + 2 float32 per column.
- **n bits** (``bits`` in 2, 4, 8): a *uniform* grid. ``[lo, hi]`` is cut into ``2^n`` equal bins
  and a value is sent as its bin and rebuilt as the bin's centre; values outside are clipped.
  ``[lo, hi]`` is the column's ``mean +- k std`` (population std) intersected with its
  ``[min, max]``, with ``k`` = 2, 2.7 and 4 for 2, 4 and 8 bits: the uniform steps that minimise
  the squared error of Gaussian values (Max, 1960). CNTK clips at 4 std for every width, which at
  2 bits loses more than 1-bit quantization does (relative error 0.63 against 0.60 on Gaussian
  columns). In float32, each operation rounded: ``step = (hi - lo) / 2^n``, ``inv = 1 / step`` (0
  when ``step`` is 0), the bin is ``(x - lo) * inv`` truncated and clamped to ``[0, 2^n - 1]``, and
  the rebuilt value ``lo + (bin + 0.5) * step``. Wire: n bits per value + 2 float32 (``lo``, ``hi``) per column.
- **16 bits**: float16 or bfloat16 values, no scales.

:class:`E3M0Codec` is the 4-bit float Streaming DiLoCo sends its outer gradients in (1 sign bit,
3 exponent bits, no mantissa), on one float32 scale per column: ``+-scale * 2^e`` for ``e`` in
-6..0, and zero. Wire: 4 bits per value + 1 float32 per column.

Codes are packed ``8 / bits`` per byte in column-major order into a real ``uint8`` buffer of
``ceil(rows * cols * bits / 8)`` bytes, the first code in the most significant bits (numpy's
``packbits`` for 1 bit on CPU). Error feedback is the caller's: quantize ``g + residual`` and keep
``residual = (g + residual) - dequantized``; encode returns the dequantized block so the residual
needs no second decode, and ``decode`` reproduces it bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

PACKED_BITS = (1, 2, 4, 8)
CODEC_BITS = (1, 2, 4, 8, 16)
CLIP_STDDEVS = {2: 2.0, 4: 2.7, 8: 4.0}
CODECS = ("uniform", "e3m0", "topk", "statistical")
TOPK_BITS = (2, 4, 8, 32)  # the kept values' width with codec="topk" (32: float32 values)
# E3M0's magnitudes, as fractions of the column's scale: code ``e`` in 1..7 is ``2^(e - 7)``, 0 is zero.
# A value ``v = |x| / scale`` is rounded to the nearest one (ties away from zero): its code is the
# number of midpoints at or below ``v`` (2^-7 between 0 and 2^-6, then 0.75 * 2^k between 2^(k-1)
# and 2^k); every midpoint is exact in float32, so the comparison is exact.
E3M0_MIDPOINTS = (2.0**-7, *(0.75 * 2.0**k for k in range(-5, 1)))


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes in ``[0, 2^bits)`` (any integer dtype, flat) into ``uint8``, ``8 / bits`` per byte.

    The first code goes to the most significant bits of the first byte.
    """
    if bits not in PACKED_BITS:
        raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits}")
    per_byte = 8 // bits
    if bits == 1 and codes.device.type == "cpu":
        return torch.from_numpy(np.packbits(codes.reshape(-1).numpy().astype(bool, copy=False)))
    codes = codes.reshape(-1).to(torch.uint8)
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    if per_byte == 1:
        return codes
    groups = codes.view(-1, per_byte)
    out = groups[:, 0] << (8 - bits)
    for i in range(1, per_byte):
        out |= groups[:, i] << (8 - bits * (i + 1))
    return out


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as ``uint8``."""
    if bits not in PACKED_BITS:
        raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits}")
    per_byte = 8 // bits
    if packed.numel() * per_byte < numel:
        raise ValueError(f"{packed.numel()} bytes hold at most {packed.numel() * per_byte} codes, {numel} requested")
    if per_byte == 1:
        return packed[:numel]
    if bits == 1 and packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=numel))
    shifts = torch.arange(8 - bits, -1, -bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.unsqueeze(1) >> shifts) & mask).reshape(-1)[:numel]


def packed_bytes(numel: int, bits: int) -> int:
    return -(-numel * bits // 8)


class ColumnCodec:
    """Quantize blocks of gradient columns, one column at a time, into one ``uint8`` payload.

    A block is passed *column-major*: a contiguous float32 tensor ``[cols, rows]`` whose row ``j`` is
    column ``j`` of the gradient (``grad.t()`` for a ``[rows, cols]`` matrix). Per-column statistics
    are then contiguous reductions, and a range of columns (a stripe) is a contiguous slice.

    Payload layout: the column scales (``2 * cols`` float32; none for 16 bits), then the codes of
    the block in memory order (column after column), packed.

    Args:
        bits: 1, 2, 4, 8 or 16.
        half_dtype: the 16-bit format, ``torch.float16`` (default) or ``torch.bfloat16``.
    """

    def __init__(self, bits: int, half_dtype: torch.dtype = torch.float16) -> None:
        if bits not in CODEC_BITS:
            raise ValueError(f"bits must be one of {CODEC_BITS}, got {bits}")
        if half_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"half_dtype must be torch.float16 or torch.bfloat16, got {half_dtype}")
        self.bits = bits
        self.half_dtype = half_dtype

    def payload_bytes(self, cols: int, rows: int) -> int:
        """Bytes of the payload for ``cols`` columns of ``rows`` values."""
        if self.bits == 16:
            return rows * cols * 2
        return 2 * cols * 4 + packed_bytes(rows * cols, self.bits)

    def encode(self, block: Tensor) -> tuple[Tensor, Tensor]:
        """Quantize a contiguous float32 ``[cols, rows]`` block; returns ``(payload, dequantized)``."""
        if block.dim() != 2 or block.dtype != torch.float32 or not block.is_contiguous():
            raise ValueError(f"encode takes a contiguous 2-D float32 block, got {block.dim()}-D {block.dtype}")
        if self.bits == 16:
            half = block.to(self.half_dtype)
            return half.view(torch.uint8).reshape(-1), half.float()
        codes, scales = self._quantize(block)
        payload = torch.cat([scales.reshape(-1).view(torch.uint8), pack_bits(codes, self.bits)])
        return payload, self._dequantize(codes, scales)

    def decode(self, payload: Tensor, cols: int, rows: int) -> Tensor:
        """The float32 ``[cols, rows]`` block of a payload made by :meth:`encode`, bit-identical."""
        expected = self.payload_bytes(cols, rows)
        if payload.numel() != expected:
            raise ValueError(f"payload has {payload.numel()} bytes, {cols} columns of {rows} need {expected}")
        if self.bits == 16:
            return _view(payload, self.half_dtype).view(cols, rows).float()
        nscale = 2 * cols * 4
        scales = _view(payload[:nscale], torch.float32).view(2, cols)
        codes = unpack_bits(payload[nscale:], self.bits, rows * cols).view(cols, rows)
        return self._dequantize(codes, scales)

    def _quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.bits == 1:
            positive = x >= 0
            npos = positive.sum(1)
            pos_sum = x.clamp(min=0).sum(1)
            pos_mean = pos_sum / npos.clamp(min=1)
            neg_mean = (x.sum(1) - pos_sum) / (x.shape[1] - npos).clamp(min=1)
            return positive, torch.stack([neg_mean, pos_mean])
        bins = 1 << self.bits
        k = CLIP_STDDEVS[self.bits]
        # one pass, without the cancellation of E[x^2] - mean^2 (a row far from zero keeps its spread)
        var, mean = torch.var_mean(x, dim=1, correction=0)
        std = var.sqrt_()
        lo = torch.maximum(mean - k * std, x.amin(1))
        hi = torch.minimum(mean + k * std, x.amax(1))
        step = (hi - lo) / bins
        inv = torch.where(step > 0, 1.0 / step, 0.0).unsqueeze(1)
        # (x - lo) / step, truncated: the bin index (values outside [lo, hi] land in the end bins).
        # Two float32 operations, each rounded: one fused kernel (x * inv - lo * inv) would round once
        # where the CPU or GPU fuses a multiply-add and twice where it does not
        codes = torch.sub(x, lo.unsqueeze(1)).mul_(inv).clamp_(0, bins - 1).to(torch.uint8)
        return codes, torch.stack([lo, hi])

    def _dequantize(self, codes: Tensor, scales: Tensor) -> Tensor:
        # one float32 block, computed in place (the operations and their order are those of the
        # definition, so the values are bit for bit the same)
        values = codes.float()
        if self.bits == 1:
            # lerp returns its end points exactly at weights 0 and 1: the two means, bit for bit
            return torch.lerp(scales[0].unsqueeze(1), scales[1].unsqueeze(1), values, out=values)
        lo, hi = scales[0].unsqueeze(1), scales[1].unsqueeze(1)
        step = (hi - lo) / (1 << self.bits)
        return values.add_(0.5).mul_(step).add_(lo)  # lo + (code + 0.5) * step


class E3M0Codec:
    """Quantize blocks of gradient columns to E3M0, the 4-bit float of Streaming DiLoCo's outer
    gradients (1 sign bit, 3 exponent bits, 0 mantissa bits), one float32 scale per column.

    A column's scale is its largest magnitude, ``max |x|``, so the largest value travels exactly.
    Each value is rounded to the nearest of ``+-scale * 2^e`` (``e`` in -6..0) and zero, ties away
    from zero: ``v = |x| / scale`` in float32, and the 3-bit exponent field is the number of
    midpoints between levels at or below ``v`` (``E3M0_MIDPOINTS``: ``2^-7``, then ``0.75 * 2^k`` for
    ``k`` in -5..0; field 0 is zero, field ``f`` in 1..7 is ``2^(f - 7)``, as a float whose exponent
    field 0 holds no subnormals but zero). The sign bit is
    the code's high bit, set for negative values that do not round to zero (zero is always code 0).
    The rebuilt value is ``scale * (+-2^(f - 7))``, exact in float32 (a power-of-two multiple of the
    scale). A column of zeros has scale 0 and decodes to zeros; a non-finite column has a non-finite
    scale and decodes to non-finite values (inf or NaN), so a poisoned input never looks finite.

    Against the uniform 16-level grid of :class:`ColumnCodec` (``bits=4``): half the scale bytes,
    and the levels are spaced by octaves, so small values keep their relative precision and the
    largest is exact; but there is no level between ``scale / 2`` and ``scale``, and the values
    under ``scale / 128`` are sent as zero (error feedback carries them to the next exchange).
    ``benchmarks/codec_quality.py`` measures both on real pseudo-gradients.

    Payload layout: the column scales (``cols`` float32), then the 4-bit codes of the block in
    memory order (column after column), two per byte, the first in the high nibble.

    Reference: Y. Donchev, A. Douillard et al., "Streaming DiLoCo with overlapping communication:
    Towards a Distributed Free Lunch", 2025 (the outer gradients in E3M0, summed in float32).
    The paper does not say how its values are scaled into E3M0's range; the per-column largest
    magnitude here is this package's choice.
    """

    bits = 4

    def __init__(self) -> None:
        self._levels: dict[torch.device, Tensor] = {}

    def payload_bytes(self, cols: int, rows: int) -> int:
        """Bytes of the payload for ``cols`` columns of ``rows`` values."""
        return cols * 4 + packed_bytes(rows * cols, 4)

    def encode(self, block: Tensor) -> tuple[Tensor, Tensor]:
        """Quantize a contiguous float32 ``[cols, rows]`` block; returns ``(payload, dequantized)``."""
        if block.dim() != 2 or block.dtype != torch.float32 or not block.is_contiguous():
            raise ValueError(f"encode takes a contiguous 2-D float32 block, got {block.dim()}-D {block.dtype}")
        magnitude = block.abs()
        scale = magnitude.amax(1) if block.shape[1] else block.new_zeros(block.shape[0])
        # a zero column divides by 1 (its values are all 0); a NaN scale keeps its column non-finite
        # through the decode (NaN * level), whatever the codes
        divisor = torch.where(scale > 0, scale, 1.0).unsqueeze(1)
        v = magnitude.div_(divisor)
        # the exponent field: how many midpoints lie at or below v (seven comparisons beat a search)
        codes = (v >= E3M0_MIDPOINTS[0]).to(torch.uint8)
        for midpoint in E3M0_MIDPOINTS[1:]:
            codes += v >= midpoint
        codes += ((block < 0) & (codes > 0)).to(torch.uint8) << 3
        payload = torch.cat([scale.view(torch.uint8), pack_bits(codes, 4)])
        return payload, self._dequantize(codes, scale)

    def decode(self, payload: Tensor, cols: int, rows: int) -> Tensor:
        """The float32 ``[cols, rows]`` block of a payload made by :meth:`encode`, bit-identical."""
        expected = self.payload_bytes(cols, rows)
        if payload.numel() != expected:
            raise ValueError(f"payload has {payload.numel()} bytes, {cols} columns of {rows} need {expected}")
        scale = _view(payload[: cols * 4], torch.float32)
        codes = unpack_bits(payload[cols * 4 :], 4, rows * cols).view(cols, rows)
        return self._dequantize(codes, scale)

    def _dequantize(self, codes: Tensor, scale: Tensor) -> Tensor:
        levels = self._levels.get(codes.device)
        if levels is None:  # the 16 codes' values on the unit scale: +-2^(f - 7), and zeros
            magnitudes = [0.0, *(2.0 ** (f - 7) for f in range(1, 8))]
            levels = self._levels[codes.device] = torch.tensor(
                magnitudes + [-m for m in magnitudes], device=codes.device
            )
        return levels.index_select(0, codes.reshape(-1).int()).view(codes.shape).mul_(scale.unsqueeze(1))


def make_codec(codec: str, bits: int, half_dtype: torch.dtype = torch.float16) -> ColumnCodec | E3M0Codec:
    """The line codec named ``codec`` (``"uniform"`` or ``"e3m0"``) at ``bits`` bits per value."""
    check_codec(codec, bits)
    if codec == "topk":
        raise ValueError("codec='topk' is not a line codec: it is compression.sparse.TopKCodec")
    if codec == "statistical":
        raise ValueError("codec='statistical' is not a line codec: it is compression.density.StatisticalAllGather")
    return E3M0Codec() if codec == "e3m0" else ColumnCodec(bits, half_dtype)


def check_codec(codec: str, bits: int, *, name: str = "codec", bits_name: str = "bits") -> None:
    """Raise ``ValueError`` unless ``codec`` is one of :data:`CODECS` and ``bits`` suits it (E3M0: 4 only;
    top-k: :data:`TOPK_BITS`; statistical: 2, 4, 8);
    ``name`` and ``bits_name`` are the caller's argument names."""
    if codec not in CODECS:
        raise ValueError(f"{name}={codec!r} is not supported; choose one of {CODECS}")
    if codec == "e3m0" and bits != 4:
        raise ValueError(f"{name}='e3m0' is a 4-bit format: it needs {bits_name}=4, got {bits_name}={bits!r}")
    if codec == "statistical" and bits not in (2, 4, 8):
        raise ValueError(
            f"{name}='statistical' sends every value in (2, 4, 8) bits ({bits_name}), got {bits_name}={bits!r}"
        )
    if codec == "topk" and bits not in TOPK_BITS:
        raise ValueError(
            f"{name}='topk' sends its kept values in {TOPK_BITS} bits ({bits_name}), got {bits_name}={bits!r}"
        )


def _view(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """Reinterpret bytes as ``dtype``; a slice at an unaligned offset is copied first."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if raw.storage_offset() % itemsize:
        raw = raw.clone()
    return raw.view(dtype)
