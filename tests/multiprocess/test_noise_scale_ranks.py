"""``GradientNoiseScale`` on real ranks: the logged noise scale is the one computed by hand from each
rank's own gradient, recorded before the exchange, and every rank logs the same values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from harness import run_ranks

from lightning_commstrats.batching.noise_scale import count_sketch

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "noise_scale_worker.py"
BETA, BATCH, STEPS, WORLD = 0.5, 4, 8, 2


def by_hand(ranks: list[dict], *, sketch: int | None = None, seed: int = 0, accumulate: int = 1) -> list[float]:
    """The noise scale after every step, from the ranks' own gradients (float64), written from the
    paper's equations: the mean of the ranks' squared norms at B_small, the squared norm of their
    average at B_big, the two unbiased estimates averaged apart, then their ratio."""
    g2_avg = trace_avg = 0.0
    out = []
    for t in range(STEPS):
        own = [torch.cat([g.double().reshape(-1) for g in r["own"][t].values()]) for r in ranks]
        b_small = sum(ranks[0]["batches"][t * accumulate : (t + 1) * accumulate])  # the step's samples
        assert all(r["batches"] == ranks[0]["batches"] for r in ranks)
        b_big = b_small * len(ranks)
        small = sum(float(g.square().sum()) for g in own) / len(own)
        if sketch is None:
            big = float((sum(own) / len(own)).square().sum())
        else:  # each rank's count sketch (hashes of step t, alike on every rank), averaged
            sketches = [count_sketch([g], sketch, torch.Generator().manual_seed(seed * 1_000_003 + t)) for g in own]
            big = float((sum(sketches) / len(sketches)).square().sum())
        g2 = (b_big * big - b_small * small) / (b_big - b_small)
        trace = (small - big) / (1 / b_small - 1 / b_big)
        g2_avg = BETA * g2_avg + (1 - BETA) * g2
        trace_avg = BETA * trace_avg + (1 - BETA) * trace
        out.append(trace_avg / g2_avg if g2_avg > 0 else math.nan)
    return out


def same_on_every_rank(ranks: list[dict]) -> None:
    """Every rank logged the same numbers, bit for bit."""
    for r in ranks[1:]:
        for mine, theirs in zip(ranks[0]["logged"], r["logged"], strict=True):
            assert mine.keys() == theirs.keys()
            for k in mine:
                torch.testing.assert_close(mine[k], theirs[k], rtol=0, atol=0, equal_nan=True)


def scenario(strategy: str, callback: dict | None = None, **kwargs) -> dict:
    return {
        "strategy": strategy,
        "kwargs": kwargs,
        "callback": {"beta": BETA, **(callback or {})},
        "max_steps": STEPS,
        "batch_size": BATCH,
    }


def test_the_logged_noise_scale_is_the_one_computed_by_hand_and_the_batch_grows_alike_on_every_rank():
    # a scale so large that the batch doubles at every check once the noise scale is defined (steps
    # 1 and 2 measure |G|^2 < 0 here): 4, then 8 from the check after step 4, then the cap of 12
    grow = {"max_batch_size": 12, "check_every_n_steps": 2, "scale": 1e6}
    results = run_ranks({"scenarios": {"allreduce": scenario("allreduce", grow)}}, WORLD, script=WORKER, timeout=240)
    ranks = [r["allreduce"] for r in results]
    assert [r["mode"] for r in ranks] == ["exact", "exact"]
    expected = by_hand(ranks)
    for r in ranks:
        print("batches:", r["batches"], "logged batch sizes:", [s.get("train/batch_size") for s in r["logged"]])
        assert r["batches"] == ranks[0]["batches"]  # every rank trains on batches of the same sizes
        assert r["batches"] == [4, 4, 4, 4, 8, 8, 12, 12]
        # train/batch_size: the size of the next batch, after the step's check
        assert [s["train/batch_size"] for s in r["logged"]] == [*r["batches"][1:], 12]
        # not logged while not defined (a NaN reads as divergence), here at steps 1 and 2
        assert ["train/noise_scale" in s for s in r["logged"]] == [not math.isnan(v) for v in expected]
        assert math.isnan(expected[0])
        got = [s.get("train/noise_scale", math.nan) for s in r["logged"]]
        print("allreduce, logged:", [f"{v:.4f}" for v in got], "by hand:", [f"{v:.4f}" for v in expected])
        # the exchange averages in fp32, the hand in float64
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0, equal_nan=True)
        assert sum(not math.isnan(v) for v in got) >= STEPS - 2
        # the measurement's traffic: one all-reduce of 3 float64 per step (a ring over 2 ranks: 2 chunks of 2)
        print("allreduce, noise-scale bytes sent per step:", r["stats"]["noise_scale/bytes_sent"] / STEPS)
        assert r["stats"]["noise_scale/bytes_sent"] == 32 * STEPS
    same_on_every_rank(ranks)


@pytest.mark.slow
def test_under_onebit_sgd_the_sketch_of_each_ranks_gradient_is_measured_and_accumulation_counts_its_batches():
    spec = {
        "scenarios": {
            "onebit": scenario("onebit_sgd", small_tensor_numel=16),
            "accumulate": {**scenario("allreduce"), "accumulate": 2},
        }
    }
    results = run_ranks(spec, WORLD, script=WORKER, timeout=240)
    # with gradient accumulation, a step's B_small is the samples of its 2 batches
    ranks = [r["accumulate"] for r in results]
    expected = by_hand(ranks, accumulate=2)
    for r in ranks:
        assert len(r["batches"]) == 2 * STEPS
        got = [s.get("train/noise_scale", math.nan) for s in r["logged"]]
        print("accumulate 2, logged:", [f"{v:.4f}" for v in got], "by hand:", [f"{v:.4f}" for v in expected])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0, equal_nan=True)
    same_on_every_rank(ranks)
    ranks = [r["onebit"] for r in results]
    assert [r["mode"] for r in ranks] == ["sketch", "sketch"]
    expected = by_hand(ranks, sketch=256)
    for r in ranks:
        got = [s.get("train/noise_scale", math.nan) for s in r["logged"]]
        print("onebit_sgd, logged:", [f"{v:.4f}" for v in got], "by hand:", [f"{v:.4f}" for v in expected])
        # Lightning keeps logged values in float32
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, equal_nan=True)
        # the 1-bit average the optimizer stepped on is not the exact one the sketch stands for
        exact = sum(torch.cat([g.reshape(-1) for g in q["own"][0].values()]) for q in ranks) / WORLD
        stepped = torch.cat([g.reshape(-1) for g in r["averaged"][0].values()])
        assert not torch.allclose(stepped, exact, rtol=1e-3, atol=0)
        # 3 float64 and a sketch of 256 float64 per step
        print("onebit_sgd, noise-scale bytes sent per step:", r["stats"]["noise_scale/bytes_sent"] / STEPS)
    same_on_every_rank(ranks)


ADAM_SCHEMES = {
    "onebit_adam": scenario("onebit_adam", freeze_step=3, small_tensor_numel=16),
    # fp32 variance steps (1, 2, 4), a 1-bit round (3), then local steps (7) between rounds (5, 6, 8)
    "zero_one_adam": scenario(
        "zero_one_adam",
        var_freeze_step=4,
        var_update_scaler=2,
        local_step_scaler=1,
        local_step_clipper=4,
        small_tensor_numel=16,
    ),
}


# a run of two ranks each (8 to 11 s on two quiet cores): zero_one_adam, which had no step measured
# at all, in the quick suite
@pytest.mark.parametrize("scheme", [pytest.param("onebit_adam", marks=pytest.mark.slow), "zero_one_adam"])
def test_under_the_adam_schemes_every_step_is_measured_from_the_sketch_of_each_ranks_gradient(scheme):
    # both take Adam's step at the exchange and clear the gradients there: the averaged gradient is
    # never held, and the sketch of each rank's own (taken before the exchange) stands for it, at
    # every step: the fp32 warm-up, the 1-bit rounds and 0/1 Adam's local steps (no exchange at all)
    spec = {"scenarios": {scheme: {**ADAM_SCHEMES[scheme], "optimizer": "adam"}}}
    ranks = [r[scheme] for r in run_ranks(spec, WORLD, script=WORKER, timeout=240)]
    expected = by_hand(ranks, sketch=256)
    for r in ranks:
        assert r["mode"] == "sketch"
        assert r["measured"] == STEPS
        assert ["train/noise_scale" in s for s in r["logged"]] == [not math.isnan(v) for v in expected]
        got = [s.get("train/noise_scale", math.nan) for s in r["logged"]]
        print(f"{scheme}, logged:", [f"{v:.4f}" for v in got], "by hand:", [f"{v:.4f}" for v in expected])
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, equal_nan=True)
    same_on_every_rank(ranks)
