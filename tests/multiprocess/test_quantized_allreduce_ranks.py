"""The two-stage quantized all-reduce on real ranks against a simulation of all ranks."""

import pytest
import torch
from harness import WORKER, run_ranks

pytestmark = pytest.mark.multiprocess

QUANT_WORKER = WORKER.parent / "quant_worker.py"
SHAPES = [[40, 7], [5, 3, 4], [16, 2], [9, 33]]  # stripes of 2, 3 (and empty) columns on 4 ranks


@pytest.mark.parametrize(("bits", "world"), [(1, 2), (1, 4), (2, 4), (8, 2), (16, 2)])
def test_matches_the_reference_bit_for_bit_and_ranks_agree(bits, world):
    results = run_ranks({"bits": bits, "shapes": SHAPES, "steps": 3}, world, script=QUANT_WORKER)
    for step in range(3):
        for res in results[1:]:
            for name, value in res[step]["got"].items():
                assert torch.equal(value, results[0][step]["got"][name])
    # the average is close to the true mean, closer with more bits
    got, true = results[0][2]["got"], results[0][2]["true"]
    err = sum((got[n] - true[n]).norm() ** 2 for n in got) ** 0.5 / sum(true[n].norm() ** 2 for n in got) ** 0.5
    assert err < {1: 1.0, 2: 0.6, 8: 0.05, 16: 1e-3}[bits]
