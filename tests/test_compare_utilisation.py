"""The race's compute-utilisation column (``benchmarks/compare.py``) from hand-made rows: no processes."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare


def _row(key, kind, seed, steps, train_seconds):
    curve = [{"step": steps, "samples": 10 * steps, "train_seconds": train_seconds, "val_ppl": 100.0}]
    return {
        "key": key,
        "label": key,
        "kind": kind,
        "seed": seed,
        "predict": {},
        "steps": steps,
        "stop_reason": "budget",
        "train_seconds": train_seconds,
        "seconds_per_step": train_seconds / steps,
        "median_step_s": 0.5,
        "comm_s_per_step": None,
        "comm_share": None,
        "tx_bytes_per_step": None,
        "comm_stats_bytes_per_step": None,
        "final_ppl": 100.0,
        "curve": curve,
        "param_shapes": None,
    }


def _args():
    return argparse.Namespace(
        target_ppl=None,
        budget_seconds=None,
        target_source="given",
        budget_source="given",
        ranks=4,
        seeds=[0, 1],
        max_steps=100,
        config="lstm_demo.yaml",
        batch_size=32,
        val_every=10,
        val_batches=8,
        extra=[],
        quick=False,
    )


def test_utilisation_is_the_alone_mean_step_time_over_the_entrys():
    rows = [
        _row("alone", "limit", 0, 10, 4.0),  # 0.4 s/step
        _row("alone", "limit", 1, 10, 6.0),  # 0.6 s/step: the limit's mean is 0.5
        _row("ddp", "peer", 0, 10, 20.0),  # 2.0 s/step
        _row("ddp", "peer", 1, 10, 10.0),  # 1.0 s/step
    ]
    compare.add_utilisation(rows)
    assert [r["compute_utilisation"] for r in rows] == pytest.approx([1.25, 5 / 6, 0.25, 0.5])
    text = compare.table(rows, _args(), "emulated cluster, 100 Mbit/s links", 100.0)
    assert "| s/step | compute util. | median batch s |" in text
    assert "| ddp | peer | - | budget budget | 10 | 15 (10-20) | 1.500 (1.000-2.000) | 38% (25%-50%) | 0.500 |" in text
    assert "| alone | limit | - | budget budget | 10 | 5 (4-6) | 0.500 (0.400-0.600) | 104% (83%-125%) |" in text


def test_no_alone_row_no_utilisation():
    rows = [_row("ddp", "peer", 0, 10, 20.0)]
    compare.add_utilisation(rows)
    assert rows[0]["compute_utilisation"] is None
    text = compare.table(rows, _args(), "loopback (no rate limit)", None)
    assert "| ddp | peer | - | budget | 10 | 20 | 2.000 | - | 0.500 |" in text
