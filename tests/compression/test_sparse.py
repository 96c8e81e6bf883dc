"""Sparse top-k pseudo-gradients (SparseLoCo): the codec's bytes and values against an encoder written here
from the wire format's definition, and the exchange's error feedback against its equations on one rank."""

import math
import struct

import numpy as np
import pytest
import torch

from lightning_commstrats import DiLoCoStrategy, SparseLoCoStrategy
from lightning_commstrats.comm.base import LocalCommunicator
from lightning_commstrats.compression import SparseAllGather, TensorExchange, TopKCodec
from lightning_commstrats.compression.sparse import pack_uint, unpack_uint


def reference_encode(block: np.ndarray, k: int, bits: int) -> tuple[bytes, np.ndarray]:
    """The wire format, chunk by chunk, with Python integers and numpy float32 scalars: the kept
    positions are the k largest magnitudes (ascending), the scales the least and largest kept
    magnitude, each value its sign bit and its magnitude's bin; returns the payload and, per chunk,
    the float32 values the payload rebuilds at the kept positions (a dense [chunks, chunk] array).
    Positions in Elias-Fano: ``low`` = the largest l with k * 2^l <= chunk; every position's low
    bits, then per chunk a vector with bit (p_i >> l) + i set for its i-th position."""
    chunks, chunk = block.shape
    low = 0
    while k * 2 ** (low + 1) <= chunk:
        low += 1
    upper_len = k + (chunk - 1) // 2**low + 1
    rebuilt = np.zeros_like(block)
    los, his, low_bits, upper_bits, code_bits, float_bits = [], [], "", "", "", b""
    for c in range(chunks):
        row = block[c]
        order = sorted(range(chunk), key=lambda i: -abs(float(row[i])))
        kept = sorted(order[:k])
        vector = ["0"] * upper_len
        for rank, i in enumerate(kept):
            low_bits += format(i % 2**low, f"0{low}b") if low else ""
            vector[i // 2**low + rank] = "1"
        upper_bits += "".join(vector)
        values = [row[i] for i in kept]
        if bits == 32:
            for i, v in zip(kept, values, strict=True):
                rebuilt[c, i] = v
                float_bits += struct.pack("<f", float(v))
            continue
        mags = [np.float32(abs(v)) for v in values]
        lo, hi = min(mags), max(mags)
        los.append(lo)
        his.append(hi)
        bins = 2 ** (bits - 1)
        step = np.float32(np.float32(hi - lo) / np.float32(bins))
        inv = np.float32(np.float32(1.0) / step) if step > 0 else np.float32(0.0)
        for i, v, m in zip(kept, values, mags, strict=True):
            level = int(min(max(math.floor(float(np.float32(np.float32(m - lo) * inv))), 0), bins - 1))
            code_bits += ("1" if v < 0 else "0") + format(level, f"0{bits - 1}b")
            mag = np.float32(np.float32(np.float32(level) + np.float32(0.5)) * step) + lo
            rebuilt[c, i] = -mag if v < 0 else mag

    def to_bytes(bitstring: str) -> bytes:
        bitstring += "0" * (-len(bitstring) % 8)
        return bytes(int(bitstring[i : i + 8], 2) for i in range(0, len(bitstring), 8))

    position_bytes = to_bytes(low_bits) + to_bytes(upper_bits)
    if bits == 32:
        return position_bytes + float_bits, rebuilt
    scales = b"".join(struct.pack("<f", float(x)) for x in los) + b"".join(struct.pack("<f", float(x)) for x in his)
    return scales + position_bytes + to_bytes(code_bits), rebuilt


def dense(positions: torch.Tensor, values: torch.Tensor, chunk: int) -> torch.Tensor:
    """The ``[chunks, chunk]`` values a chunk's kept positions and values stand for (a position of ``chunk``
    keeps nothing)."""
    out = torch.zeros(positions.shape[0], chunk + 1)
    return out.scatter_(1, positions, values)[:, :chunk]


@pytest.mark.parametrize(
    ("chunk", "k", "bits"), [(4096, 64, 2), (64, 8, 2), (100, 7, 4), (32, 5, 8), (64, 6, 32), (16, 16, 2), (64, 1, 4)]
)
def test_payload_and_values_match_the_wire_format_bit_for_bit(chunk, k, bits):
    g = torch.Generator().manual_seed(chunk + k + bits)
    block = torch.randn(3, chunk, generator=g) * torch.tensor([[1.0], [1e-3], [40.0]])
    codec = TopKCodec(chunk, k, bits)
    payload, positions, kept = codec.encode(block)
    expected, rebuilt = reference_encode(block.numpy(), k, bits)
    assert payload.numel() == codec.payload_bytes(3) == len(expected)
    assert bytes(payload.tolist()) == expected
    assert torch.equal(dense(positions, kept, chunk), torch.from_numpy(rebuilt))
    # the decoder rebuilds exactly what the encoder reported, from the bytes alone
    got_positions, got_values = codec.decode(torch.stack([payload, payload]), 3)
    for r in range(2):
        assert torch.equal(got_positions[r], positions)
        assert torch.equal(got_values[r], kept)


def test_payload_size_by_hand():
    # 4096/64 at 2 bits: 8 bytes of scales; positions: 6 low bits each (48 bytes) and a vector of
    # 64 + 64 bits (16 bytes); 64 codes of 2 bits (16 bytes)
    assert TopKCodec(4096, 64, 2).payload_bytes(10) == 10 * (8 + 48 + 16 + 16)
    # float32 values, 5 of 32: no scales; 2 low bits (32 / 5 = 6.4) per position, 20 bits for two
    # chunks (3 bytes); vectors of 5 + 8 bits, 26 bits (4 bytes); 10 floats
    assert TopKCodec(32, 5, 32).payload_bytes(2) == 3 + 4 + 2 * 5 * 4
    # every value kept: no low bits, a vector of 2 * chunk bits, i.e. 2 bits per position
    assert TopKCodec(4096, 4096, 2).payload_bytes(1) == 8 + 1024 + 1024


def test_a_payload_with_the_wrong_number_of_positions_is_refused():
    codec = TopKCodec(64, 8, 2)
    payload, _, _ = codec.encode(torch.randn(2, 64, generator=torch.Generator().manual_seed(0)))
    low, _ = codec.positions_bytes(2)
    broken = payload.clone()
    broken[16 + low] ^= 0x01  # one bit of the first chunk's vector flipped: 7 or 9 positions
    with pytest.raises(ValueError, match="do not hold 8 per chunk"):
        codec.decode(broken.unsqueeze(0), 2)


def test_zero_chunks_and_equal_magnitudes_rebuild_exactly():
    codec = TopKCodec(16, 4, 2)
    block = torch.zeros(2, 16)
    block[1, [1, 5, 9, 13]] = torch.tensor([0.5, -0.5, 0.5, -0.5])
    _, positions, kept = codec.encode(block)
    assert torch.equal(dense(positions, kept, 16), block)


@pytest.mark.parametrize("width", [1, 5, 12, 13])
def test_pack_uint_round_trip_and_bit_order(width):
    values = torch.randint(0, 2**width, (37,), generator=torch.Generator().manual_seed(width))
    packed = pack_uint(values, width)
    assert packed.numel() == math.ceil(37 * width / 8)
    assert torch.equal(unpack_uint(packed, width, 37), values)
    bitstring = "".join(format(int(v), f"0{width}b") for v in values)
    assert format(int(packed[0]), "08b") == bitstring[:8]


def test_error_feedback_with_decay_follows_the_equations_on_one_rank():
    """One rank: the average is what it sent. e = beta e + G; s = Q(topk(e)); e -= s, round after round."""
    beta, chunk, k = 0.9, 64, 6
    exchange = SparseAllGather(TopKCodec(chunk, k, 2), LocalCommunicator(), decay=beta)
    codec = TopKCodec(chunk, k, 2)
    shapes = {"w": (10, 20), "v": (3, 7)}  # 200 values: 4 chunks, the last padded; 21 values: 1 chunk
    e = {n: torch.zeros(s) for n, s in shapes.items()}
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        grads = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        out = exchange({n: t.clone() for n, t in grads.items()})
        assert exchange.nonfinite == []
        for n, s in shapes.items():
            acc = e[n] * beta + grads[n]
            flat = torch.zeros(-(-acc.numel() // chunk) * chunk)
            flat[: acc.numel()] = acc.reshape(-1)
            _, positions, kept = codec.encode(flat.view(-1, chunk))
            sent = dense(positions, kept, chunk).reshape(-1)[: acc.numel()].view(s)
            assert torch.equal(out[n], sent), n
            e[n] = acc - sent
            torch.testing.assert_close(exchange.residuals[n], e[n], atol=0, rtol=0)
            assert (sent != 0).sum() <= k * flat.numel() // chunk


@pytest.mark.parametrize("bits", [2, 32])
@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_value_is_reported_and_leaves_the_error_feedback_as_it_was(bits, bad_value):
    exchange = SparseAllGather(TopKCodec(64, 4, bits), LocalCommunicator(), decay=0.95)
    exchange({"w": torch.randn(8, 16), "v": torch.randn(4, 4)})
    before = {n: r.clone() for n, r in exchange.residuals.items()}
    bad = torch.randn(8, 16)
    bad[3, 3] = bad_value
    out = exchange({"w": bad, "v": torch.randn(4, 4)})
    assert exchange.nonfinite == ["w"]
    assert not torch.isfinite(out["w"]).all()
    for n in before:
        assert torch.equal(exchange.residuals[n], before[n])


def test_small_tensors_stay_dense_and_large_ones_go_sparse():
    ex = TensorExchange(LocalCommunicator(), 2, codec="topk", small_tensor_numel=16, topk_chunk=64, topk_per_chunk=4)
    assert isinstance(ex.quantized, SparseAllGather)
    assert ex.quantizes(torch.zeros(8, 8)) and ex.quantizes(torch.zeros(100))  # a long bias too
    assert not ex.quantizes(torch.zeros(4, 4)) and not ex.quantizes(torch.zeros(16))
    dense4 = TensorExchange(LocalCommunicator(), 4, small_tensor_numel=16)
    assert dense4.quantizes(torch.zeros(8, 8)) and not dense4.quantizes(torch.zeros(100))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SparseLoCoStrategy(topk_per_chunk=0), "topk_per_chunk must be an int in"),
        (lambda: SparseLoCoStrategy(topk_chunk=64, topk_per_chunk=65), "topk_per_chunk must be an int in"),
        (lambda: SparseLoCoStrategy(topk_chunk=1), "topk_chunk must be an int >= 2"),
        (lambda: SparseLoCoStrategy(error_feedback_decay=0.0), "error_feedback_decay must be a number in (0, 1]"),
        (lambda: SparseLoCoStrategy(pseudo_grad_bits=16), "pseudo_grad_bits=16"),
        (lambda: SparseLoCoStrategy(pseudo_grad_codec="uniform"), "pseudo_grad_codec='uniform'"),
        (lambda: SparseLoCoStrategy(outer_momentum=0.9), "does not take outer_momentum"),
        (lambda: DiLoCoStrategy(pseudo_grad_bits=4, error_feedback_decay=0.9), "applies to pseudo_grad_codec='topk'"),
        (lambda: DiLoCoStrategy(pseudo_grad_bits=1, pseudo_grad_codec="topk"), "pseudo_grad_bits=1"),
    ],
)
def test_bad_settings_are_refused_at_construction(build, message):
    with pytest.raises(ValueError, match=None) as info:
        build()
    assert message in str(info.value)


def test_sparseloco_preset_is_outer_sgd_without_momentum_over_the_topk_exchange():
    s = SparseLoCoStrategy(sync_period=16, num_fragments=2, fragment_sync_delay=1)
    assert (s.pseudo_grad_codec, s.pseudo_grad_bits, s.topk_chunk, s.topk_per_chunk) == ("topk", 2, 4096, 64)
    assert s.error_feedback_decay == 0.95 and s.fragment_sync_delay == 1 and s.keep_local_progress
    assert SparseLoCoStrategy(sync_period=1).fragment_sync_delay == 0  # no room for a delay
    with pytest.raises(ValueError, match="keep_local_progress=True keeps every local step"):
        SparseLoCoStrategy(fragment_update_alpha=0.5)
    outer = s.outer_factory()([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(outer, torch.optim.SGD)
    assert outer.param_groups[0]["lr"] == 1.0 and outer.param_groups[0]["momentum"] == 0.0


def test_saved_residuals_name_their_codec_and_another_codec_refuses_them():
    sparse = TensorExchange(LocalCommunicator(), 2, codec="topk", topk_chunk=64, topk_per_chunk=4)
    sparse.quantized({"w": torch.randn(8, 8)})
    state = sparse.state_dict()
    assert state["codec"] == "topk"
    sparse.check_state(state, {"w": torch.Size([8, 8])})
    dense = TensorExchange(LocalCommunicator(), 4)
    with pytest.raises(ValueError, match="its residuals are sparse"):
        dense.check_state(state, {"w": torch.Size([8, 8])})
    with pytest.raises(ValueError, match="its residuals are dense"):
        sparse.check_state({"residuals": {"w": torch.zeros(8, 8)}, "residuals2": {}}, {"w": torch.Size([8, 8])})


@pytest.mark.parametrize("bits", [2, 32])
def test_a_chunk_with_fewer_values_than_k_keeps_only_those_and_empty_slots_after_them(bits):
    codec = TopKCodec(8, 4, bits)
    block = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0, -1.0, 0.0, 0.0], [0.0] * 8])
    payload, positions, kept = codec.encode(block)
    assert positions.tolist() == [[2, 5, 8, 8], [8, 8, 8, 8]]  # 8: one past the chunk's end, nothing kept
    assert kept[:, 2:].eq(0).all() and kept[1].eq(0).all()
    got_positions, got_values = codec.decode(payload.unsqueeze(0), 2)
    assert torch.equal(got_positions[0], positions) and torch.equal(got_values[0], kept)


@pytest.mark.parametrize("codec", ["uniform", "topk"])
def test_one_rank_reports_a_non_finite_pseudo_gradient_as_many_ranks_do(codec):
    """On one rank the average is the tensor itself, unchanged; an inf or a NaN in it is still
    reported by name, so that ``nonfinite="raise"`` or ``"skip"`` acts on one rank as on several."""
    ex = TensorExchange(LocalCommunicator(), 4, codec=codec, small_tensor_numel=16, topk_chunk=64, topk_per_chunk=4)
    good, bad = torch.randn(8, 64), torch.randn(3)
    bad[1] = float("nan")
    kept = good.clone()
    assert ex.average({"w": good, "b": bad}) == ["b"]
    assert torch.equal(good, kept)
    assert ex.average({"w": good}) == []


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kept_zeros_rebuild_as_zeros_and_the_real_values_keep_their_own_range(bits):
    """A chunk with fewer non-zero values than ``k`` keeps zeros: exact zeros of the data, or the padding
    after a tensor's end. They must rebuild as 0 (not as the lowest magnitude bin: +lo + step / 2), and
    the scales must be the real values' (a kept 0 had put ``lo`` at 0, and values of 0.9 to 1.0 all
    fell in one bin at 2 bits)."""
    codec = TopKCodec(16, 8, bits)
    block = torch.zeros(2, 16)
    block[0, [2, 7, 11]] = torch.tensor([1.0, -0.9, 0.95])  # 3 values and 13 zeros: 5 zeros kept
    block[1] = torch.randn(16, generator=torch.Generator().manual_seed(1))  # a full chunk beside it
    payload, positions, kept = codec.encode(block)
    got_positions, got_values = codec.decode(payload.unsqueeze(0), 2)
    half_bin = (1.0 - 0.9) / 2 ** (bits - 1) / 2
    for where, values in ((positions, kept), (got_positions[0], got_values[0])):
        rebuilt = dense(where, values, 16)
        assert torch.equal(rebuilt[0] != 0, block[0] != 0), rebuilt[0]
        assert float((rebuilt[0] - block[0]).abs().max()) <= half_bin + 1e-6
        assert int((rebuilt[1] != 0).sum()) == 8


def test_the_exchange_sends_no_spurious_values_for_zeros_or_padding():
    """One rank's exchange: a tensor with 10 non-zero values in a chunk that keeps 32 sends those 10 and
    nothing else (22 values of +hi/4 before the fix); the real values of a tensor's last, padded chunk
    are rebuilt on their own range, not on one stretched down to the padding's 0."""
    exchange = SparseAllGather(TopKCodec(64, 32, 2), LocalCommunicator(), decay=1.0)
    g = torch.Generator().manual_seed(0)
    z = torch.zeros(4, 16)
    z.view(-1)[torch.randperm(64, generator=g)[:10]] = 1.0 + torch.rand(10, generator=g)
    w = torch.randn(2, 40, generator=g)
    w.view(-1)[64:] = (1.0 + 0.1 * torch.rand(16, generator=g)) * torch.sign(torch.randn(16, generator=g))
    out = exchange({"z": z.clone(), "w": w.clone()})
    assert int((out["z"] != 0).sum()) == 10
    assert torch.equal(out["z"] != 0, z != 0)
    tail, sent = w.view(-1)[64:], out["w"].view(-1)[64:]  # 16 values of magnitude 1 to 1.1, all kept
    assert float((sent - tail).abs().max()) <= 0.1 / 2 / 2 + 1e-6
    assert torch.equal(exchange.residuals["z"] + out["z"], z)
