"""The MoE benchmark scripts on tiny settings: the layer speed comparison runs both variants (and
checks they agree), the balance summary reads a run's record as the table needs it."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe_balance
import moe_layer_speed


@pytest.mark.parametrize("balance", ["aux", "swipe"])
def test_layer_speed_measures_both_variants_on_the_same_output(balance):
    case = moe_layer_speed.Case("tiny", 16, 8, 4, 1, balance, tokens=40)
    result = moe_layer_speed.measure(case, rounds=1, iters=1)
    assert result["before"] > 0 and result["after"] > 0 and result["experts"] == "grouped GEMM"


def test_the_former_swipe_kept_in_the_benchmark_is_the_former_algorithm():
    from lightning_commstrats.moe import swipe_assign

    probs = torch.softmax(torch.randn(30, 4, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(moe_layer_speed.former_swipe_assign(probs), swipe_assign(probs))


def test_balance_summary_by_hand():
    # two steps, one layer of two experts: [3, 1] then [2, 2]; one dropped slot of ten
    record = {"loads": [[[3, 1]], [[2, 2]]], "dropped": [1, 0], "slots": [5, 5], "val": [(2, 150.0)]}
    r = moe_balance.summarize(record, warmup=0, last=1)
    assert r["balance_mean"] == pytest.approx((1.5 + 1.0) / 2) and r["balance_max"] == 1.5
    assert r["share_at_most_1.1"] == 0.5 and r["last_mean"] == 1.0 and r["last_pooled"] == 1.0
    assert r["dropped_share"] == 0.1 and r["val_ppl"] == 150.0
    assert moe_balance.summarize(record, warmup=0, last=2)["last_pooled"] == pytest.approx(5 / 4)
