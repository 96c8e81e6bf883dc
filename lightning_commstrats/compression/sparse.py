"""Sparse pseudo-gradients: the top-k values of every chunk, a few bits each, all-gathered (SparseLoCo).

SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025; Covenant-72B, 2026) sends, per chunk of
``chunk`` consecutive values of a matrix, only the ``k`` largest in magnitude (64 of 4096, 1.6%),
each in 2 bits, with their positions; everything not sent stays in an error-feedback buffer that
decays by ``beta`` (0.95) at every round:

    e  = beta * e + G             (G: this rank's pseudo-gradient)
    s  = Q(topk(e))               (what this rank sends)
    e  = e - s                    (what it keeps for later rounds)
    G' = mean over ranks of s     (identical on every rank)

Sparse payloads do not add up inside an all-reduce (the ranks keep different positions), so every
rank's payload is all-gathered and each rank decodes all of them and sums them in rank order: the
average is bit for bit the same everywhere. A rank sends ``(N - 1)`` payloads' worth of bytes in a
ring all-gather, against ``2 (N - 1) / N`` of the model for a dense all-reduce: with ``N`` ranks the
sparse exchange pays ``N^2 / 2`` times its payload's share of the model, which is why the payload
must be tiny.

:class:`TopKCodec` is the pure codec of a block ``[chunks, chunk]``; :class:`SparseAllGather` is the
exchange with its error feedback (rank-local state, keyed by tensor name). No Lightning here.

Wire format of one rank's payload for ``C`` chunks (every rank's has the same size, so a plain
all-gather carries them):

- below 32 bits: ``lo`` then ``hi`` (``C`` float32 each): the smallest and the largest magnitude
  among each chunk's kept values (0 and 0 for a chunk that keeps none);
- the kept positions inside their chunk, Elias-Fano coded (ascending within a chunk): with
  ``l = floor(log2(chunk / k))`` low bits, first the low ``l`` bits of every position (chunk after
  chunk, each packed most significant bit first), then per chunk a bit vector of
  ``k + ((chunk - 1) >> l) + 1`` bits where bit ``(p_i >> l) + i`` is set for the ``i``-th position
  ``p_i`` (chunk after chunk, first bit most significant). ``l + 2`` bits per position at most (8 at
  4096/64: 6 low bits and 2 of the vector, against 12 for a fixed-width index and 32 or 64 for a
  plain int32 or int64 one); the decoder reads the ``i``-th set bit at ``j`` as ``p_i = ((j - i) << l) |
  low_i``. A slot that keeps nothing holds the position ``chunk``, one past the chunk's end (the
  vector has room for it: bit ``(chunk >> l) + i`` is within its length), after every real one: a
  chunk with fewer than ``k`` values that are not zero (exact zeros, or the padding after a
  tensor's end) keeps only those, and its empty slots rebuild as nothing;
- the values: at ``bits`` < 32 one code each, ``bits`` per value packed as
  :func:`~lightning_commstrats.compression.pack_bits` packs them: the high bit is the sign
  (set for negative values), the other ``bits - 1`` bits are the magnitude's bin among ``2^(bits-1)``
  equal bins of ``[lo, hi]`` (the kept values' range, empty slots left out; an empty slot's code is
  0), rebuilt as the bin's centre ``lo + (bin + 0.5) (hi - lo) / 2^(bits-1)``
  (as :class:`~lightning_commstrats.compression.ColumnCodec` computes its grid: ``step = (hi - lo) /
  bins``, ``inv = 1 / step`` or 0, the bin ``(|v| - lo) * inv`` truncated and clamped); at 32 bits the
  float32 values themselves.

At 2 bits a value is its sign and whether its magnitude lies in the upper half of the chunk's kept
range: top-k values have no small magnitudes, so a sign-and-magnitude code spends its levels where
they are (a uniform grid on the signed range, as a dense 2-bit codec uses, would put two of its four
levels in the empty middle). Per kept value at 4096/64/2 bits: 8 + 2 bits plus 1 bit of scales,
about 1/0.0156/11 * 32 = 186 times fewer bits than the dense float32 matrix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_commstrats.buckets import park, visit
from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.quantizers import _view, pack_bits, packed_bytes, unpack_bits

SPARSE_VALUE_BITS = (2, 4, 8, 32)


def elias_fano_bits(chunk: int, k: int) -> tuple[int, int]:
    """``(low, upper)``: the low bits per position and the bits of one chunk's upper-bit vector in
    the Elias-Fano code of ``k`` ascending positions below ``chunk`` (see the module docstring)."""
    low = max(0, (chunk // k).bit_length() - 1)  # floor(log2(chunk / k))
    return low, k + ((chunk - 1) >> low) + 1


PACK_SLICE = 1 << 20  # integers per pass of pack_uint / unpack_uint: bounded scratch memory


def encode_positions(positions: Tensor, chunk: int, k: int) -> Tensor:
    """The Elias-Fano code (``uint8``) of ``[chunks, k]`` positions in ``[0, chunk]``, ascending in each row
    (``chunk``: an empty slot; see the module docstring)."""
    low, upper_bits = elias_fano_bits(chunk, k)
    upper = torch.zeros(positions.shape[0], upper_bits, dtype=torch.uint8, device=positions.device)
    upper.scatter_(1, (positions >> low) + torch.arange(k, device=positions.device), 1)
    vector = pack_bits(upper.view(-1), 1)
    if low == 0:
        return vector
    return torch.cat([pack_uint(positions & ((1 << low) - 1), low), vector])


def positions_bytes(chunks: int, chunk: int, k: int) -> tuple[int, int]:
    """Bytes of the low bits and of the upper-bit vectors of ``chunks`` rows of ``k`` positions below ``chunk``."""
    low, upper_bits = elias_fano_bits(chunk, k)
    return packed_bytes(chunks * k * low, 1), packed_bytes(chunks * upper_bits, 1)


def decode_positions(code: Tensor, chunks: int, chunk: int, k: int) -> Tensor:
    """Inverse of :func:`encode_positions`: the ``[chunks, k]`` positions (int64)."""
    low, upper_bits = elias_fano_bits(chunk, k)
    low_len, upper_len = positions_bytes(chunks, chunk, k)
    upper = unpack_bits(code[low_len : low_len + upper_len], 1, chunks * upper_bits).view(chunks, upper_bits)
    if not bool((upper.sum(1, dtype=torch.int32) == k).all()):
        raise ValueError(f"a payload's positions do not hold {k} per chunk: not made by this codec")
    column = upper.nonzero(as_tuple=True)[1]  # row-major: each chunk's set bits, ascending
    high = column.view(chunks, k) - torch.arange(k, device=code.device)
    if low == 0:
        return high
    return (high << low) | unpack_uint(code[:low_len], low, chunks * k).view(chunks, k)


def select_topk(block: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``(positions, values)``: the ``k`` largest magnitudes of each row of ``block``, positions ascending.
    A kept value that is zero (the row has fewer than ``k`` others) is an empty slot: its position is
    the row's length (after every real one) and its value 0."""
    chunk = block.shape[1]
    positions = block.abs().topk(k, dim=1, sorted=False).indices
    values = block.gather(1, positions)
    positions.masked_fill_(values == 0, chunk)
    positions, order = positions.sort(dim=1)
    return positions, values.gather(1, order).masked_fill_(positions == chunk, 0.0)


def pack_uint(values: Tensor, width: int) -> Tensor:
    """Pack non-negative integers below ``2^width`` (flat) into ``uint8``, ``width`` bits each, most
    significant bit first, one after the other with no padding between them (the last byte is
    zero-padded)."""
    flat = values.reshape(-1).to(torch.int32)
    shifts = torch.arange(width - 1, -1, -1, device=values.device, dtype=torch.int32)
    # slices of PACK_SLICE integers hold a whole number of bytes (PACK_SLICE * width bits)
    parts = [
        pack_bits(((part.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1), 1) for part in flat.split(PACK_SLICE)
    ]
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def unpack_uint(packed: Tensor, width: int, count: int) -> Tensor:
    """Inverse of :func:`pack_uint`: the first ``count`` integers, as int64."""
    out = torch.empty(count, dtype=torch.int64, device=packed.device)
    shifts = torch.arange(width - 1, -1, -1, device=packed.device, dtype=torch.int32)
    step = PACK_SLICE * width // 8  # bytes of a whole slice
    for i, start in enumerate(range(0, count, PACK_SLICE)):
        n = min(PACK_SLICE, count - start)
        bits = unpack_bits(packed[i * step : i * step + -(-n * width // 8)], 1, n * width).to(torch.int32)
        out[start : start + n] = (bits.view(n, width) << shifts).sum(1)
    return out


def check_sparse_args(
    codec: str, chunk: int, k: int, bits: int, decay: float, *, names: tuple[str, str, str, str, str]
) -> None:
    """Construction-time checks of the top-k settings (the bits only with ``codec="topk"``; a decay
    other than 1 only with it or ``codec="statistical"``); ``names`` are the caller's argument names for
    codec, chunk, k, bits, decay."""
    cn, c, kk, b, d = names
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2:
        raise ValueError(f"{c} must be an int >= 2, got {chunk!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk:
        raise ValueError(f"{kk} must be an int in [1, {c}={chunk}], got {k!r}")
    if codec == "topk" and (isinstance(bits, bool) or bits not in SPARSE_VALUE_BITS):
        raise ValueError(
            f"{b}={bits!r} is not supported with sparse pseudo-gradients; choose one of {SPARSE_VALUE_BITS}"
        )
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
        raise ValueError(f"{d} must be a number in (0, 1], got {decay!r}")
    if codec not in ("topk", "statistical") and decay != 1.0:
        raise ValueError(
            f"{d}={decay!r} applies to {cn}='topk' or 'statistical' only (got {cn}={codec!r}): the other codecs"
            " carry their residuals undecayed"
        )


class TopKCodec:
    """Keep the ``k`` largest magnitudes of each row of a ``[chunks, chunk]`` float32 block, in ``bits``
    bits each (see the module docstring for the wire format).

    Args:
        chunk: values per chunk (4096 in SparseLoCo).
        k: values kept per chunk (64 in SparseLoCo).
        bits: 2, 4, 8 (sign and magnitude bin) or 32 (float32 values).
    """

    def __init__(self, chunk: int = 4096, k: int = 64, bits: int = 2) -> None:
        check_sparse_args("topk", chunk, k, bits, 1.0, names=("codec", "chunk", "k", "bits", "decay"))
        self.chunk, self.k, self.bits = chunk, k, bits
        self.low_bits, self.upper_bits = elias_fano_bits(chunk, k)

    def positions_bytes(self, chunks: int) -> tuple[int, int]:
        """Bytes of the low bits and of the upper-bit vectors of ``chunks`` chunks' positions."""
        return positions_bytes(chunks, self.chunk, self.k)

    def payload_bytes(self, chunks: int) -> int:
        """Bytes of the payload of ``chunks`` chunks."""
        kept = chunks * self.k
        scales = 0 if self.bits == 32 else 2 * 4 * chunks
        values = 4 * kept if self.bits == 32 else packed_bytes(kept, self.bits)
        return scales + sum(self.positions_bytes(chunks)) + values

    def encode_positions(self, positions: Tensor) -> Tensor:
        """The Elias-Fano code of ``[chunks, k]`` positions, ascending in each row (``uint8``)."""
        return encode_positions(positions, self.chunk, self.k)

    def decode_positions(self, code: Tensor, chunks: int) -> Tensor:
        """Inverse of :meth:`encode_positions`: the ``[chunks, k]`` positions (int64)."""
        return decode_positions(code, chunks, self.chunk, self.k)

    def encode(self, block: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Returns ``(payload, positions, kept)``: the ``uint8`` payload, the kept positions ``[chunks, k]``
        (int64, ascending in each row; ``chunk`` for an empty slot, after the others) and the values
        the payload rebuilds there (float32; 0 in an empty slot): a chunk with fewer than ``k`` values
        that are not zero keeps only those."""
        if block.dim() != 2 or block.shape[1] != self.chunk or block.dtype != torch.float32:
            raise ValueError(
                f"encode takes a float32 [chunks, {self.chunk}] block, got {tuple(block.shape)} {block.dtype}"
            )
        chunks = block.shape[0]
        positions, values = select_topk(block, self.k)
        index_part = self.encode_positions(positions)
        if self.bits == 32:
            return torch.cat([index_part, values.reshape(-1).view(torch.uint8)]), positions, values
        empty = positions == self.chunk
        codes, lo, hi = self._quantize(values, empty)
        payload = torch.cat([lo.view(torch.uint8), hi.view(torch.uint8), index_part, pack_bits(codes, self.bits)])
        assert payload.numel() == self.payload_bytes(chunks)
        return payload, positions, self._dequantize(codes, lo, hi, empty)

    def decode(self, payloads: Tensor, chunks: int) -> tuple[Tensor, Tensor]:
        """Positions ``[R, chunks, k]`` and values (float32) of ``R`` payloads ``[R, bytes]`` made by
        :meth:`encode`, bit-identical to what :meth:`encode` returned."""
        size = self.payload_bytes(chunks)
        if payloads.dim() != 2 or payloads.shape[1] != size:
            raise ValueError(f"payloads must be [R, {size}] for {chunks} chunks, got {tuple(payloads.shape)}")
        r, kept = payloads.shape[0], chunks * self.k
        scales = 0 if self.bits == 32 else 8 * chunks
        index_len = sum(self.positions_bytes(chunks))
        positions, values = [], []
        for p in payloads.unbind(0):  # R small decodes; each is vectorised over the chunks
            positions.append(self.decode_positions(p[scales : scales + index_len], chunks))
            rest = p[scales + index_len :]
            if self.bits == 32:
                values.append(_view(rest, torch.float32).view(chunks, self.k))
            else:
                lo = _view(p[: 4 * chunks], torch.float32)
                hi = _view(p[4 * chunks : scales], torch.float32)
                codes = unpack_bits(rest, self.bits, kept).view(chunks, self.k)
                values.append(self._dequantize(codes, lo, hi, positions[-1] == self.chunk))
        if not positions:
            empty = torch.empty(r, chunks, self.k)
            return empty.long(), empty
        return torch.stack(positions), torch.stack(values)

    def _quantize(self, values: Tensor, empty: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        magnitude = values.abs()
        # the range of the values kept, empty slots left out (their 0 had stretched it down to 0)
        lo = magnitude.masked_fill(empty, math.inf).amin(1)
        lo = torch.where(empty.all(1), 0.0, lo)
        hi = magnitude.amax(1)  # an empty slot's 0 is never above a kept magnitude
        bins = 1 << (self.bits - 1)
        step = (hi - lo) / bins
        inv = torch.where(step > 0, 1.0 / step, 0.0).unsqueeze(1)
        level = magnitude.sub_(lo.unsqueeze(1)).mul_(inv).clamp_(0, bins - 1).to(torch.uint8)
        sign = (values < 0).to(torch.uint8) << (self.bits - 1)
        return (level | sign).masked_fill_(empty, 0), lo, hi

    def _dequantize(self, codes: Tensor, lo: Tensor, hi: Tensor, empty: Tensor) -> Tensor:
        bins = 1 << (self.bits - 1)
        step = ((hi - lo) / bins).unsqueeze(1)
        magnitude = (codes & (bins - 1)).float().add_(0.5).mul_(step).add_(lo.unsqueeze(1))
        return torch.where(codes >= bins, -magnitude, magnitude).masked_fill_(empty, 0.0)


class SparseAllGather:
    """Average named tensors over ranks from each rank's top-k values per chunk, with decayed error feedback.

    Each tensor's values are cut in chunks of ``codec.chunk`` consecutive values (in memory order;
    the last chunk of a tensor is padded with zeros, never kept across tensors). Per call, for every
    tensor ``G``: ``e = decay * e + G``; the kept values ``s = Q(topk(e))`` go on the wire (one
    all-gather of every rank's payload, all of the call's tensors in one); ``e - s`` is kept as the
    new error feedback once the average is known to be finite. Each rank rebuilds every rank's
    ``s`` and sums them in rank order (bit for bit the same on every rank), then divides by ``N``.

    Args:
        codec: the per-chunk top-k codec.
        comm: the ranks' communicator.
        tag: the traffic tag for :class:`~lightning_commstrats.comm.CommStats`.
        decay: ``beta``, the error-feedback decay (SparseLoCo: 0.95; 1: plain error feedback).

    Attributes:
        residuals: the error-feedback buffer per name (this rank's, the tensor's shape).
    """

    form = "chunks"  # the cut (``topk_form``): runs of ``chunk`` consecutive values
    compresses_alone = False  # TensorExchange skips it on one rank (the average is the tensor itself)

    def __init__(
        self, codec: TopKCodec, comm: Communicator, tag: str = "weights_sparse", *, decay: float = 1.0
    ) -> None:
        self.codec = codec
        self.comm = comm
        self.tag = tag
        self.decay = float(decay)
        self.residuals: dict[str, Tensor] = {}
        self.home: torch.device | None = None  # where the buffer is kept between calls (None: where made)
        self.nonfinite: list[str] = []
        self._pending: dict[str, Tensor] | None = None

    def layout(self, grads: Mapping[str, Tensor]) -> list[tuple[str, int, int]]:
        """``(name, first chunk, chunks)`` of each tensor in the call's block."""
        out, row = [], 0
        for name, g in grads.items():
            chunks = -(-g.numel() // self.codec.chunk)
            out.append((name, row, chunks))
            row += chunks
        return out

    def __call__(self, grads: Mapping[str, Tensor], *, commit: bool = True) -> dict[str, Tensor]:
        """Return the average over ranks of each tensor in ``grads`` (same shapes, float32); with
        ``commit=False`` the new error feedback waits for :meth:`commit`."""
        if not grads:
            return {}
        chunk, n = self.codec.chunk, self.comm.world_size
        layout = self.layout(grads)
        total = sum(c for _, _, c in layout)
        device = next(iter(grads.values())).device
        block = torch.zeros(total, chunk, dtype=torch.float32, device=device)
        flat = block.view(-1)
        for name, row, _ in layout:
            g = grads[name]
            dst = flat[row * chunk : row * chunk + g.numel()]
            res = visit(self.residuals.get(name), device)
            if res is not None and res.shape == g.shape:
                dst.copy_(res.reshape(-1))
                if self.decay != 1.0:
                    dst.mul_(self.decay)
                dst.add_(g.reshape(-1))
            else:
                dst.copy_(g.reshape(-1))
        # a chunk holding an inf or a NaN reaches every rank's average as non-finite with no check here:
        # top-k ranks a NaN above every number and keeps an inf, so its chunk's scales (or values)
        # travel non-finite and rebuild as non-finite values. The padding after a tensor's end is 0:
        # kept only in a chunk with fewer than k other values, as an empty slot (so is a kept 0)
        payload, positions, kept = self.codec.encode(block)
        # what was not sent stays: e - s at the kept positions, e elsewhere. An empty slot (position
        # ``chunk``) adds 0 at the chunk's last value, which changes nothing there
        block.scatter_add_(1, positions.clamp_(max=chunk - 1), kept.neg_())
        everything = self.comm.all_gather(payload, tag=self.tag)
        acc = torch.zeros(total, chunk, dtype=torch.float32, device=device)
        for r in range(n):  # rank order: every rank adds the same values in the same order
            rank_positions, rank_values = self.codec.decode(everything[r : r + 1], total)
            acc.scatter_add_(1, rank_positions[0].clamp_(max=chunk - 1), rank_values[0])
        acc.div_(n)
        acc_flat = acc.view(-1)
        result: dict[str, Tensor] = {}
        new_res: dict[str, Tensor] = {}
        flags: list[Tensor] = []
        for name, row, chunks in layout:
            g = grads[name]
            result[name] = acc_flat[row * chunk : row * chunk + g.numel()].view(g.shape)
            new_res[name] = flat[row * chunk : row * chunk + g.numel()].view(g.shape)
            flags.append(torch.isfinite(acc[row : row + chunks]).all())
        finite = torch.stack(flags).tolist()
        self.nonfinite = [name for (name, _, _), ok in zip(layout, finite, strict=True) if not ok]
        self._pending = None if self.nonfinite else new_res
        if commit:
            self.commit()
        return result

    def commit(self) -> None:
        """Keep the error feedback of the last call (a no-op after a non-finite one)."""
        if self._pending is not None:
            self.residuals.update({n: park(r, self.home) for n, r in self._pending.items()})
            self._pending = None

    def discard(self) -> None:
        """Drop the error feedback of the last call (the old one stays)."""
        self._pending = None

    def rebind(self, comm: Communicator, *, keep_stripes: bool = True) -> None:
        """Exchange over ``comm`` from now on; the error feedback is this rank's own and stays."""
        self.comm = comm
        self._pending = None

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """The error-feedback buffers per tensor name (rank-local)."""
        return {"residuals": dict(self.residuals), "residuals2": {}, "codec": "topk", "form": self.form}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        self.residuals = {n: park(r.float(), self.home) for n, r in state.get("residuals", {}).items()}

    def reset(self) -> None:
        """Forget the error feedback (it restarts at zero)."""
        self.residuals.clear()
