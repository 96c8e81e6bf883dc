"""The LitGPT recipe's command line: its help names every option with its default, and works without
LitGPT installed (the [litgpt] extra lives in an environment of its own); a run without LitGPT says how
to install it instead of a traceback. The training itself: tests/multiprocess/test_litgpt_ranks.py."""

import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "train_litgpt.py"


def test_the_help_shows_every_option_with_its_default_without_litgpt():
    run = subprocess.run([sys.executable, str(RECIPE), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    text = " ".join(run.stdout.split())
    for option, default in [("--model", "pythia-160m"), ("--bits", "32"), ("--sync-period", "2"), ("--steps", "4")]:
        assert option in text and f"(default: {default})" in text, (option, text)
    assert "{32,16,8,4,2,1}" in text


def test_a_bad_bits_value_is_refused_by_name():
    run = subprocess.run([sys.executable, str(RECIPE), "--bits", "3"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--bits: invalid choice: 3" in run.stderr
