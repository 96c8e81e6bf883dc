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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_fabric_recipe_learns_between_its_validations_with_a_periodic_scheme():
    """By name alone ``diloco`` syncs every 500 steps: the recipe's validations saw the global model
    of the start, the same perplexity each time. A periodic scheme given no period now syncs every
    ``val_every / 4`` steps."""
    args = ["--strategy", "diloco", "--devices", "2", "--max-steps", "24", "--val-every", "8", "--val-batches", "2"]
    args += ["--hidden", "16", "--max-vocab-size", "2000", "--batch-size", "8", "--seq-len", "16"]
    done = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "train_fabric.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ppl = [float(line.rsplit("val ppl ", 1)[1]) for line in done.stdout.splitlines() if "val ppl" in line]
    assert len(ppl) == 3, done.stdout  # steps 8 and 16, then the final model
    assert ppl[0] != ppl[1] and ppl[1] > ppl[2], ppl
