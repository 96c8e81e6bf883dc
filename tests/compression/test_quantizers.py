import math

import pytest
import torch

from lightning_commstrats.compression import ColumnCodec, pack_bits, packed_bytes, unpack_bits


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_packing_round_trips_into_ceil_n_bits_over_8_bytes(bits, n):
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8) == packed_bytes(n, bits)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_first_code_goes_to_the_most_significant_bits(bits):
    per_byte = 8 // bits
    codes = torch.randint(0, 1 << bits, (per_byte * 3,), dtype=torch.uint8)
    expected = [sum(int(codes[b * per_byte + i]) << (8 - bits * (i + 1)) for i in range(per_byte)) for b in range(3)]
    assert pack_bits(codes, bits).tolist() == expected


def test_one_bit_reconstruction_values_are_the_two_means_and_keep_the_column_mean():
    torch.manual_seed(0)
    cols = torch.randn(5, 301) + torch.tensor([[0.0], [0.5], [-2.0], [10.0], [0.0]])
    cols[4] = -torch.rand(301)  # a column with no non-negative entry
    codec = ColumnCodec(1)
    payload, deq = codec.encode(cols)
    assert payload.numel() == 5 * 2 * 4 + math.ceil(5 * 301 / 8)
    scales = payload[: 5 * 2 * 4].view(torch.float32).view(2, 5)
    for j, col in enumerate(cols):
        pos, neg = col[col >= 0], col[col < 0]
        pos_mean = pos.double().mean().float() if pos.numel() else torch.tensor(0.0)
        neg_mean = neg.double().mean().float() if neg.numel() else torch.tensor(0.0)
        assert len(set(deq[j].tolist())) <= 2
        neg_sent, pos_sent = scales[0, j], scales[1, j]  # the two floats that travel
        torch.testing.assert_close(pos_sent, pos_mean, rtol=1e-6, atol=0)
        torch.testing.assert_close(neg_sent, neg_mean, rtol=1e-6, atol=0)
        torch.testing.assert_close(deq[j][col >= 0], pos_mean.expand(pos.numel()), rtol=1e-6, atol=0)
        torch.testing.assert_close(deq[j][col < 0], neg_mean.expand(neg.numel()), rtol=1e-6, atol=0)
        torch.testing.assert_close(deq[j].double().mean(), col.double().mean(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16])
def test_decode_reproduces_encode_bit_for_bit(bits):
    torch.manual_seed(bits)
    block = torch.randn(13, 77) * torch.logspace(-3, 2, 13).unsqueeze(1)
    codec = ColumnCodec(bits)
    payload, deq = codec.encode(block)
    assert payload.numel() == codec.payload_bytes(13, 77)
    assert torch.equal(codec.decode(payload, 13, 77), deq)


def test_constant_and_zero_columns_survive_exactly():
    block = torch.stack([torch.zeros(40), torch.full((40,), 3.25), torch.full((40,), -1.5)])
    for bits in (1, 2, 4, 8, 16):
        _, deq = ColumnCodec(bits).encode(block)
        torch.testing.assert_close(deq, block, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_error_feedback_is_lossless_over_time(bits):
    torch.manual_seed(0)
    codec = ColumnCodec(bits)
    residual = torch.zeros(6, 50)
    sent_total = torch.zeros(6, 50, dtype=torch.float64)
    true_total = torch.zeros(6, 50, dtype=torch.float64)
    for _ in range(40):
        g = torch.randn(6, 50)
        v = g + residual
        payload, deq = codec.encode(v)
        residual = v - deq
        sent_total += codec.decode(payload, 6, 50).double()
        true_total += g.double()
    torch.testing.assert_close(sent_total, true_total - residual.double(), rtol=0, atol=1e-4)
    # and the residual stays bounded: the error is sent, not accumulated
    assert residual.abs().max() < 10


def test_error_shrinks_with_bits():
    torch.manual_seed(0)
    block = torch.randn(64, 2048)
    errors = []
    for bits in (1, 2, 4, 8, 16):
        _, deq = ColumnCodec(bits).encode(block)
        errors.append(((deq - block).norm() / block.norm()).item())
    assert errors == sorted(errors, reverse=True) and len(set(errors)) == 5
    assert errors[0] < 0.65 and errors[-1] < 1e-3


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits must be one of"):
        ColumnCodec(3)
    with pytest.raises(ValueError, match="contiguous 2-D float32"):
        ColumnCodec(1).encode(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="payload has 3 bytes"):
        ColumnCodec(1).decode(torch.zeros(3, dtype=torch.uint8), 4, 4)


def test_a_row_far_from_zero_keeps_its_spread():
    # 1000 +- 0.01: E[x^2] - mean^2 cancels to 0 in float32, which squashed the row to its mean
    torch.manual_seed(0)
    rows = 1000.0 + 0.01 * torch.randn(4, 256)
    _, deq = ColumnCodec(8).encode(rows)
    assert (deq - rows).abs().max() < 0.002  # 8 bits over about +-4 standard deviations
