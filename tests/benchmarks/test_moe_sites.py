"""benchmarks/moe_sites.py's arithmetic by hand: the uplink counters cut at training's start and end, a run's
figures from its probes, and the table's means, seeds and ratios to ``ep4``."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe_sites


def test_uplink_bytes_between_two_times_are_interpolated_and_summed_over_the_sites():
    counters = object.__new__(moe_sites.UplinkCounters)
    counters.samples = [[(10.0, 100), (11.0, 300), (12.0, 300)], [(10.0, 0), (12.0, 1000)]]
    # site 0: 200 at 10.5, 300 from 11 on; site 1: 250 at 10.5, 1000 at 12 (held past the last sample)
    assert counters.between(10.5, 13.0) == (300 - 200) + (1000 - 250)
    assert moe_sites.at(counters.samples[0], 9.0) == 100  # held before the first sample
    assert counters.between(11.0, 12.0) == 0 + 500


def test_a_runs_figures_leave_the_first_step_out_and_are_per_training_step():
    ranks = [
        {
            "steps": 4,
            "step_seconds": [9.0, 1.0, 1.0, 1.0],
            "train_seconds": 12.0,
            "curve": [{"val_ppl": 50.0, "samples": 512}],
        },
        {
            "steps": 4,
            "step_seconds": [9.0, 2.0, 2.0, 2.0],
            "train_seconds": 15.0,
            "curve": [{"val_ppl": 50.0, "samples": 512}],
        },
    ]
    row = moe_sites.summarize(ranks, uplink_train=8_000_000, uplink_job=12_000_000)
    assert row["mean_step_s"] == pytest.approx(1.5)
    assert row["uplink_MB_per_step"] == pytest.approx(2.0) and row["uplink_job_MB_per_step"] == pytest.approx(3.0)
    assert row["val_ppl"] == 50.0 and row["samples"] == 512
    loopback = moe_sites.summarize(ranks, None, None)
    assert loopback["uplink_MB_per_step"] is None and loopback["uplink_job_MB_per_step"] is None


def test_the_table_shows_means_each_seed_and_ratios_to_ep4():
    def row(key, seed, step, mb, ppl):
        return {
            "key": key,
            "seed": seed,
            "mean_step_s": step,
            "uplink_MB_per_step": mb,
            "uplink_job_MB_per_step": mb,
            "val_ppl": ppl,
        }

    rows = [row("ep4", 0, 2.0, 20.0, 100.0), row("ep4", 1, 4.0, 20.0, 300.0), row("diloco", 0, 1.0, 2.0, 220.0)]
    lines = moe_sites.table(rows, [("ep4", "A"), ("dp2xep2", "B"), ("diloco", "C")])
    assert len(lines) == 4  # header, rule, and no line for a layout without runs
    assert lines[2].startswith("| A | 3.000 (2.000 / 4.000) | 20.00 (20.00 / 20.00)")
    assert lines[2].endswith("| 1.00x | 1.00x | 1.00x |")
    assert lines[3] == "| C | 1.000 | 2.00 | 2.00 | 220 | 0.33x | 0.10x | 1.10x |"
    lines = moe_sites.table([{**r, "uplink_MB_per_step": None} for r in rows], [("ep4", "A"), ("diloco", "C")])
    assert "| n/a (n/a / n/a) |" in lines[2] and lines[3].endswith("| 0.33x | n/a | 1.10x |")
