"""Committed results name no machine's scratch space: their paths are relative to the checkout."""

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from recorded import portable, portable_args  # noqa: E402

# a run's own captured output (logs, tracebacks) may name where it ran; the tables and records may not
RECORDS = (".md", ".json", ".csv")
SCRATCH = re.compile(r"(?<![\w.])/(tmp|var/tmp|var/folders)/")


def test_a_path_is_kept_relative_to_the_checkout_or_by_its_last_part():
    assert portable(REPO / "benchmarks" / "results" / "x") == "benchmarks/results/x"
    assert (
        portable("/tmp/snapB/lightning_commstrats/configs/lstm_demo.yaml")
        == "lightning_commstrats/configs/lstm_demo.yaml"
    )
    assert portable("/tmp/gq1/rate100/package-faults-seed0") == "package-faults-seed0"
    assert portable("runs/moe") == "runs/moe"

    args = argparse.Namespace(out="/tmp/mywork/cqfinal", seeds=[0, 1], cache="relative.pt")
    assert portable_args(args) == {"out": "cqfinal", "seeds": [0, 1], "cache": "relative.pt"}


def test_no_committed_result_names_a_temporary_directory():
    found = [
        str(f.relative_to(REPO))
        for f in sorted((REPO / "benchmarks" / "results").rglob("*"))
        if f.is_file() and f.suffix in RECORDS and SCRATCH.search(f.read_text(errors="ignore"))
    ]
    assert not found, found
