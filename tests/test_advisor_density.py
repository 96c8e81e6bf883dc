"""The advisor's predictions for SparseLoCo's published form and the dense statistical codec: bytes by hand
(the payloads of ``tests/multiprocess/test_density_ranks.py``), what the note says, and the default grid."""

import math

import pytest

from lightning_commstrats import advisor
from lightning_commstrats.cost_model import ModelShape

SHAPES = [(16, 32), (16,), (2, 16), (2,)]
B = 100e6


def test_published_and_statistical_bytes_by_hand():
    # tiles of 8 x 8 keeping 4: a payload of 108 bytes per rank and sync (counted by hand in the ranks
    # test); a ring all-gather on 3 ranks sends the two other ranks' payloads; a sync every 4 steps
    settings = {"sync_period": 4, "topk_form": "published", "topk_tile": 8, "topk_per_chunk": 4}
    c = advisor.predict("sparseloco", settings, SHAPES, bandwidth=B / 1e6, compute_seconds=0.1, ranks=3)
    assert c.bytes_per_step == 2 * 108 / 4
    assert "top 4 per tile of 8 x 8 in 2 bits" in c.note
    scheduled = advisor.predict(
        "sparseloco", {**settings, "topk_schedule": "run"}, SHAPES, bandwidth=B / 1e6, compute_seconds=0.1, ranks=3
    )
    assert scheduled.bytes_per_step == c.bytes_per_step and "topk_schedule='run', not counted here" in scheduled.note
    # every value in 2 bits: 562 codes (141 bytes) and a lookup of 4 float32 per tensor (64 bytes)
    dense = {"sync_period": 4, "pseudo_grad_codec": "statistical", "small_tensor_numel": 0}
    d = advisor.predict("diloco", dense, SHAPES, bandwidth=B / 1e6, compute_seconds=0.1, ranks=3)
    assert d.bytes_per_step == 2 * (64 + 141) / 4 and "every value in 2 bits on a statistical grid" in d.note
    # the default small tensors (at most 1024 values) go in an fp32 ring all-reduce: here every tensor, its
    # 562 values in 3 chunks of 188, each sent twice less once (2 (N - 1) chunks of 752 bytes)
    d = advisor.predict(
        "diloco",
        {"sync_period": 4, "pseudo_grad_codec": "statistical"},
        SHAPES,
        bandwidth=B / 1e6,
        compute_seconds=0.1,
        ranks=3,
    )
    assert d.bytes_per_step == 2 * 2 * math.ceil(562 / 3) * 4 / 4


def test_bad_settings_name_themselves_and_the_grid_holds_the_new_entries():
    with pytest.raises(ValueError, match="topk_schedule"):
        advisor.predict(
            "sparseloco",
            {"sync_period": 4, "topk_form": "published", "topk_schedule": "soon"},
            SHAPES,
            bandwidth=B / 1e6,
            compute_seconds=0.1,
            ranks=2,
        )
    with pytest.raises(ValueError, match="pseudo_grad_bits"):
        advisor.predict(
            "diloco",
            {"sync_period": 4, "pseudo_grad_codec": "statistical", "pseudo_grad_bits": 32},
            SHAPES,
            bandwidth=B / 1e6,
            compute_seconds=0.1,
            ranks=2,
        )
    model = ModelShape(tuple(SHAPES), 0, 0)
    grid = advisor.default_settings("sparseloco", model, bandwidth=B / 1e6, compute_seconds=0.1, ranks=2)
    assert {"sync_period": 16, "topk_form": "published", "topk_schedule": "run"} in grid
    grid = advisor.default_settings("diloco", model, bandwidth=B / 1e6, compute_seconds=0.1, ranks=2)
    assert {"sync_period": 16, "pseudo_grad_codec": "statistical"} in grid
