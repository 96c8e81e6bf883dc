"""The recipes' own --strategy arguments: a misspelled name is a usage error naming the nearest names."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("script", "value", "expected"),
    [
        (
            "train_fabric.py",
            "dilocco",
            "--strategy='dilocco' is not a lightning_commstrats strategy; did you mean 'diloco'?",
        ),
        ("quickstart.py", "dpp", "--strategy='dpp' is not a registered strategy name; did you mean 'ddp'?"),
    ],
)
def test_a_misspelled_strategy_is_refused_before_anything_starts(script, value, expected):
    done = subprocess.run(
        [sys.executable, str(REPO / "recipes" / script), "--strategy", value], capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    assert expected in " ".join(done.stderr.split())
    assert "allreduce, onebit_sgd, model_averaging" in done.stderr
