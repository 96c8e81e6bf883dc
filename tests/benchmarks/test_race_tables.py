"""The race's tables from hand-made rows (``benchmarks/compare.py``): no processes."""

import argparse
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import compare


def _row(key, kind, seed, points, stop, tx):
    """``points``: (step, train_seconds, val_ppl); 100 samples a step."""
    curve = [
        {"step": s, "samples": 100 * s, "train_seconds": t, "wall_seconds": 1.5 * t, "val_ppl": p} for s, t, p in points
    ]
    return {
        "key": key,
        "label": key,
        "kind": kind,
        "seed": seed,
        "predict": {},
        "steps": points[-1][0],
        "stop_reason": stop,
        "train_seconds": points[-1][1],
        "seconds_per_step": points[-1][1] / points[-1][0],
        "median_step_s": 0.5,
        "comm_s_per_step": None,
        "comm_share": None,
        "tx_bytes_per_step": tx,
        "comm_stats_bytes_per_step": None,
        "final_ppl": points[-1][2],
        "curve": curve,
        "param_shapes": None,
    }


ROWS = [
    _row("ddp", "peer", 0, [(10, 10, 400), (20, 20, 300), (30, 30, 240)], "target", 1e6),
    _row("ddp", "peer", 1, [(10, 11, 420), (20, 22, 310), (30, 33, 245)], "target", 1e6),
    _row(
        "fast", "ours", 0, [(10, 5, 450), (20, 10, 350), (30, 15, 280), (40, 20, 260), (60, 30, 251)], "budget", 2.5e5
    ),
    _row(
        "fast", "ours", 1, [(10, 5, 440), (20, 10, 340), (30, 15, 270), (40, 20, 255), (60, 30, 249)], "target", 2.5e5
    ),
    # the limit validates at other sample counts and stops early: it sets neither common point
    _row("alone", "limit", 0, [(10, 2, 500), (20, 4, 249)], "target", 0.0),
]


def _args():
    return argparse.Namespace(
        target_ppl=250.0,
        budget_seconds=30.0,
        target_source="given",
        budget_source="given",
        ranks=4,
        seeds=[0, 1],
        max_steps=100_000,
        config="lstm_demo.yaml",
        batch_size=32,
        val_every=10,
        val_batches=8,
        extra=[],
        quick=False,
    )


def test_time_to_target_is_the_first_validation_at_or_below_it_within_the_budget():
    curve = ROWS[0]["curve"]
    assert compare.time_to_target(curve, 250, None) == 30
    assert compare.time_to_target(curve, 300, None) == 20  # at, not only below
    assert compare.time_to_target(curve, 250, 29.0) is None  # reached past the budget: not in budget
    assert compare.time_to_target(curve, 100, None) is None


def test_perplexity_at_a_time_is_interpolated_in_log_and_at_samples_taken_at_or_before():
    curve = [{"samples": 0, "train_seconds": 10, "val_ppl": 400}, {"samples": 100, "train_seconds": 20, "val_ppl": 100}]
    assert compare.ppl_at_time(curve, 15) == pytest.approx(200)  # geometric, not arithmetic (250)
    assert compare.ppl_at_time(curve, 20) == pytest.approx(100)
    assert compare.ppl_at_time(curve, 5) is None and compare.ppl_at_time(curve, 25) is None
    assert compare.ppl_at_samples(curve, 99) == 400 and compare.ppl_at_samples(curve, 100) == 100


def test_tables_use_the_common_points_mean_and_spread_over_seeds_and_same_run_ratios():
    assert compare.common_points(ROWS) == (3000, 30)  # ddp's final samples, the smallest final time
    fig = compare.figures(ROWS, 250.0, 30.0)
    assert fig["ddp"]["at_samples"] == [240, 245] and fig["fast"]["at_samples"] == [280, 270]
    at_30 = math.exp(3 / 11 * math.log(310) + 8 / 11 * math.log(245))  # ddp seed 1 between 22 s and 33 s
    assert fig["ddp"]["at_time"] == pytest.approx([240, at_30])
    assert fig["fast"]["at_time"] == pytest.approx([251, 249])
    assert fig["ddp"]["ttt"] == [30, None]  # seed 1 reached it at 33 s, past the budget
    assert fig["fast"]["ttt"] == [None, 30]

    text = compare.table(ROWS, _args(), "emulated cluster, 100 Mbit/s links", 100.0)
    assert "validation perplexity 250" in text and "30 s of training" in text and "**Seeds**: 0 1" in text
    assert "| ddp | peer | 242.5 (240.0-245.0) | 30 |" in text  # (a) at 3000 samples = step 30
    assert "| fast | ours | 275.0 (270.0-280.0) | 30 |" in text
    assert "| alone | limit | 249.0 | 20 |" in text
    assert f"| ddp | peer | {(240 + at_30) / 2:.1f} (240.0-{at_30:.1f}) |" in text  # (b)
    assert "| ddp | peer | 30 (1 of 2 seeds; the others not reached in budget) | target target |" in text
    assert "| fast | ours | 30 (1 of 2 seeds; the others not reached in budget) | budget target |" in text
    assert "- time to target: no ratio (no entry of either side has it on every seed)" in text
    assert "- val ppl at equal samples: this package's best, fast, 275.0 / best peer, ddp, 242.5 = **1.13**" in text
    bytes_line = "- bytes per step and rank (interface): this package's best, fast, 0.25 MB / best peer, ddp, 1 MB"
    assert bytes_line + " = **0.25**" in text
