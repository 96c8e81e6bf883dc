"""LitGPT's GPT as a client (``recipes/train_litgpt.py``) on real ranks (gloo, CPU): built empty with
``Trainer.init_module(empty_init=True)``, sharded 2x2 (FSDP2 inside pairs, ``diloco`` between them),
initialised by LitGPT's own initialiser through the module's ``init_weights()``. Skipped without LitGPT
(the ``[litgpt]`` extra; it is kept out of the main environment, see ``pyproject.toml``).

Memory is the kernel's count (``VmHWM`` above the resident set before the build, glibc's mmap threshold
fixed), per rank, against the whole model in fp32: built empty and sharded, a rank's peak while the model
is built, sharded and initialised stays below the whole model; built whole (unsharded) it does not.
"""

import time
from pathlib import Path

import pytest
from harness import run_ranks

pytest.importorskip("litgpt", reason="the [litgpt] extra: pip install -e '.[litgpt]'")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).parent / "litgpt_worker.py"
RUN = {
    "model_name": "pythia-31m",
    "devices": 4,
    "steps": 6,
    "sync_period": 3,
    "batch_size": 2,
    "seq_len": 64,
    "lr": 3e-3,
}


def _figures(ranks: list[dict]) -> dict:
    model = 4 * ranks[0]["numel"]
    return {
        "build": [(r["memory"]["phases"]["build"] - r["memory"]["start"]) / model for r in ranks],
        "training": [(r["memory"]["phases"]["training"] - r["memory"]["start"]) / model for r in ranks],
        "losses": [sum(r["losses"][i] for r in ranks) / len(ranks) for i in (0, -1)],
        "seconds": max(r["seconds"] for r in ranks),
    }


def test_litgpt_built_empty_sharded_trains_with_diloco_below_the_whole_model():
    start = time.perf_counter()
    sharded = run_ranks({**RUN, "layout": "2x2"}, 4, script=WORKER, timeout=900)
    whole = run_ranks({**RUN, "layout": "unsharded"}, 4, script=WORKER, timeout=900)
    s, w = _figures(sharded), _figures(whole)
    print(
        f"pythia-31m, 4 ranks, {time.perf_counter() - start:.0f}s; peak above the start / the whole model in fp32"
        f" ({4 * sharded[0]['numel'] / 2**20:.0f} MiB), per rank: sharded 2x2 build {s['build']},"
        f" training {s['training']}, loss {s['losses']}, {s['seconds']:.0f}s; unsharded build {w['build']},"
        f" training {w['training']}, loss {w['losses']}, {w['seconds']:.0f}s"
    )
    assert all(r["sharded"] for r in sharded) and not any(r["sharded"] for r in whole)
    for name, ranks, f in (("sharded", sharded, s), ("unsharded", whole, w)):
        # the last step is a sync: every rank holds the same whole model
        assert all(r["digest"] == ranks[0]["digest"] for r in ranks), f"{name}: the ranks disagree after the sync"
        assert f["losses"][1] < f["losses"][0] - 0.3, f"{name}: the loss did not fall: {f['losses']}"
    # built empty, each rank materialises half the model (its shards), plus some 15 MiB the setup takes
    # whatever the model (gloo, Lightning): below the whole model, where a rank that builds it whole is above
    assert max(s["build"]) < 0.8, f"a sharded rank's build peaked at {max(s['build']):.2f}x the whole model"
    assert min(w["build"]) > 1.0, f"built whole, a rank peaked at only {min(w['build']):.2f}x the model"
    assert max(s["training"]) < min(w["training"]), (s["training"], w["training"])
