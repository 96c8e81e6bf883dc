import pytest
import torch

from lightning_commstrats import cost_model as cm
from lightning_commstrats.compression import ColumnCodec

MODEL = cm.ModelShape(shapes=((1000, 64), (64,), (256, 64)), vocab_size=1000, vocab_width=65)
K = 1000 * 64 + 64 + 256 * 64
B = 100e6  # 100 Mbit/s


def test_parameter_server_and_ring_formulas():
    assert cm.parameter_server(MODEL, 4, B) == pytest.approx(2 * 4 * K * 4 * 8 / B)
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
