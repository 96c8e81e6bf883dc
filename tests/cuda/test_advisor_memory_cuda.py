"""The advisor's memory per rank on a GPU: device and host bytes apart, ``outer_state="host"`` and
``"device"``, against what real strategies hold (``tests/multiprocess/memory_worker.py``) on two ranks
that share GPU 0 over gloo (NCCL takes one rank per GPU). The ranks are started as one rank per node
(``num_nodes=2``, ``NODE_RANK`` 0 and 1), so that both take device 0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from harness import REPO, free_port

from lightning_commstrats import advisor

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]

WORKER = REPO / "tests" / "multiprocess" / "memory_worker.py"
MLP_SHAPES = [(50, 30), (50,), (33, 50), (33,), (4, 33), (4,)]
GLOO = {"backend": "gloo"}
SCENARIOS = {
    "allreduce": ("allreduce", {}),
    "onebit_sgd": ("onebit_sgd", {"num_quantization_bits": 1}),
    "diloco_4_host": ("diloco", {"sync_period": 2, "pseudo_grad_bits": 4, "outer_state": "host"}),
    "diloco_4_device": ("diloco", {"sync_period": 2, "pseudo_grad_bits": 4, "outer_state": "device"}),
    "streaming_diloco": ("streaming_diloco", {"sync_period": 4, "num_fragments": 2, "fragment_sync_delay": 1}),
    "sparseloco_host": ("sparseloco", {"sync_period": 2, "topk_chunk": 512, "topk_per_chunk": 16}),
    "sparseloco_device": (
        "sparseloco",
        {"sync_period": 2, "topk_chunk": 512, "topk_per_chunk": 16, "outer_state": "device"},
    ),
}


def _run(spec: dict, timeout: float = 420.0) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="commstrats-memory-cuda-"))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    logs = [open(out / f"log{r}.txt", "w+") for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(spec), str(out)],
            env={**env, "NODE_RANK": str(r)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            tails = []
            for r, f in enumerate(logs):
                f.seek(0)
                tails.append(f"--- rank {r} ---\n{f.read()[-3000:]}")
            raise RuntimeError(f"ranks {failed} failed or timed out:\n" + "\n".join(tails))
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def runs():
    spec = {
        "steps": 8,
        "accelerator": "cuda",
        "scenarios": {name: [scheme, {**kwargs, **GLOO}] for name, (scheme, kwargs) in SCENARIOS.items()},
    }
    return _run(spec)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_device_and_host_bytes_equal_the_prediction(runs, name):
    scheme, kwargs = SCENARIOS[name]
    settings = {k: v for k, v in kwargs.items() if k in advisor.SETTINGS[scheme]}
    predicted = advisor.memory_per_rank(
        scheme, settings, MLP_SHAPES, ranks=2, outer_state=kwargs.get("outer_state", "host"), accelerator="gpu"
    )
    steps = runs[0][name]["steps"]

    def largest(device: str) -> int:
        return max(sum(by_device.get(device, 0) for by_device in s["by_device"].values()) for s in steps)

    measured = {"device": largest("cuda:0"), "host": largest("cpu")}
    print(f"{name}: measured {measured}, predicted device {predicted.device}, host {predicted.host}")
    assert measured == {"device": predicted.device, "host": predicted.host}, (name, steps[-1]["what"], predicted)
    # memory_stats() misses nothing the strategy holds, on either side
    for device in ("cuda:0", "cpu"):
        walked = max(s["walked_by_device"].get(device, 0) for s in steps)
        assert walked == max(s["by_device"]["scheme"].get(device, 0) for s in steps), (name, device)
