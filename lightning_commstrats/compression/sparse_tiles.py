"""SparseLoCo as published: top-k per 2-D tile, a statistical quantizer with a per-tensor lookup, error
feedback for every tensor, whatever the number of replicas.

The paper (Sarfi, Thérien, Lidin, Belilovsky 2025) and Covenant's public training code describe it
(the facts below come from there; the code is this package's own):

- every tensor is sent sparse, with its own error-feedback buffer ``e = beta e + G`` (0.95);
- a matrix is cut in 2-D tiles of up to ``tile x tile`` values (64 x 64); a vector in runs of up to
  ``tile`` values; from each tile the ``k`` values of largest magnitude in ``e`` are kept (64, 1.6%
  of a 64 x 64 tile; every value of a tile of at most ``k``);
- the kept values of a tensor are quantized on a statistical grid: centred on their mean ``mu``,
  cut into ``2^bits`` bins of ``sigmas * std / 2^bits`` (``std`` their standard deviation, ``n - 1``
  in the denominator; 4 bins over 6 standard deviations at 2 bits, each 1.5 wide), the code of a
  value ``round((v - mu) / width + 2^bits / 2)`` clamped to ``[0, 2^bits)`` (so bin ``2^bits / 2`` is
  centred on ``mu``); each bin is decoded as the mean of the values that fell in it, a lookup of
  ``2^bits`` float32 per tensor sent with the payload;
- ``e`` loses what was sent (its decoded values); every rank's payload is all-gathered and the
  average of the decoded values ``(1/N) sum_r s_r`` is the outer step's pseudo-gradient.

Tiles always divide their tensor: a side is the largest divisor of that dimension not above
``tile`` (the public code's rule), so a 10000 x 256 embedding goes in tiles of 50 x 64, a 1024-value
bias in runs of 64. A dimension with no divisor near ``tile`` gets thin tiles that keep a larger
share of their values (a prime dimension: tiles one row high, every value kept);
:func:`tile_spec` says what a shape gets. Tensors of more than two dimensions are cut as the matrix
of their first dimension by the rest. With ``shard="fsdp"`` a rank tiles its own shard (a slice of
the first dimension), so its tiles are not an unsharded run's.

Where this package differs from the public code: positions inside a tile travel Elias-Fano coded
(:func:`~lightning_commstrats.compression.sparse.encode_positions`: 8 bits each at 64 of 4096,
where that code packs 12), ``k`` is not rounded down to an even number (that was for its 12-bit
packing), the statistics are computed in float64 (the lookup travels as float32), a kept exact zero
is an empty slot that rebuilds as nothing and is left out of the statistics (the public code would
decode it as its bin's mean), and the average is the plain mean over ranks (the public code's
miners average the values sent at a position over the peers that sent it, and clip each peer's
norm to the median's; the paper's algorithm is the plain mean).

A tile that keeps every one of its values (it holds at most ``k``: a bias's runs, or every tile
when ``k`` is the whole tile, a dense sync of a density schedule or the dense codec of
:mod:`~lightning_commstrats.compression.density`) sends no positions: its values travel in order,
and an exact zero among them is a value like any other (quantized, its error kept).

Wire format of one rank's payload (every rank's has the same size: it depends on the shapes and
``k`` only, and ``k`` is the same on every rank at a sync): the lookups (``T x 2^bits`` float32,
tensor after tensor; none at 32 bits), then for each group of tensors whose tiles hold the same
number of values (in the order of their first tensor) and keep fewer than all of them the
Elias-Fano code of its tiles' positions (tile after tile, tensor after tensor), then every kept
value's code, ``bits`` each, packed as :func:`~lightning_commstrats.compression.pack_bits` packs
them, group after group (at 32 bits the float32 values instead). Per 64 x 64 tile at the defaults:
64 bytes of positions and 16 of codes, 80 bytes for 16 KiB of float32 (205 times fewer), plus 16
bytes per tensor; a tile kept whole: 1,024 bytes of codes (16 times fewer).

No Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_commstrats.buckets import visit
from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.quantizers import _view, pack_bits, packed_bytes, unpack_bits
from lightning_commstrats.compression.sparse import (
    SparseAllGather,
    decode_positions,
    encode_positions,
    positions_bytes,
    select_topk,
)

TOPK_FORMS = ("chunks", "published")


def check_tiles_args(
    codec: str, form: str, tile: int, k: int, sigmas: float, *, names: tuple[str, str, str, str, str]
) -> None:
    """Construction-time checks of the sparse form's settings; ``names`` are the caller's argument names
    for codec, form, tile, k and sigmas."""
    cn, fn, tn, kn, sn = names
    if form not in TOPK_FORMS:
        raise ValueError(f"{fn}={form!r} is not supported; choose one of {TOPK_FORMS}")
    if form != "chunks" and codec != "topk":
        raise ValueError(f"{fn}={form!r} applies to {cn}='topk' only (got {cn}={codec!r})")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"{tn} must be an int >= 1 (the largest side of a tile), got {tile!r}")
    if form == "published" and not isinstance(k, bool) and isinstance(k, int) and k > tile * tile:
        raise ValueError(f"{kn} must be an int in [1, {tn}^2={tile * tile}] (values kept per tile), got {k!r}")
    if isinstance(sigmas, bool) or not isinstance(sigmas, (int, float)) or not 0 < sigmas < math.inf:
        raise ValueError(f"{sn} must be a number > 0 (the quantizer's width in standard deviations), got {sigmas!r}")


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` (>= 1) that is at most ``limit`` (>= 1)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


@dataclass(frozen=True)
class TileSpec:
    """How a tensor is cut: viewed as a ``rows x cols`` matrix, in tiles of ``a x b`` values."""

    rows: int
    cols: int
    a: int
    b: int

    @property
    def numel(self) -> int:
        """Values per tile."""
        return self.a * self.b

    @property
    def tiles(self) -> int:
        return (self.rows // self.a) * (self.cols // self.b)


def tile_spec(shape: tuple[int, ...] | torch.Size, tile: int) -> TileSpec:
    """The tiles of a tensor of ``shape``: a matrix (or the first dimension by the rest) in tiles whose
    sides are the largest divisors of its dimensions not above ``tile``; a vector (or a scalar) as one
    row, in runs of up to ``tile`` values."""
    shape = tuple(shape)
    if len(shape) < 2:
        cols = math.prod(shape)
        return TileSpec(1, cols, 1, largest_divisor(cols, tile))
    rows, cols = shape[0], math.prod(shape[1:])
    return TileSpec(rows, cols, largest_divisor(rows, tile), largest_divisor(cols, tile))


def thin_tiles(shapes: Mapping[str, tuple[int, ...] | torch.Size], tile: int, k: int) -> list[str]:
    """A line for each tensor of two or more dimensions whose tiles keep more than twice the share of a
    full ``tile x tile`` tile (its dimensions have no divisor near ``tile``): what it gets instead."""
    full = min(k, tile * tile) / (tile * tile)
    lines = []
    for name, shape in shapes.items():
        spec = tile_spec(shape, tile)
        kept = min(k, spec.numel) / spec.numel
        if len(shape) >= 2 and kept > 2 * full:
            lines.append(
                f"{name} {tuple(shape)}: tiles of {spec.a} x {spec.b} keep {min(k, spec.numel)} of {spec.numel}"
                f" values ({kept:.1%}, against {full:.1%} in a full tile)"
            )
    return lines


def to_tiles(t: Tensor, spec: TileSpec, out: Tensor) -> None:
    """Copy ``t`` into ``out`` (``[spec.tiles, spec.numel]``), one tile per row, tiles in row-major order."""
    a, b = spec.a, spec.b
    src = t.reshape(spec.rows // a, a, spec.cols // b, b).permute(0, 2, 1, 3)
    out.view(spec.rows // a, spec.cols // b, a, b).copy_(src)


def from_tiles(tiles: Tensor, spec: TileSpec) -> Tensor:
    """Inverse of :func:`to_tiles`: the ``rows x cols`` matrix (a new tensor)."""
    a, b = spec.a, spec.b
    return tiles.reshape(spec.rows // a, spec.cols // b, a, b).permute(0, 2, 1, 3).reshape(spec.rows, spec.cols)


class StatisticalQuantizer:
    """The published quantizer of the kept values: per tensor, ``2^bits`` bins of ``sigmas * std / 2^bits``
    around the values' mean, each decoded as the mean of the values in it (see the module docstring).

    Args:
        bits: 2 (4 bins, the paper's), 4 or 8.
        sigmas: the bins' total width in standard deviations (6).
    """

    def __init__(self, bits: int = 2, sigmas: float = 6.0) -> None:
        self.bits, self.sigmas = bits, float(sigmas)
        self.bins = 1 << bits

    def quantize(self, values: Tensor, ids: Tensor, empty: Tensor, tensors: int) -> tuple[Tensor, Tensor]:
        """``(codes, levels)`` of flat float32 ``values`` of tensor ``ids`` (int64, in ``[0, tensors)``);
        ``empty`` marks slots left out (code 0). ``levels``: ``[tensors, 2^bits]`` float32, what each
        code decodes to."""
        bins = self.bins
        real = (~empty).double()
        v = values.double().masked_fill_(empty, 0.0)
        count = v.new_zeros(tensors).index_add_(0, ids, real)
        mean = v.new_zeros(tensors).index_add_(0, ids, v).div_(count.clamp(min=1.0))
        centred = v.sub_(mean[ids]).masked_fill_(empty, 0.0)
        spread = v.new_zeros(tensors).index_add_(0, ids, centred.square())
        # one value (or none): no spread, any width puts it in the middle bin, decoded as itself
        width = spread.div_((count - 1).clamp(min=1.0)).sqrt_().mul_(self.sigmas / bins)
        width = torch.where(torch.isfinite(width) & (width > 0), width, 1.0)
        codes = centred.div(width[ids]).add_(bins // 2).round_().clamp_(0, bins - 1)
        codes = torch.where(torch.isnan(codes), 0.0, codes).to(torch.uint8).masked_fill_(empty, 0)
        slot = ids * bins + codes.long()
        sums = v.new_zeros(tensors * bins).index_add_(0, slot, centred)
        counts = v.new_zeros(tensors * bins).index_add_(0, slot, real)
        levels = torch.where(counts > 0, sums / counts.clamp(min=1.0), 0.0).view(tensors, bins)
        return codes, levels.add_(mean.unsqueeze(1)).float()

    def decode(self, codes: Tensor, ids: Tensor, levels: Tensor, empty: Tensor) -> Tensor:
        """The float32 values ``codes`` of tensor ``ids`` stand for (0 in an empty slot)."""
        return levels.reshape(-1)[ids * self.bins + codes.long()].masked_fill_(empty, 0.0)


@dataclass
class _Plan:
    """How a call's tensors are cut and grouped (it depends on their names and shapes only)."""

    specs: list[TileSpec]
    group_of: list[int]  # each tensor's group
    first_row: list[int]  # each tensor's first tile in its group's block
    groups: list[tuple[int, int, int]]  # (values per tile, kept per tile, tiles) of each group
    ids: dict[torch.device, Tensor]  # the tensor of every kept value, group after group

    @staticmethod
    def whole(group: tuple[int, int, int]) -> bool:
        """Whether a group's tiles keep every value (no top-k, no positions on the wire)."""
        return group[1] == group[0]

    def value_ids(self, device: torch.device) -> Tensor:
        if device not in self.ids:
            rows = [[] for _ in self.groups]
            for t, (spec, g) in enumerate(zip(self.specs, self.group_of, strict=True)):
                rows[g].append(torch.full((spec.tiles * self.groups[g][1],), t, dtype=torch.int64))
            self.ids[device] = torch.cat([x for r in rows for x in r]).to(device)
        return self.ids[device]


class TiledSparseAllGather(SparseAllGather):
    """Average named tensors over ranks from each rank's top-k values per 2-D tile, quantized on the
    statistical grid with a per-tensor lookup, with decayed error feedback for every tensor (SparseLoCo
    as published; see the module docstring). Also on one rank, or a quorum of one replica: the same
    top-k and error feedback whatever the number of replicas.

    Args:
        comm: the ranks' communicator.
        tile: the largest side of a tile (64).
        k: values kept per tile (64; all of a tile of at most ``k`` values). An attribute a caller
            may change between calls (a density schedule), the same on every rank at each call.
        bits: 2, 4, 8 (the statistical grid's ``2^bits`` bins) or 32 (float32 values).
        sigmas: the grid's width in standard deviations (6).
        tag: the traffic tag for :class:`~lightning_commstrats.comm.CommStats`.
        decay: ``beta``, the error-feedback decay (0.95 in the paper).

    Attributes:
        residuals: the error-feedback buffer per name (this rank's, the tensor's shape).
    """

    form = "published"
    compresses_alone = True

    def __init__(
        self,
        comm: Communicator,
        *,
        tile: int = 64,
        k: int = 64,
        bits: int = 2,
        sigmas: float = 6.0,
        tag: str = "weights_sparse",
        decay: float = 1.0,
    ) -> None:
        # the error-feedback bookkeeping (commit, discard, state) is SparseAllGather's; the codec is this one's
        self.codec = None
        self.comm, self.tag, self.decay = comm, tag, float(decay)
        self.tile, self.k, self.bits = tile, k, bits
        self.quantizer = StatisticalQuantizer(bits, sigmas) if bits < 32 else None
        self.residuals: dict[str, Tensor] = {}
        self.home: torch.device | None = None
        self.nonfinite: list[str] = []
        self._pending: dict[str, Tensor] | None = None
        self._plans: dict[tuple[tuple[int, ...] | int, ...], _Plan] = {}

    def plan(self, shapes: list[tuple[int, ...]]) -> _Plan:
        """The tiles and groups of tensors of ``shapes`` (in call order), made once per layout and ``k``."""
        key = (*shapes, self.k)
        if key not in self._plans:
            specs = [tile_spec(s, self.tile) for s in shapes]
            sizes: list[int] = []
            groups: list[tuple[int, int, int]] = []
            group_of, first_row = [], []
            for spec in specs:
                if spec.numel not in sizes:
                    sizes.append(spec.numel)
                    groups.append((spec.numel, min(self.k, spec.numel), 0))
                g = sizes.index(spec.numel)
                numel, k, rows = groups[g]
                group_of.append(g)
                first_row.append(rows)
                groups[g] = (numel, k, rows + spec.tiles)
            self._plans[key] = _Plan(specs, group_of, first_row, groups, {})
        return self._plans[key]

    def payload_bytes(self, shapes: list[tuple[int, ...]]) -> int:
        """Bytes of one rank's payload for tensors of ``shapes``."""
        plan = self.plan([tuple(s) for s in shapes])
        kept = sum(k * rows for _, k, rows in plan.groups)
        lookups = 0 if self.quantizer is None else 4 * len(shapes) * self.quantizer.bins
        values = 4 * kept if self.quantizer is None else packed_bytes(kept, self.bits)
        positions = sum(sum(positions_bytes(rows, n, k)) for n, k, rows in plan.groups if k < n)
        return lookups + positions + values

    def __call__(self, grads: Mapping[str, Tensor], *, commit: bool = True) -> dict[str, Tensor]:
        """Return the average over ranks of each tensor in ``grads`` (same shapes, float32); with
        ``commit=False`` the new error feedback waits for :meth:`commit`."""
        if not grads:
            return {}
        names = list(grads)
        plan = self.plan([tuple(grads[n].shape) for n in names])
        device = grads[names[0]].device
        blocks = [torch.empty(rows, n, dtype=torch.float32, device=device) for n, _, rows in plan.groups]
        for name, spec, g, row in zip(names, plan.specs, plan.group_of, plan.first_row, strict=True):
            e = grads[name].float()
            res = visit(self.residuals.get(name), device)
            if res is not None and res.shape == e.shape:
                e = res.mul(self.decay).add_(e) if self.decay != 1.0 else res.add(e)
            to_tiles(e, spec, blocks[g][row : row + spec.tiles])
        # top-k per tile, one batched topk per group of tiles of one size; a kept 0 is an empty slot. A
        # group kept whole: every value in order, no positions (None), no empty slot
        kept = [(None, b) if k == n else select_topk(b, k) for b, (n, k, _) in zip(blocks, plan.groups, strict=True)]
        empty = self._empty(kept, plan)
        values = torch.cat([v.reshape(-1) for _, v in kept])
        parts = [
            encode_positions(pos, n, k)
            for (pos, _), (n, k, _) in zip(kept, plan.groups, strict=True)
            if pos is not None
        ]
        if self.quantizer is None:
            payload = torch.cat([*parts, values.view(torch.uint8)])
            sent = values
        else:
            ids = plan.value_ids(device)
            codes, levels = self.quantizer.quantize(values, ids, empty, len(names))
            payload = torch.cat([levels.view(-1).view(torch.uint8), *parts, pack_bits(codes, self.bits)])
            sent = self.quantizer.decode(codes, ids, levels, empty)
        # what was not sent stays in e (an empty slot adds 0 at its tile's last value: no change)
        offset = 0
        for block, (pos, _), (n, k, rows) in zip(blocks, kept, plan.groups, strict=True):
            mine = sent[offset : offset + rows * k].view(rows, k)
            if pos is None:
                block.sub_(mine)
            else:
                block.scatter_add_(1, pos.clamp(max=n - 1), mine.neg())
            offset += rows * k
        everything = self.comm.all_gather(payload, tag=self.tag)
        acc = [torch.zeros_like(block) for block in blocks]
        for r in range(self.comm.world_size):  # rank order: every rank adds the same values in the same order
            for a, (pos, vals) in zip(acc, self._decode(everything[r], plan, len(names)), strict=True):
                if pos is None:
                    a.add_(vals)
                else:
                    a.scatter_add_(1, pos.clamp_(max=a.shape[1] - 1), vals)
        result: dict[str, Tensor] = {}
        new_res: dict[str, Tensor] = {}
        flags: list[Tensor] = []
        for name, spec, g, row in zip(names, plan.specs, plan.group_of, plan.first_row, strict=True):
            shape = grads[name].shape
            mine = acc[g][row : row + spec.tiles].div_(self.comm.world_size)
            flags.append(torch.isfinite(mine).all())
            result[name] = from_tiles(mine, spec).view(shape)
            new_res[name] = from_tiles(blocks[g][row : row + spec.tiles], spec).view(shape)
        finite = torch.stack(flags).tolist()
        self.nonfinite = [name for name, ok in zip(names, finite, strict=True) if not ok]
        self._pending = None if self.nonfinite else new_res
        if commit:
            self.commit()
        return result

    @staticmethod
    def _empty(kept: list[tuple[Tensor | None, Tensor]], plan: _Plan) -> Tensor:
        """Which kept slots are empty, flat, group after group (none in a group kept whole)."""
        return torch.cat(
            [
                (pos == n).view(-1) if pos is not None else torch.zeros(v.numel(), dtype=torch.bool, device=v.device)
                for (pos, v), (n, _, _) in zip(kept, plan.groups, strict=True)
            ]
        )

    def _decode(self, payload: Tensor, plan: _Plan, tensors: int) -> list[tuple[Tensor | None, Tensor]]:
        """Each group's positions ``[tiles, k]`` (``n``: an empty slot; ``None`` for a group kept whole)
        and values from one rank's payload."""
        at = 0
        levels = None
        if self.quantizer is not None:
            at = 4 * tensors * self.quantizer.bins
            levels = _view(payload[:at], torch.float32).view(tensors, self.quantizer.bins)
        positions: list[Tensor | None] = []
        for n, k, rows in plan.groups:
            if k == n:
                positions.append(None)
                continue
            size = sum(positions_bytes(rows, n, k))
            positions.append(decode_positions(payload[at : at + size], rows, n, k))
            at += size
        kept = sum(k * rows for _, k, rows in plan.groups)
        if levels is None:
            values = _view(payload[at : at + 4 * kept], torch.float32)
        else:
            assert self.quantizer is not None
            codes = unpack_bits(payload[at:], self.bits, kept)
            empty = self._empty(
                [(pos, codes.new_empty(k * rows)) for pos, (_, k, rows) in zip(positions, plan.groups, strict=True)],
                plan,
            )
            values = self.quantizer.decode(codes, plan.value_ids(payload.device), levels, empty)
        out, offset = [], 0
        for pos, (_, k, rows) in zip(positions, plan.groups, strict=True):
            out.append((pos, values[offset : offset + rows * k].view(rows, k)))
            offset += rows * k
        return out
