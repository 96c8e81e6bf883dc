"""The two-stage quantized all-reduce against the stripe-by-stripe algorithm it replaced, bit for bit,
and what one call costs: codec calls, kernels, host synchronisations, float32 allocations.

Ranks run as threads of this process over an in-memory communicator, so every configuration (bits,
number of ranks, stripes of every kind) runs in a second; the byte-level agreement with real ranks
is ``tests/multiprocess/test_quantized_allreduce_ranks.py``'s.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from torch import Tensor

from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression import ColumnCodec, E3M0Codec, QuantizedAllReduce, aggregation, make_codec
from lightning_commstrats.compression.aggregation import MatrixLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from hotpath import HotPathCounter, Mirror, counting_transfers

# lines (the quantized unit) of 40, 5, 16, 9, 33000 and 4 values; on 2, 3 and 4 ranks these give
# stripes of several lines, a last stripe of one line (alone, and of 33000 values: torch sums such
# a row in parallel pieces), stripes of one line each, empty stripes, and codes that do not end
# on a byte
SHAPES = [[40, 7], [5, 3, 4], [16, 2], [9, 33], [33000, 3], [4, 13]]


class ThreadRanks:
    """``world`` ranks as threads sharing memory; :meth:`comm` is rank ``r``'s communicator."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[object] = [None] * world

    def comm(self, rank: int) -> Communicator:
        return _ThreadComm(self, rank)

    def run(self, fn: Callable[[int], object]) -> list[object]:
        """``fn(rank)`` on every rank at once; the results in rank order."""
        results: list[object] = [None] * self.world
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as err:
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class _ThreadComm(Communicator):
    backend = "threads"

    def __init__(self, ranks: ThreadRanks, rank: int) -> None:
        super().__init__(rank=rank, world_size=ranks.world)
        self.ranks = ranks
        self.wire: list[Tensor] = []  # every buffer this rank handed to a collective, in order

    def _swap(self, value: object) -> list[object]:
        self.ranks.slots[self.rank] = value
        self.ranks.barrier.wait()
        values = list(self.ranks.slots)
        self.ranks.barrier.wait()
        return values

    def _all_gather(self, out: Tensor, tensor: Tensor) -> None:
        self.wire.append(tensor.clone())
        for k, value in enumerate(self._swap(tensor.clone())):
            out[k].copy_(value)

    def _all_to_all(self, out: Tensor, tensor: Tensor, recv_splits: list[int], send_splits: list[int]) -> None:
        self.wire.append(tensor.clone())
        sent = self._swap([chunk.clone() for chunk in tensor.split(send_splits)])
        out.copy_(torch.cat([chunks[self.rank] for chunks in sent]))

    def _all_reduce(self, tensor: Tensor, op: str) -> None:
        tensor.copy_(sum(self._swap(tensor.clone())))

    def _reduce_scatter(self, out: Tensor, tensor: Tensor, op: str) -> None:
        raise AssertionError("not used")

    def _broadcast(self, tensor: Tensor, src: int) -> None:
        tensor.copy_(self._swap(tensor.clone())[src])

    def _barrier(self) -> None:
        self._swap(None)


class PerStripeAllReduce:
    """The aggregation as it was written before it encoded whole matrices: a loop over stripes in
    every stage (kept here as the reference the bytes and values must equal)."""

    def __init__(self, codec: ColumnCodec | E3M0Codec, comm: Communicator, by_rows: bool = False) -> None:
        self.codec, self.comm, self.by_rows = codec, comm, by_rows
        self.residuals: dict[str, Tensor] = {}
        self.residuals2: dict[str, Tensor] = {}
        self.nonfinite: list[str] = []

    def _lines(self, grad: Tensor, lay: MatrixLayout) -> Tensor:
        if lay.by_rows:
            return grad.detach().reshape(lay.cols, lay.rows).to(torch.float32, copy=True).contiguous()
        return grad.detach().reshape(lay.rows, lay.cols).t().to(torch.float32, copy=True).contiguous()

    def _payload(self, lay: MatrixLayout, rank: int) -> int:
        c0, c1 = lay.stripes[rank]
        return self.codec.payload_bytes(c1 - c0, lay.rows) if c1 > c0 else 0

    def __call__(self, grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        n, me, codec = self.comm.world_size, self.comm.rank, self.codec
        names = list(grads)
        layouts = [MatrixLayout.of(grads[name].shape, n, self.by_rows) for name in names]
        parts: list[list[Tensor]] = [[] for _ in range(n)]
        new_res: dict[str, Tensor] = {}
        for name, lay in zip(names, layouts, strict=True):
            v = self._lines(grads[name], lay)
            res = self.residuals.get(name)
            if res is not None and res.shape == v.shape:
                v += res
            v += torch.where(torch.isfinite(v).all(), 0.0, math.nan)
            for k, (c0, c1) in enumerate(lay.stripes):
                if c1 > c0:
                    payload, deq = codec.encode(v[c0:c1])
                    v[c0:c1] -= deq
                    parts[k].append(payload)
            new_res[name] = v
        send = torch.cat([p for k in range(n) for p in parts[k]])
        mine = [self._payload(lay, me) for lay in layouts]
        recv = self.comm.all_to_all(send, [sum(p.numel() for p in parts[k]) for k in range(n)], [sum(mine)] * n)
        chunks = recv.split([sum(mine)] * n)
        out2: list[Tensor] = []
        new_res2: dict[str, Tensor] = {}
        for i, (name, lay) in enumerate(zip(names, layouts, strict=True)):
            c0, c1 = lay.stripes[me]
            if c1 == c0:
                continue
            offset = sum(mine[:i])
            total = torch.zeros(c1 - c0, lay.rows)
            for chunk in chunks:
                total += codec.decode(chunk[offset : offset + mine[i]], c1 - c0, lay.rows)
            res2 = self.residuals2.get(name)
            if res2 is not None and res2.shape == total.shape:
                total += res2
            payload, deq = codec.encode(total)
            total -= deq
            new_res2[name] = total
            out2.append(payload)
        longest = max(sum(self._payload(lay, k) for lay in layouts) for k in range(n))
        gather = torch.zeros(longest, dtype=torch.uint8)
        if out2:
            own = torch.cat(out2)
            gather[: own.numel()] = own
        everything = self.comm.all_gather(gather)
        cm = {name: torch.empty(lay.cols, lay.rows) for name, lay in zip(names, layouts, strict=True)}
        for k in range(n):
            offset = 0
            for name, lay in zip(names, layouts, strict=True):
                c0, c1 = lay.stripes[k]
                size = self._payload(lay, k)
                if size:
                    cm[name][c0:c1] = codec.decode(everything[k, offset : offset + size], c1 - c0, lay.rows)
                offset += size
        result = {}
        for name, lay in zip(names, layouts, strict=True):
            result[name] = (cm[name].div_(n) if lay.by_rows else cm[name].div_(n).t()).reshape(lay.shape)
        self.nonfinite = [name for name in names if not bool(torch.isfinite(cm[name]).all())]
        if not self.nonfinite:
            self.residuals.update(new_res)
            self.residuals2.update(new_res2)
        return result


def _grads(rank: int, step: int, shapes: list[list[int]]) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    grads = {f"p{i}": torch.randn(*s, generator=g) * (i + 1) + i for i, s in enumerate(shapes)}
    if step == 1 and rank == 0:
        grads["p3"].view(-1)[5] = math.inf  # one rank's inf: every rank's average of p3 is NaN
    return grads


def _without(
    wire: list[Tensor], name: str, shapes: list[list[int]], rank: int, world: int, kind: str, bits: int, by_rows: bool
) -> list[Tensor]:
    """A rank's two wire buffers with the bytes of matrix ``name`` zeroed: a non-finite matrix is all
    NaN, and which NaN (sign and payload bits) a reduction or a conversion returns differs between
    torch's vectorised and scalar loops, so it depends on where a block starts and ends."""
    codec = make_codec(kind, bits)
    layouts = {f"p{i}": MatrixLayout.of(torch.Size(s), world, by_rows) for i, s in enumerate(shapes)}

    def size(lay: MatrixLayout, k: int) -> int:
        c0, c1 = lay.stripes[k]
        return codec.payload_bytes(c1 - c0, lay.rows) if c1 > c0 else 0

    send, gather = (t.clone() for t in wire)
    offset = 0
    for k in range(world):  # stage 1: stripe k of every matrix, for rank k
        for key, lay in layouts.items():
            if key == name:
                send[offset : offset + size(lay, k)] = 0
            offset += size(lay, k)
    offset = 0
    for key, lay in layouts.items():  # stage 2: this rank's stripe of every matrix
        if key == name:
            gather[offset : offset + size(lay, rank)] = 0
        offset += size(lay, rank)
    return [send, gather]


def _bits_of(t: Tensor) -> Tensor:
    """The bytes of ``t`` (so that NaNs, and -0.0 against 0.0, compare as what they are)."""
    return t.contiguous().view(torch.uint8)


def _run(
    aggregator: type, kind: str, bits: int, world: int, by_rows: bool, shapes: list[list[int]]
) -> list[list[dict]]:
    ranks = ThreadRanks(world)
    comms = [ranks.comm(r) for r in range(world)]
    aggs = [aggregator(make_codec(kind, bits), comms[r], by_rows=by_rows) for r in range(world)]
    trace: list[list[dict]] = []
    for step in range(3):  # no residuals yet, a non-finite step, residuals of the step before it
        outs = ranks.run(lambda r: aggs[r](_grads(r, step, shapes)))  # noqa: B023 - run at once
        trace.append(
            [
                {
                    "out": outs[r],
                    "wire": list(comms[r].wire),
                    "nonfinite": list(aggs[r].nonfinite),
                    "residuals": dict(aggs[r].residuals),
                    "residuals2": dict(aggs[r].residuals2),
                }
                for r in range(world)
            ]
        )
        for comm in comms:
            comm.wire.clear()
    return trace


CODECS = [("uniform", 1), ("uniform", 2), ("uniform", 4), ("e3m0", 4), ("uniform", 8), ("uniform", 16)]


@pytest.mark.parametrize("by_rows", [False, True], ids=["columns", "rows"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(("kind", "bits"), CODECS, ids=[f"{k}{b}" for k, b in CODECS])
def test_same_bytes_and_values_as_the_stripe_by_stripe_algorithm(kind, bits, world, by_rows):
    _check_against_stripe_by_stripe(kind, bits, world, by_rows, SHAPES)


@pytest.mark.parametrize("group_bytes", [aggregation.DECODE_GROUP_BYTES, 1], ids=["one_group", "group_per_matrix"])
def test_many_ranks_add_their_copies_in_rank_order(group_bytes, monkeypatch):
    # with 8 copies of a stripe, torch.sum adds them in another order than one after the other
    monkeypatch.setattr(aggregation, "DECODE_GROUP_BYTES", group_bytes)
    _check_against_stripe_by_stripe("uniform", 2, 8, False, SHAPES[:4])


def _check_against_stripe_by_stripe(kind: str, bits: int, world: int, by_rows: bool, shapes: list[list[int]]) -> None:
    got = _run(QuantizedAllReduce, kind, bits, world, by_rows, shapes)
    want = _run(PerStripeAllReduce, kind, bits, world, by_rows, shapes)
    for step, (ranks_got, ranks_want) in enumerate(zip(got, want, strict=True)):
        for rank, (g, w) in enumerate(zip(ranks_got, ranks_want, strict=True)):
            where = f"step {step}, rank {rank}"
            assert len(g["wire"]) == len(w["wire"]) == 2, where
            wire_got, wire_want = g["wire"], w["wire"]
            if step == 1:  # p3 is poisoned (see _grads)
                wire_got = _without(wire_got, "p3", shapes, rank, world, kind, bits, by_rows)
                wire_want = _without(wire_want, "p3", shapes, rank, world, kind, bits, by_rows)
            for sent, expected in zip(wire_got, wire_want, strict=True):
                assert torch.equal(sent, expected), f"{where}: other bytes on the wire"
            assert g["nonfinite"] == w["nonfinite"] == (["p3"] if step == 1 else []), where
            for key in ("out", "residuals", "residuals2"):
                assert g[key].keys() == w[key].keys(), (where, key)
                for name in g[key]:
                    if step == 1 and key == "out" and name == "p3":  # NaN everywhere, of whichever bits
                        assert g[key][name].isnan().all() and w[key][name].isnan().all(), where
                        continue
                    assert torch.equal(_bits_of(g[key][name]), _bits_of(w[key][name])), (where, key, name)


def test_a_single_long_line_is_encoded_alone():
    # 33000 values per line: torch sums such a row in parallel pieces when it is alone, in one
    # sequence within a block; the last stripe (one line) must be what encoding it alone gives
    lay = MatrixLayout.of(torch.Size([33000, 3]), 2)
    assert lay.stripes == ((0, 2), (2, 3))
    assert lay.blocks() == [(0, 2, 2), (2, 3, 1)]
    assert MatrixLayout.of(torch.Size([16, 2]), 4).blocks() == [(0, 1, 1), (1, 2, 1)]
    assert MatrixLayout.of(torch.Size([40, 7]), 2).blocks() == [(0, 7, 4)]


def _counted(agg: QuantizedAllReduce, grads: dict[str, Tensor], **kwargs) -> HotPathCounter:
    counter = HotPathCounter(min_bytes=1)
    with counting_transfers(), counter:
        agg(grads, **kwargs)
    return counter


LARGE = {"a": (512, 96), "b": (96, 200), "c": (300, 64)}  # no stripe of a single line on 2 to 8 ranks


def _large_grads(poisoned: bool = False) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    grads = {name: torch.randn(*shape, generator=g) for name, shape in LARGE.items()}
    if poisoned:
        grads["b"][3, 3] = math.nan
    return grads


@pytest.mark.parametrize("bits", [1, 4])
def test_each_matrix_is_encoded_and_decoded_once_per_stage(bits, monkeypatch):
    calls = {"encode": 0, "decode": 0}
    codec = ColumnCodec(bits)
    for method in calls:
        original = getattr(codec, method)

        def wrapped(*args, _original=original, _method=method):
            calls[_method] += 1
            return _original(*args)

        monkeypatch.setattr(codec, method, wrapped)
    agg = QuantizedAllReduce(codec, Mirror(rank=1, world_size=4))
    agg(_large_grads())
    # stage 1 encodes each matrix, stage 2 decodes and re-encodes each owned stripe (this rank owns
    # one of each matrix), stage 3 decodes each matrix: 2 + 2 calls per matrix, whatever the ranks
    assert calls == {"encode": 2 * len(LARGE), "decode": 2 * len(LARGE)}


@pytest.mark.parametrize("bits", [1, 4])
def test_the_kernels_of_a_call_do_not_grow_with_the_ranks(bits):
    kernels = {}
    for world in (2, 8):
        agg = QuantizedAllReduce(ColumnCodec(bits), Mirror(rank=0, world_size=world))
        kernels[world] = _counted(agg, _large_grads()).kernels
    # one fused add per rank sums the decoded copies of every owned stripe; nothing else depends on N
    assert kernels[8] - kernels[2] <= 8 - 2, kernels


@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "not_finite"])
def test_one_host_synchronisation_per_call(poisoned):
    agg = QuantizedAllReduce(ColumnCodec(1), Mirror(rank=0, world_size=2))
    counter = _counted(agg, _large_grads(poisoned))
    assert sum(counter.syncs.values()) == 1, counter.syncs
    assert agg.nonfinite == (["b"] if poisoned else [])


def test_finite_flags_leave_the_decision_to_the_caller():
    agg = QuantizedAllReduce(ColumnCodec(1), Mirror(rank=0, world_size=2))
    with pytest.raises(ValueError, match="pass commit=False"):
        agg(_large_grads(), finite_flags=[])
    flags: list[Tensor] = []
    counter = _counted(agg, _large_grads(poisoned=True), commit=False, finite_flags=flags)
    assert sum(counter.syncs.values()) == 0, counter.syncs
    assert [bool(f) for f in flags] == [True, False, True]
    assert not agg.residuals  # waiting for commit()
    agg.discard()
    agg.commit()
    assert not agg.residuals
    agg(_large_grads(), commit=False, finite_flags=flags)
    agg.commit()
    assert agg.residuals.keys() == LARGE.keys()


@pytest.mark.parametrize("bits", [1, 4])
def test_float32_allocated_per_call(bits):
    agg = QuantizedAllReduce(ColumnCodec(bits), Mirror(rank=0, world_size=2))
    grads = _large_grads()
    agg(grads)  # the residuals exist from here on
    counter = HotPathCounter(min_bytes=4096)  # blocks, not the per-line scales
    with counter:
        agg(grads)
    model = sum(g.numel() * 4 for g in grads.values())
    # the new stage-1 residual, the dequantized block and the quantizer's one temporary (3), the N
    # decoded copies of the owned stripes (1), the stage-2 sum, its dequantized value and temporary
    # (3 / N), the average (1): 6.5 copies of the matrices at N = 2
    assert counter.fp32_bytes <= 6.5 * model, counter.fp32_by_op
