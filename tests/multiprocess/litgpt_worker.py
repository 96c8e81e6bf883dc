"""One rank of the LitGPT client's test (started by ``tests/harness.py``): runs
``recipes/train_litgpt.py``'s ``train`` with the spec's arguments.

Usage: ``litgpt_worker.py SPEC_JSON OUT_DIR``; SPEC holds ``train``'s keyword arguments. This rank saves
``OUT_DIR/rank<r>.pt``: what ``train`` returned, and ``seconds`` (the call's wall time).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rank_env import save_and_leave

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

from train_litgpt import train


def main() -> None:
    spec = json.loads(sys.argv[1])
    start = time.perf_counter()
    result = train(**spec)
    result["seconds"] = time.perf_counter() - start
    save_and_leave(result, Path(sys.argv[2]), result["rank"])


if __name__ == "__main__":
    main()
