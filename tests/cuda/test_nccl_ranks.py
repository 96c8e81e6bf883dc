"""The CUDA paths on real ranks: NCCL (one GPU per rank), gloo moving CUDA tensors (ranks may share
a GPU), and a one-rank NCCL group (one GPU). Each test says which hardware it needs and is skipped
without it; every check runs in the ranks (``cuda_worker.py``), and the figures are printed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import ring_bytes, run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]

CUDA_WORKER = Path(__file__).parent / "cuda_worker.py"
GPUS = torch.cuda.device_count()
N_PARAMS = 32 * 16 + 16 + 16 * 2 + 2  # tests/multiprocess/worker.py's Mlp

needs_nccl = pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch build has no NCCL")
needs_two_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"NCCL runs one rank per GPU (it refuses two ranks on one): needs 2 GPUs, found {GPUS}"
)


def _report(results: list[dict], what: str) -> None:
    for rank, res in enumerate(results):
        timed = res["timed"]
        print(
            f"{what} rank {rank} ({res['backend']}, messages on {res['device']}): {timed['calls']} all-reduces"
            f" of 4 MiB in {timed['seconds'] * 1e3:.2f} ms of device time"
            + (f"; background channel {res['background']['seconds'] * 1e3:.2f} ms" if "background" in res else "")
        )


@needs_nccl
def test_one_rank_nccl_group_stages_cpu_tensors_and_times_with_events():
    (res,) = run_ranks({"backend": "nccl"}, 1, script=CUDA_WORKER)
    assert res["device"] == "cuda:0" and res["timed"]["seconds"] > 0
    _report([res], "one-rank NCCL")


def test_gloo_ranks_move_cuda_tensors_timed_by_events_with_persistent_buffers():
    results = run_ranks({"backend": "gloo"}, 2, script=CUDA_WORKER)
    assert all(res["device"] == "cpu" for res in results)  # gloo's own messages stay on the CPU
    _report(results, "gloo with CUDA tensors")


@needs_nccl
@needs_two_gpus
def test_nccl_ranks_object_collectives_timing_buffers_and_a_background_channel():
    world = min(GPUS, 4)
    results = run_ranks({"backend": "nccl"}, world, script=CUDA_WORKER)
    assert [res["device"] for res in results] == [f"cuda:{r}" for r in range(world)]
    for res in results:
        assert res["background"]["calls"] == 5 and res["background"]["seconds"] > 0
    _report(results, "NCCL")


@needs_nccl
@needs_two_gpus
def test_allreduce_strategy_trains_on_nccl_with_equal_weights_on_every_rank():
    world = min(GPUS, 4)
    scenarios = {
        "ddp": {"strategy": "ddp", "accelerator": "cuda", "devices": world},
        "ar": {"strategy": "allreduce", "accelerator": "cuda", "devices": world},
        "ar_small_buckets": {
            "strategy": "allreduce",
            "accelerator": "cuda",
            "devices": world,
            "kwargs": {"bucket_cap_mb": 0.001},
        },
    }
    results = run_ranks({"scenarios": scenarios}, world)
    for res in results:
        assert "backend='nccl'" in res["ar"]["comm"]
        for name in ("ar", "ar_small_buckets"):
            for key, value in res[name]["params"].items():
                torch.testing.assert_close(value, results[0][name]["params"][key], atol=0.0, rtol=0.0)
                torch.testing.assert_close(value, res["ddp"]["params"][key], atol=1e-5, rtol=0.0)
        stats = res["ar"]["stats"]
        assert stats["steps"] == 8 and stats["grad/calls"] == 8
        assert stats["grad/bytes_sent"] == 8 * ring_bytes(N_PARAMS, 4, world)
        assert stats["grad/bytes_sent"] == 8 * 2 * (world - 1) * math.ceil(N_PARAMS / world) * 4
        assert stats["grad/comm_seconds"] > 0
    print(
        f"allreduce on {world} GPUs over NCCL: 8 steps, {results[0]['ar']['stats']['grad/bytes_sent']} gradient bytes"
        f" sent by rank 0 in {results[0]['ar']['stats']['grad/comm_seconds'] * 1e3:.2f} ms of device time"
    )


@needs_nccl
@needs_two_gpus
def test_streaming_exchange_in_the_background_never_issues_nccl_from_its_thread():
    """A fragment's exchange runs in a background thread while the main thread issues NCCL
    collectives (the SIGTERM flag round is gloo, but verify_sync_every is NCCL): the background
    channel is a gloo group over host copies, and every rank ends with the same global model."""
    world = min(GPUS, 4)
    kwargs = {"sync_period": 4, "num_fragments": 2, "fragment_sync_delay": 1, "pseudo_grad_bits": 4}
    scenario = {
        "strategy": "streaming_diloco",
        "accelerator": "cuda",
        "devices": world,
        "max_steps": 16,
        "kwargs": {**kwargs, "verify_sync_every": 1},
    }
    # a schedule in samples: the ranks agree on their sample counts over the host (gloo), not NCCL
    samples = {"strategy": "model_averaging", "accelerator": "cuda", "devices": world, "kwargs": {"sync_period": 16}}
    results = run_ranks({"scenarios": {"s": scenario, "samples": samples}}, world)
    for res in results:
        assert "backend='gloo'" in res["samples"]["host_comm"], res["samples"]["host_comm"]
        assert res["samples"]["stats"]["control/calls"] >= 8  # one count per batch (and the flag rounds)
        assert "backend='nccl'" in res["s"]["comm"], res["s"]["comm"]
        assert "backend='gloo'" in res["s"]["exchange_comm"], res["s"]["exchange_comm"]
        assert len(res["s"]["sync_history"]) >= 6  # both fragments synced in the background, then at the end
        for key, value in res["s"]["params"].items():  # every rank ends with the global model
            torch.testing.assert_close(value, results[0]["s"]["params"][key], atol=0.0, rtol=0.0)
    print(f"streaming_diloco on {world} GPUs: NCCL, background exchange over {results[0]['s']['exchange_comm']}")
