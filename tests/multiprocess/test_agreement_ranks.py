"""Ranks agree on what no gradient carries: buffers (BatchNorm's running statistics) and the sample
counts that schedules in samples are decided on."""

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess


def test_buffers_are_averaged_so_every_rank_ends_with_the_same_running_statistics():
    base = {"model": "bn", "max_steps": 4, "momentum": 0.0}
    every_3_steps = {"sync_period": 3, "sync_period_unit": "steps"}
    scenarios = {
        "allreduce": {**base, "strategy": "allreduce"},
        "model_averaging": {**base, "strategy": "model_averaging", "kwargs": every_3_steps},
        "onebit": {**base, "strategy": "onebit_sgd", "kwargs": {"small_tensor_numel": 64}},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for name in scenarios:
        r0, r1 = (r[name] for r in results)
        before = [r0["buffers_before_end"], r1["buffers_before_end"]]
        # the ranks saw other data: their statistics differed before the end of fit ...
        assert not torch.equal(before[0]["layer.1.running_mean"], before[1]["layer.1.running_mean"]), name
        for key in ("layer.1.running_mean", "layer.1.running_var"):
            # ... and are now the same on both, their mean (the float buffers are averaged)
            assert torch.equal(r0["params"][key], r1["params"][key]), (name, key)
            torch.testing.assert_close(r0["params"][key], (before[0][key] + before[1][key]) / 2, rtol=0, atol=1e-7)
        assert int(r0["params"]["layer.1.num_batches_tracked"]) == int(r1["params"]["layer.1.num_batches_tracked"]) == 4
        for key, value in r0["params"].items():
            assert torch.equal(value, r1["params"][key]), (name, key)


def test_ranks_with_uneven_batches_agree_on_a_schedule_in_samples():
    # rank 0 trains on batches of 4, rank 1 on batches of 6: counted alone, rank 0 would reach a
    # block of 10 samples after 3 steps and rank 1 after 2, and the two would wait on different
    # collectives. They agree on the mean, 5 a step: every block is 2 steps on both.
    sc = {"model": "uneven", "max_steps": 6, "momentum": 0.0, "batch_size": 4}
    every_10_samples = {"sync_period": 10, "sync_period_unit": "samples"}
    scenarios = {
        "averaging": {**sc, "strategy": "model_averaging", "kwargs": every_10_samples},
        # 1-bit SGD's full-precision warm start ends after 20 samples over both ranks: 2 steps
        "onebit": {**sc, "strategy": "onebit_sgd", "kwargs": {"distributed_after": 20, "small_tensor_numel": 64}},
    }
    results = run_ranks({"scenarios": scenarios}, 2, timeout=120)
    r0, r1 = (r["averaging"] for r in results)
    assert r0["samples_per_worker"] == r1["samples_per_worker"] == 30
    assert [h[2] for h in r0["sync_history"]] == [h[2] for h in r1["sync_history"]] == [2, 4, 6]
    for name in scenarios:
        r0, r1 = (r[name] for r in results)
        for key, value in r0["params"].items():
            assert torch.equal(value, r1["params"][key]), (name, key)
    assert results[0]["onebit"]["stats"].get("grad_quantized/calls", 0) > 0


def test_verify_sync_finds_replicas_that_diverged_and_every_rank_raises():
    check = {"verify_sync_every": 1}
    scenarios = {
        "allreduce": {"strategy": "allreduce", "kwargs": check, "max_steps": 4},
        "diloco": {"strategy": "diloco", "kwargs": {**check, "sync_period": 2}, "max_steps": 4},
    }
    results = run_ranks({"scenarios": scenarios}, 2)  # replicas that agree pass the check every step
    for r in results:
        assert r["allreduce"]["stats"]["control/calls"] >= 4
        assert r["diloco"]["heartbeats"] == 1  # two Trainers in one process, one heartbeat thread
    # rank 1's weights moved by 1e-3 after step 2: the check after step 3 names the parameter
    broken = {"broken": {"strategy": "allreduce", "kwargs": check, "max_steps": 6, "perturb": [2, 1]}}
    with pytest.raises(RuntimeError, match="failed") as info:
        run_ranks({"scenarios": broken}, 2, timeout=120)
    logs = str(info.value).split("--- log ")[1:]
    assert len(logs) == 2
    for log in logs:
        assert "replicas disagree at optimizer step 3: layer.0.weight differ between rank 0 and ranks [1]" in log
