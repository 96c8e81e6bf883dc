"""One rank of the hot-path test: a short training of ``benchmarks/hotpath.py``'s LSTM LM whose
per-step strategy work is counted (kernels, host synchronisations, float32 allocations).

Usage: ``hotpath_worker.py SPEC_JSON OUT_DIR`` with SPEC ``{"scheme": name in hotpath.SCHEMES, "steps": T,
"warmup": W, "vocab": V, "dim": D, "kwargs": {...}}``; rank 0 saves its counts, the others None.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from hotpath import measure_rank


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = measure_rank(
        spec["scheme"], spec["steps"], spec["warmup"], 64, spec["vocab"], spec["dim"], spec.get("kwargs")
    )
    torch.save(result, Path(sys.argv[2]) / f"rank{os.environ['LOCAL_RANK']}.pt")


if __name__ == "__main__":
    main()
