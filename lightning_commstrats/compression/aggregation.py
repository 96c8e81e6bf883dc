"""Two-stage quantized all-reduce with error feedback (1-bit SGD's aggregation, as in CNTK).

No Lightning here; the collectives go through a :class:`~lightning_commstrats.comm.Communicator`
so that every byte is counted.

For each gradient matrix, viewed as ``[rows, cols]`` (see :mod:`.quantizers`), the columns are cut
into ``N`` stripes of ``ceil(cols / N)`` columns; rank ``k`` owns stripe ``k`` of every matrix.

1. Every rank adds its stage-1 residual to its gradient, quantizes each stripe, keeps what the
   quantization lost as the new residual, and sends stripe ``k`` to rank ``k`` (one all-to-all of
   packed bytes; the rank's own stripe stays local).
2. Each owner decodes the ``N`` copies of its stripes and sums them.
3. The owner adds its stage-2 residual to the sum, quantizes it, keeps the new stage-2 residual,
   and the quantized stripes are all-gathered (padded to the longest rank's payload).
4. Every rank decodes every stripe from the same bytes, so all ranks hold bit-identical results;
   the sum is divided by ``N`` (the average, as ``allreduce`` gives).

Per rank and step this sends about ``2 (N-1)/N`` of the *quantized* gradient: 1/32 of an fp32 ring
all-reduce at 1 bit, plus two floats per column and stripe in each stage.

The codec quantizes every line (column) on its own, so a matrix is encoded in one call and its
payload is cut into the stripes' payloads; the ``N`` copies of a stripe, and the stripes of a
matrix, are joined back into one payload and decoded in one call. The kernels a step launches thus
grow with the number of matrices, not with matrices times ranks, and the bytes are those of
encoding each stripe alone (a stripe of a single line is encoded alone: torch sums one long row in
parallel pieces, in another order than the rows of a block).

Non-finite values never reach a residual: a rank whose input holds an inf or a NaN sends NaN for
the affected matrix, so the decoded average is non-finite on every rank (all decode the same
bytes, so they agree without another message); the new residuals of both stages are kept only when
every averaged value is finite, otherwise the old ones stay (see :attr:`QuantizedAllReduce.nonfinite`).
Whether they are is read on the host once per call, for all matrices together (or left on the
device for the caller, see ``finite_flags``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_commstrats.buckets import Parking
from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.quantizers import ColumnCodec, E3M0Codec, pack_bits, packed_bytes, unpack_bits

# Stage 2 decodes the N copies of the stripes it owns before summing them in rank order: at most
# this many bytes of decoded float32 at a time (and at least one matrix), so the sums of many
# matrices go in one fused add per rank without holding a decoded copy of the whole model.
DECODE_GROUP_BYTES = 64 * 2**20


@dataclass(frozen=True)
class MatrixLayout:
    """How one gradient is seen by the aggregator: ``cols`` lines of ``rows`` values each, one scale
    pair per line, the lines in stripes (one per rank).

    With ``by_rows=False`` (1-bit SGD's layout, as CNTK) a line is a column of the ``[shape[0],
    rest]`` matrix; with ``by_rows=True`` a line is a row (each word of an embedding or output
    matrix gets its own scales, so rare words are not quantized on the scale of frequent ones).
    """

    shape: torch.Size
    rows: int  # values per line
    cols: int  # lines
    stripes: tuple[tuple[int, int], ...]  # [begin, end) lines owned by each rank
    by_rows: bool = False

    @classmethod
    def of(cls, shape: torch.Size, world_size: int, by_rows: bool = False) -> MatrixLayout:
        first = shape[0] if len(shape) else 1
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        rows, cols = (rest, first) if by_rows else (first, rest)
        width = -(-cols // world_size)
        stripes = tuple((min(k * width, cols), min((k + 1) * width, cols)) for k in range(world_size))
        return cls(torch.Size(shape), rows, cols, stripes, by_rows)

    def blocks(self) -> list[tuple[int, int, int]]:
        """The blocks of lines encoded in one call each, as ``(begin, end, stripe width)``: the
        whole matrix, but a stripe of a single line goes alone (see the module notes)."""
        stripes = [(c0, c1) for c0, c1 in self.stripes if c1 > c0]
        if not stripes:
            return []
        width = stripes[0][1] - stripes[0][0]
        if width == 1:
            return [(c0, c1, 1) for c0, c1 in stripes]
        last = stripes[-1][0]
        if self.cols - last == 1:
            return [(0, last, width), (last, self.cols, 1)]
        return [(0, self.cols, width)]


def column_major(grad: Tensor, layout: MatrixLayout) -> Tensor:
    """A new contiguous float32 ``[lines, values]`` copy of ``grad`` (row ``j`` = line ``j``)."""
    lines = (
        grad.detach().reshape(layout.cols, layout.rows)
        if layout.by_rows
        else grad.detach().reshape(layout.rows, layout.cols).t()
    )
    # one copy, made contiguous as it is written (a transposed source would otherwise be copied twice)
    return lines.to(torch.float32, memory_format=torch.contiguous_format, copy=True)


def from_lines(lines: Tensor, layout: MatrixLayout) -> Tensor:
    """The inverse of :func:`column_major`: ``[lines, values]`` back to the gradient's shape (a view)."""
    return (lines if layout.by_rows else lines.t()).reshape(layout.shape)


class QuantizedAllReduce:
    """Average named gradients over ranks through two quantized stages with error feedback.

    Args:
        codec: the line quantizer (bits per value). Its payload for a block of lines must be its
            float32 scale arrays (one value per line each), then the codes packed ``codec.bits``
            per value in line order, as :class:`~lightning_commstrats.compression.ColumnCodec`'s and
            :class:`~lightning_commstrats.compression.E3M0Codec`'s are.
        comm: the communicator of the ranks.
        tag: the traffic tag for :class:`~lightning_commstrats.comm.CommStats`.
        by_rows: one scale pair per row of each matrix instead of per column (see :class:`MatrixLayout`).

    Attributes:
        residuals: stage-1 residual per name, ``[cols, rows]`` (what this rank's quantization lost).
        residuals2: stage-2 residual per name, ``[owned cols, rows]`` (what the owner's re-quantization lost).
    """

    def __init__(
        self,
        codec: ColumnCodec | E3M0Codec,
        comm: Communicator,
        tag: str = "grad_quantized",
        *,
        by_rows: bool = False,
    ) -> None:
        self.codec = codec
        self.by_rows = by_rows
        self.comm = comm
        self.tag = tag
        self.residuals: dict[str, Tensor] = {}
        self.residuals2: dict[str, Tensor] = {}
        self.parking = Parking()  # where residuals are kept between calls (see home)
        self._layouts: dict[str, MatrixLayout] = {}
        self.nonfinite: list[str] = []  # names whose last average was not finite (residuals then kept)
        self._pending: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None
        self._arrays = _scale_arrays(codec)

    @property
    def home(self) -> torch.device | None:
        """Where the residuals wait between calls: ``None`` (where they are made, the gradients' device)
        or the host (pinned memory on CUDA; see :class:`~lightning_commstrats.buckets.Parking`)."""
        return self.parking.home

    @home.setter
    def home(self, home: torch.device | None) -> None:
        self.parking.home = home

    def layout(self, name: str, shape: torch.Size) -> MatrixLayout:
        lay = self._layouts.get(name)
        if lay is None or lay.shape != shape:
            lay = self._layouts[name] = MatrixLayout.of(shape, self.comm.world_size, self.by_rows)
        return lay

    def __call__(
        self, grads: Mapping[str, Tensor], *, commit: bool = True, finite_flags: list[Tensor] | None = None
    ) -> dict[str, Tensor]:
        """Return the average over ranks of each gradient in ``grads`` (same shapes, float32).

        The new residuals replace the old ones when every average is finite and ``commit`` is
        True; with ``commit=False`` they wait for :meth:`commit` (a caller whose other tensors
        may still turn out non-finite decides after them).

        Whether the averages are finite is read on the host once (one synchronisation with the
        device per call). With ``finite_flags`` it is not: one boolean device tensor per gradient
        (in the order of ``grads``: whether its average is finite) is appended to the list, the
        new residuals wait (``commit`` must be False), and the caller, having read the flags with
        its own, calls :meth:`commit` only when all are true (else :meth:`discard`).
        """
        if finite_flags is not None and commit:
            raise ValueError("finite_flags leaves the finiteness to the caller: pass commit=False and commit() after")
        n, me = self.comm.world_size, self.comm.rank
        names = list(grads)
        layouts = [self.layout(name, grads[name].shape) for name in names]

        # stage 1: quantize (gradient + residual), each matrix in one call, and send stripe k to
        # rank k. What the quantization loses becomes the new residual, written into ``v`` itself
        # (no extra buffer) and kept only if the whole average comes out finite.
        parts: list[list[Tensor]] = [[] for _ in range(n)]
        new_res: dict[str, Tensor] = {}
        for name, lay in zip(names, layouts, strict=True):
            v = column_major(grads[name], lay)
            res = self.parking.visit(self.residuals.get(name), v.device)
            if res is not None and res.shape == v.shape:
                v += res
            # a codec could squash an inf into finite codes: NaN everywhere makes every owner see it
            # (no host synchronisation: the flag stays on the device)
            v += torch.where(_all_finite(v), 0.0, math.nan)
            k = 0
            for c0, c1, width in lay.blocks():
                payload, deq = self.codec.encode(v[c0:c1])
                v[c0:c1] -= deq
                for stripe in self._split(payload, c1 - c0, lay.rows, width):
                    parts[k] += stripe
                    k += 1
            new_res[name] = v
        send = torch.cat([p for k in range(n) for p in parts[k]]) if any(parts) else _empty(grads)
        send_splits = [sum(p.numel() for p in parts[k]) for k in range(n)]
        mine = [self._payload(lay, me) for lay in layouts]
        recv = self.comm.all_to_all(send, send_splits, [sum(mine)] * n, tag=self.tag)

        # stage 2: sum the N copies of my stripes, quantize the sum (+ residual), all-gather
        new_res2, out2 = self._reduce_mine(recv.view(n, sum(mine)), names, layouts, mine)
        sizes = [sum(self._payload(lay, k) for lay in layouts) for k in range(n)]
        longest = max(sizes)
        gather = torch.zeros(longest, dtype=torch.uint8, device=recv.device)
        if out2:
            own = torch.cat(out2)
            gather[: own.numel()] = own
        everything = self.comm.all_gather(gather, tag=self.tag)

        # every rank decodes the same bytes: the stripes of each matrix joined into one payload
        pieces: list[Tensor] = []
        offsets = [0] * n
        for lay in layouts:
            stripes, lines = [], []
            for k, (c0, c1) in enumerate(lay.stripes):
                size = self._payload(lay, k)
                if size:
                    stripes.append(everything[k, offsets[k] : offsets[k] + size])
                    lines.append(c1 - c0)
                offsets[k] += size
            if stripes:
                pieces += self._join(stripes, lines, lay.rows)
        whole = [self.codec.payload_bytes(lay.cols, lay.rows) for lay in layouts if lay.cols]
        payloads = iter(torch.cat(pieces).split(whole) if pieces else [])
        result: dict[str, Tensor] = {}
        flags: list[Tensor] = []
        for name, lay in zip(names, layouts, strict=True):
            if lay.cols:
                lines = self.codec.decode(next(payloads), lay.cols, lay.rows).div_(n)
            else:
                lines = torch.empty(0, lay.rows, dtype=torch.float32, device=recv.device)
            result[name] = from_lines(lines, lay)
            flags.append(_all_finite(lines))

        self._pending = None
        if finite_flags is not None:
            finite_flags.extend(flags)
            self.nonfinite = []
            self._pending = (new_res, new_res2)
            return result
        # the call's one host synchronisation; every rank decoded the same bytes, so all agree
        finite = torch.stack(flags).tolist() if flags else []
        self.nonfinite = [name for name, ok in zip(names, finite, strict=True) if not ok]
        if not self.nonfinite:
            self._pending = (new_res, new_res2)
            if commit:
                self.commit()
        return result

    def _reduce_mine(
        self, recv: Tensor, names: list[str], layouts: list[MatrixLayout], mine: list[int]
    ) -> tuple[dict[str, Tensor], list[Tensor]]:
        """Stage 2 on ``recv`` (``[N, my bytes]``: what each rank sent me): for each matrix, the sum
        over ranks of the decoded copies of my stripe plus my stage-2 residual, quantized. Returns
        the new stage-2 residuals and the payloads to all-gather, in the order of ``names``."""
        n = self.comm.world_size
        owned: list[tuple[str, int, int]] = []  # name, lines of my stripe, values per line
        pieces: list[Tensor] = []
        offset = 0
        for name, lay, size in zip(names, layouts, mine, strict=True):
            if size:
                c0, c1 = lay.stripes[self.comm.rank]
                owned.append((name, c1 - c0, lay.rows))
                pieces += self._join(list(recv[:, offset : offset + size].unbind(0)), [c1 - c0] * n, lay.rows)
            offset += size
        if not owned:
            return {}, []
        payloads = torch.cat(pieces).split([self.codec.payload_bytes(n * c, rows) for _, c, rows in owned])
        totals: list[Tensor] = []
        group: list[Tensor] = []
        group_bytes = 0
        for (_, c, rows), payload in zip(owned, payloads, strict=True):
            if group and group_bytes + n * c * rows * 4 > DECODE_GROUP_BYTES:
                totals += _sum_in_rank_order(group)
                group, group_bytes = [], 0
            group.append(self.codec.decode(payload, n * c, rows).view(n, c, rows))
            group_bytes += n * c * rows * 4
        totals += _sum_in_rank_order(group)
        with_res2 = [
            (total, self.parking.visit(self.residuals2[name], total.device))
            for (name, _, _), total in zip(owned, totals, strict=True)
            if name in self.residuals2 and self.residuals2[name].shape == total.shape
        ]
        if with_res2:
            torch._foreach_add_([t for t, _ in with_res2], [r for _, r in with_res2])
        new_res2: dict[str, Tensor] = {}
        out: list[Tensor] = []
        for (name, _, _), total in zip(owned, totals, strict=True):
            payload, deq = self.codec.encode(total)
            total -= deq
            new_res2[name] = total
            out.append(payload)
        return new_res2, out

    def _split(self, payload: Tensor, lines: int, rows: int, width: int) -> list[list[Tensor]]:
        """Cut the payload of a block of ``lines`` lines into the payloads of its stripes of
        ``width`` lines (the last may be shorter): each as pieces (views where the codes of a stripe
        start on a byte) whose concatenation is what encoding the stripe alone gives."""
        bits, arrays = self.codec.bits, self._arrays
        starts = range(0, lines, width)
        ends = [min(s + width, lines) for s in starts]
        codes = payload[arrays * 4 * lines :]
        if width * rows * bits % 8 == 0:  # every stripe's codes start on a byte
            code_parts = [
                codes[s * rows * bits // 8 : s * rows * bits // 8 + packed_bytes((e - s) * rows, bits)]
                for s, e in zip(starts, ends, strict=True)
            ]
        else:
            code_parts = _restripe(codes, bits, lines, rows, width)
        return [
            [payload[a * 4 * lines + 4 * s : a * 4 * lines + 4 * e] for a in range(arrays)] + [code]
            for s, e, code in zip(starts, ends, code_parts, strict=True)
        ]

    def _join(self, stripes: list[Tensor], lines: list[int], rows: int) -> list[Tensor]:
        """The inverse of :meth:`_split`: pieces whose concatenation is the payload of the block made
        of the consecutive ``stripes`` (payloads of ``lines`` lines each), as encoding it whole gives."""
        bits, arrays = self.codec.bits, self._arrays
        scales = [s[a * 4 * c : (a + 1) * 4 * c] for a in range(arrays) for s, c in zip(stripes, lines, strict=True)]
        codes = [s[arrays * 4 * c :] for s, c in zip(stripes, lines, strict=True)]
        if all(c * rows * bits % 8 == 0 for c in lines[:-1]):
            return scales + codes
        return [*scales, _unstripe(codes, bits, lines, rows)]

    def commit(self) -> None:
        """Keep the residuals of the last call (only ever finite ones; a no-op after a non-finite call)."""
        if self._pending is not None:
            self.residuals.update(self.parking.park_all(self._pending[0]))
            self.residuals2.update(self.parking.park_all(self._pending[1]))
            self._pending = None

    def discard(self) -> None:
        """Drop the residuals of the last call (the old ones stay)."""
        self._pending = None

    def take_pending(self) -> tuple[dict[str, Tensor], dict[str, Tensor]] | None:
        """The residuals of the last ``commit=False`` call, handed over (``None`` after a non-finite
        call): a caller that stages several calls until one decision keeps them and calls
        :meth:`keep` on each, or drops them."""
        pending, self._pending = self._pending, None
        return pending

    def keep(self, pending: tuple[dict[str, Tensor], dict[str, Tensor]]) -> None:
        """Make residuals handed over by :meth:`take_pending` the current ones."""
        self._pending = pending
        self.commit()

    def rebind(self, comm: Communicator, *, keep_stripes: bool) -> None:
        """Exchange over ``comm`` from now on; without ``keep_stripes`` (another rank or number of
        ranks) the stripe layouts and the stage-2 residuals, which belong to the old stripes, go."""
        self.comm = comm
        self._pending = None
        if not keep_stripes:
            self._layouts.clear()
            self.residuals2.clear()

    def _payload(self, lay: MatrixLayout, rank: int) -> int:
        c0, c1 = lay.stripes[rank]
        return self.codec.payload_bytes(c1 - c0, lay.rows) if c1 > c0 else 0

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """Both stages' error-feedback residuals, per tensor name (rank-local), written where they are kept."""
        self.parking.settle()
        return {"residuals": dict(self.residuals), "residuals2": dict(self.residuals2)}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        self.residuals = self.parking.park_all({n: r.float() for n, r in state.get("residuals", {}).items()})
        self.residuals2 = self.parking.park_all({n: r.float() for n, r in state.get("residuals2", {}).items()})

    def reset(self) -> None:
        """Forget both residuals (they restart at zero)."""
        self.residuals.clear()
        self.residuals2.clear()


def _scale_arrays(codec: ColumnCodec | E3M0Codec) -> int:
    """How many float32 arrays (one value per line) open the codec's payload; ``ValueError`` when the
    payload is not those arrays followed by the codes packed ``codec.bits`` per value."""
    arrays, rest = divmod(codec.payload_bytes(1, 8) - packed_bytes(8, codec.bits), 4)
    for lines, rows in ((1, 8), (3, 5), (7, 3)):
        if rest or codec.payload_bytes(lines, rows) != 4 * arrays * lines + packed_bytes(lines * rows, codec.bits):
            raise ValueError(
                f"{type(codec).__name__}'s payload is not float32 scales per line followed by packed codes"
            )
    return arrays


def _all_finite(t: Tensor) -> Tensor:
    """Whether every value of ``t`` is finite, as a boolean device tensor: whether its least and
    largest values are (a NaN anywhere is both), without the float32 copy ``isfinite`` would make."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    return torch.isfinite(torch.stack(torch.aminmax(t))).all()


def _sum_in_rank_order(decoded: list[Tensor]) -> list[Tensor]:
    """For each ``[N, lines, values]`` tensor, ``0 + d[0] + d[1] + ... + d[N-1]`` in this order (as a
    loop over ranks would add them, bit for bit), with one fused add per rank for all of them."""
    if not decoded:
        return []
    # 0 + x, as adding to zeros does: a -0.0 becomes +0.0
    totals = torch._foreach_add([d[0] for d in decoded], 0.0)
    for k in range(1, decoded[0].shape[0]):
        torch._foreach_add_(totals, [d[k] for d in decoded])
    return list(totals)


def _restripe(codes: Tensor, bits: int, lines: int, rows: int, width: int) -> list[Tensor]:
    """The packed codes of a block of ``lines`` lines, repacked stripe by stripe (``width`` lines,
    the last may be shorter), each stripe's codes from the first bit of a byte, zero-padded."""
    per_byte = 8 // bits
    flat = unpack_bits(codes, bits, lines * rows)
    full, span = lines // width, width * rows
    out: list[Tensor] = []
    if full:
        padded = flat.new_zeros(full, -(-span // per_byte) * per_byte)
        padded[:, :span] = flat[: full * span].view(full, span)
        out += pack_bits(padded, bits).view(full, -1).unbind(0)
    if lines % width:
        out.append(pack_bits(flat[full * span :], bits))
    return out


def _unstripe(codes: list[Tensor], bits: int, lines: list[int], rows: int) -> Tensor:
    """The inverse of :func:`_restripe`: the codes of consecutive stripes (each zero-padded to a
    byte) packed as one run."""
    per_byte = 8 // bits
    runs: list[Tensor] = []
    i = 0
    while i < len(codes):  # consecutive stripes of equal size are unpacked together
        j = i
        while j < len(codes) and lines[j] == lines[i]:
            j += 1
        run = torch.cat(codes[i:j]) if j - i > 1 else codes[i]
        size = codes[i].numel()
        flat = unpack_bits(run, bits, (j - i) * size * per_byte).view(j - i, size * per_byte)
        runs.append(flat[:, : lines[i] * rows].reshape(-1))
        i = j
    return pack_bits(torch.cat(runs) if len(runs) > 1 else runs[0], bits)


def _empty(grads: Mapping[str, Tensor]) -> Tensor:
    device = next(iter(grads.values())).device if grads else torch.device("cpu")
    return torch.empty(0, dtype=torch.uint8, device=device)
