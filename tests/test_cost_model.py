import pytest
import torch

from lightning_commstrats import cost_model as cm
from lightning_commstrats.compression import ColumnCodec

MODEL = cm.ModelShape(shapes=((1000, 64), (64,), (256, 64)), vocab_size=1000, vocab_width=65)
K = 1000 * 64 + 64 + 256 * 64
B = 100e6  # 100 Mbit/s


def test_parameter_server_and_ring_formulas():
    # one server on rank 0: its link receives the 3 others' K values, then sends them K values each
    assert cm.parameter_server(MODEL, 4, B) == pytest.approx(2 * 3 * K * 4 * 8 / B)
    # four servers: a rank receives 3 x K/4 pushes while sending its 3 K/4, then the same for the
    # replies: the ring's 1.5 K
    assert K % 4 == 0
    assert cm.parameter_server(MODEL, 4, B, num_servers=4) == pytest.approx(1.5 * K * 4 * 8 / B)
    assert cm.parameter_server(MODEL, 4, B, num_servers=4) == pytest.approx(cm.ring_allreduce(MODEL, 4, B))
    # two servers: a server receives 3 x K/2 in each phase
    assert cm.parameter_server(MODEL, 4, B, num_servers=2) == pytest.approx(2 * 1.5 * K * 4 * 8 / B)
    assert cm.parameter_server(MODEL, 1, B) == 0.0
    with pytest.raises(ValueError, match="num_servers must be in"):
        cm.parameter_server(MODEL, 4, B, num_servers=5)
    assert cm.ring_allreduce(MODEL, 4, B) == pytest.approx(2 * 3 * K * 4 * 8 / (4 * B))
    assert cm.ring_allreduce(MODEL, 1, B) == 0.0


def test_onebit_is_about_a_32nd_of_the_ring_for_the_matrices():
    t1, t32 = cm.onebit(MODEL, 4, B, bits=1), cm.ring_allreduce(MODEL, 4, B)
    assert 1 / 32 < t1 / t32 < 1 / 25
    # the quantized bytes are the codec's payloads: rank 0's stripes of 250 and 64 columns
    c = ColumnCodec(1)
    expected = 3 * c.payload_bytes(16, 1000) + 3 * c.payload_bytes(16, 1000)  # stage 1 + stage 2 for (1000, 64)
    expected += 3 * c.payload_bytes(16, 256) + 3 * c.payload_bytes(16, 256)
    assert cm.quantized_bytes([(1000, 64), (256, 64)], 4, 1) == expected


def test_periodic_and_sampled_rows():
    assert cm.periodic(MODEL, 4, B, 8) == pytest.approx(cm.ring_allreduce(MODEL, 4, B) / 8)
    all_rows = cm.sampled_rows(MODEL, 4, B, rows=1000)
    few = cm.sampled_rows(MODEL, 4, B, rows=100, ids_per_rank=50)
    assert few < all_rows
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        cm.seconds(10, 0)


def test_model_shape_of_a_module_counts_tied_parameters_once():
    emb = torch.nn.Embedding(10, 4)
    out = torch.nn.Linear(4, 10)
    out.weight = emb.weight
    shape = cm.ModelShape.of(torch.nn.ModuleList([emb, out]))
    assert shape.numel == 10 * 4 + 10


def test_per_row_quantized_bytes_by_hand():
    # 4 ranks, 4 bits, one scale pair (2 float32) per row: (1000, 64) in stripes of 250 rows,
    # 250 * 8 + 250 * 64 * 4 / 8 = 10000 bytes each; (256, 64) in stripes of 64 rows, 512 + 2048.
    # Rank 0 sends the 3 other stripes (all-to-all), then its own 3 times (all-gather).
    assert cm.quantized_bytes([(1000, 64), (256, 64)], 4, 4, by_rows=True) == 6 * 10000 + 6 * 2560
    # uneven stripes, 3 ranks, 8 bits: (10, 8) by rows is 4, 4 and 2 rows of 8 values:
    # 4 * 8 + 4 * 8 = 64 bytes, 2 * 8 + 2 * 8 = 32; stage 1: 64 + 32, stage 2: 2 x the largest, 64
    assert cm.quantized_bytes([(10, 8)], 3, 8, by_rows=True) == 96 + 128
    # the same by columns: 3, 3 and 2 columns of 10 values: 3 * 8 + 30 = 54, 2 * 8 + 20 = 36
    assert cm.quantized_bytes([(10, 8)], 3, 8) == 54 + 36 + 2 * 54


def test_exchange_and_diloco_bytes_by_hand():
    # the bias travels in fp32 beside the quantized matrices: a ring of 64 values, 6 * 16 * 4 bytes
    assert cm.exchange_bytes(MODEL.shapes, 4, 4, by_rows=True) == 6 * 10000 + 6 * 2560 + 6 * 16 * 4
    # a matrix of at most small_tensor_numel values travels in fp32 too: (256, 64) joins the bias
    assert cm.exchange_bytes(MODEL.shapes, 4, 4, by_rows=True, small_tensor_numel=16384) == 6 * 10000 + 6 * 4112 * 4
    assert cm.exchange_bytes(MODEL.shapes, 4, 32) == 6 * 20112 * 4  # fp32: the ring of everything
    assert cm.exchange_bytes(MODEL.shapes, 1, 4) == 0
    per_step = (6 * 10000 + 6 * 2560 + 6 * 16 * 4) / 16
    assert cm.diloco(MODEL, 4, B, 16, bits=4) == pytest.approx(per_step * 8 / B)
    with pytest.raises(ValueError, match="period_steps must be > 0"):
        cm.diloco(MODEL, 4, B, 0)


def test_powersgd_bytes_by_hand():
    # rank 1: (1000, 64) compresses ((1000 + 64) * 2 < 64000): P 1000, Q 64; (256, 64): P 256, Q 64;
    # the bias (64 x 1) does not ((64 + 1) * 2 >= 64). Three rings: 64, 1256 and 128 values.
    expected = 6 * 16 * 4 + 6 * 314 * 4 + 6 * 32 * 4
    assert cm.powersgd_bytes(MODEL.shapes, 4, 1) == expected
    assert cm.powersgd(MODEL, 4, B, 1) == pytest.approx(expected * 8 / B)
    # an 8 x 8 matrix at rank 4: (8 + 8) * 4 * 2 = 128 >= 64, sent whole with the bias: 128 values
    assert cm.powersgd_bytes([(8, 8), (64,)], 4, 4) == 6 * 32 * 4
    # the fp16 hook: half the ring
    assert cm.ring_allreduce(MODEL, 4, B, element_size=2) == pytest.approx(cm.ring_allreduce(MODEL, 4, B) / 2)
