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

Non-finite values never reach a residual: a rank whose input holds an inf or a NaN sends NaN for
the affected matrix, so the decoded average is non-finite on every rank (all decode the same
bytes, so they agree without another message); the new residuals of both stages are kept only when
every averaged value is finite, otherwise the old ones stay (see :attr:`QuantizedAllReduce.nonfinite`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.quantizers import ColumnCodec


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


def column_major(grad: Tensor, layout: MatrixLayout) -> Tensor:
    """A new contiguous float32 ``[lines, values]`` copy of ``grad`` (row ``j`` = line ``j``)."""
    if layout.by_rows:  # the rows are the lines already
        return grad.detach().reshape(layout.cols, layout.rows).to(torch.float32, copy=True).contiguous()
    return grad.detach().reshape(layout.rows, layout.cols).t().to(torch.float32, copy=True).contiguous()


def from_lines(lines: Tensor, layout: MatrixLayout) -> Tensor:
    """The inverse of :func:`column_major`: ``[lines, values]`` back to the gradient's shape (a view)."""
    return (lines if layout.by_rows else lines.t()).reshape(layout.shape)


class QuantizedAllReduce:
    """Average named gradients over ranks through two quantized stages with error feedback.

    Args:
        codec: the column quantizer (bits per value).
        comm: the communicator of the ranks.
        tag: the traffic tag for :class:`~lightning_commstrats.comm.CommStats`.
        by_rows: one scale pair per row of each matrix instead of per column (see :class:`MatrixLayout`).

    Attributes:
        residuals: stage-1 residual per name, ``[cols, rows]`` (what this rank's quantization lost).
        residuals2: stage-2 residual per name, ``[owned cols, rows]`` (what the owner's re-quantization lost).
    """

    def __init__(
        self, codec: ColumnCodec, comm: Communicator, tag: str = "grad_quantized", *, by_rows: bool = False
    ) -> None:
        self.codec = codec
        self.by_rows = by_rows
        self.comm = comm
        self.tag = tag
        self.residuals: dict[str, Tensor] = {}
        self.residuals2: dict[str, Tensor] = {}
        self._layouts: dict[str, MatrixLayout] = {}
        self.nonfinite: list[str] = []  # names whose last average was not finite (residuals then kept)
        self._pending: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None

    def layout(self, name: str, shape: torch.Size) -> MatrixLayout:
        lay = self._layouts.get(name)
        if lay is None or lay.shape != shape:
            lay = self._layouts[name] = MatrixLayout.of(shape, self.comm.world_size, self.by_rows)
        return lay

    def __call__(self, grads: Mapping[str, Tensor], *, commit: bool = True) -> dict[str, Tensor]:
        """Return the average over ranks of each gradient in ``grads`` (same shapes, float32).

        The new residuals replace the old ones when every average is finite and ``commit`` is
        True; with ``commit=False`` they wait for :meth:`commit` (a caller whose other tensors
        may still turn out non-finite decides after them).
        """
        n, me = self.comm.world_size, self.comm.rank
        names = list(grads)
        layouts = [self.layout(name, grads[name].shape) for name in names]

        # stage 1: quantize every stripe of (gradient + residual), send stripe k to rank k. What the
        # quantization loses becomes the new residual, written into ``v`` itself (no extra buffer)
        # and kept only if the whole average comes out finite.
        parts: list[list[Tensor]] = [[] for _ in range(n)]
        new_res: dict[str, Tensor] = {}
        for name, lay in zip(names, layouts, strict=True):
            v = column_major(grads[name], lay)
            res = self.residuals.get(name)
            if res is not None and res.shape == v.shape:
                v += res
            # a codec could squash an inf into finite codes: NaN everywhere makes every owner see it
            # (no host synchronisation: the flag stays on the device)
            v += torch.where(torch.isfinite(v).all(), 0.0, math.nan)
            for k, (c0, c1) in enumerate(lay.stripes):
                if c1 > c0:
                    payload, deq = self.codec.encode(v[c0:c1])
                    v[c0:c1] -= deq
                    parts[k].append(payload)
            new_res[name] = v
        send = torch.cat([p for k in range(n) for p in parts[k]]) if any(parts) else _empty(grads)
        send_splits = [sum(p.numel() for p in parts[k]) for k in range(n)]
        mine = [self._payload(lay, me) for lay in layouts]
        recv = self.comm.all_to_all(send, send_splits, [sum(mine)] * n, tag=self.tag)

        # stage 2: sum the N copies of my stripes, quantize the sum (+ residual), all-gather
        chunks = recv.split([sum(mine)] * n)
        out2: list[Tensor] = []
        new_res2: dict[str, Tensor] = {}
        for i, (name, lay) in enumerate(zip(names, layouts, strict=True)):
            c0, c1 = lay.stripes[me]
            if c1 == c0:
                continue
            offset = sum(mine[:i])
            total = torch.zeros(c1 - c0, lay.rows, dtype=torch.float32, device=recv.device)
            for chunk in chunks:
                total += self.codec.decode(chunk[offset : offset + mine[i]], c1 - c0, lay.rows)
            res2 = self.residuals2.get(name)
            if res2 is not None and res2.shape == total.shape:
                total += res2
            payload, deq = self.codec.encode(total)
            total -= deq
            new_res2[name] = total
            out2.append(payload)
        sizes = [sum(self._payload(lay, k) for lay in layouts) for k in range(n)]
        longest = max(sizes)
        gather = torch.zeros(longest, dtype=torch.uint8, device=recv.device)
        if out2:
            own = torch.cat(out2)
            gather[: own.numel()] = own
        everything = self.comm.all_gather(gather, tag=self.tag)

        # every rank decodes the same bytes
        result: dict[str, Tensor] = {}
        cm = {
            name: torch.empty(lay.cols, lay.rows, dtype=torch.float32, device=recv.device)
            for name, lay in zip(names, layouts, strict=True)
        }
        for k in range(n):
            offset = 0
            for name, lay in zip(names, layouts, strict=True):
                c0, c1 = lay.stripes[k]
                size = self._payload(lay, k)
                if size:
                    cm[name][c0:c1] = self.codec.decode(everything[k, offset : offset + size], c1 - c0, lay.rows)
                offset += size
        for name, lay in zip(names, layouts, strict=True):
            result[name] = from_lines(cm[name].div_(n), lay)
        # one host synchronisation for all matrices; every rank decoded the same bytes, so all agree
        finite = torch.stack([torch.isfinite(m).all() for m in cm.values()]).all() if cm else None
        self._pending = None
        if finite is None or bool(finite):
            self.nonfinite = []
            self._pending = (new_res, new_res2)
            if commit:
                self.commit()
        else:
            self.nonfinite = [name for name in names if not bool(torch.isfinite(cm[name]).all())]
        return result

    def commit(self) -> None:
        """Keep the residuals of the last call (only ever finite ones; a no-op after a non-finite call)."""
        if self._pending is not None:
            self.residuals.update(self._pending[0])
            self.residuals2.update(self._pending[1])
            self._pending = None

    def discard(self) -> None:
        """Drop the residuals of the last call (the old ones stay)."""
        self._pending = None

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
        """Both stages' error-feedback residuals, per tensor name (rank-local)."""
        return {"residuals": dict(self.residuals), "residuals2": dict(self.residuals2)}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        self.residuals = {n: r.float() for n, r in state.get("residuals", {}).items()}
        self.residuals2 = {n: r.float() for n, r in state.get("residuals2", {}).items()}

    def reset(self) -> None:
        """Forget both residuals (they restart at zero)."""
        self.residuals.clear()
        self.residuals2.clear()


def _empty(grads: Mapping[str, Tensor]) -> Tensor:
    device = next(iter(grads.values())).device if grads else torch.device("cpu")
    return torch.empty(0, dtype=torch.uint8, device=device)
