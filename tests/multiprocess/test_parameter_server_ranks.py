"""`parameter_server` on real ranks over torch.distributed.rpc: sync mode is synchronous SGD with
the server's bytes; async mode lets a fast worker run past a slow one; checkpoints resume."""

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

K = 32 * 16 + 16 + 16 * 2 + 2  # the worker's Mlp: 562 parameter values
F32 = 4


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_sync_mode_trains_to_the_allreduce_weights_and_each_rank_sends_what_a_server_moves():
    world, steps = 3, 8
    plain = {"momentum": 0.0, "devices": world, "max_steps": steps}  # plain SGD
    scenarios = {
        "ar": {**plain, "strategy": "allreduce"},
        "one_server": {**plain, "strategy": "parameter_server"},
        "all_servers": {**plain, "strategy": "parameter_server", "kwargs": {"num_servers": "all"}},
        "momentum": {"devices": world, "strategy": "parameter_server", "kwargs": {"num_servers": 2}},
        "ar_momentum": {"devices": world, "strategy": "allreduce"},
    }
    results = run_ranks({"scenarios": scenarios}, world)
    for res in results:
        for name, reference in (("one_server", "ar"), ("all_servers", "ar"), ("momentum", "ar_momentum")):
            assert _max_diff(res[name]["params"], res[reference]["params"]) < 1e-5, name
            assert _max_diff(res[name]["params"], results[0][name]["params"]) == 0.0  # replicas bit-identical
    assert _max_diff(results[0]["ar"]["params"], results[0]["ar_momentum"]["params"]) > 1e-3  # it trained

    # Bytes by hand. One server (rank 0): every worker sends its K gradients to rank 0, which sends
    # the average back to the N - 1 others; its own push is a local call.
    sent = [r["one_server"]["stats"]["grad/bytes_sent"] for r in results]
    assert sent == [steps * (world - 1) * K * F32, steps * K * F32, steps * K * F32]
    # N servers: shards of 187, 187 and 188 values; rank r pushes the K - K_r values it does not
    # serve and replies K_r values to each of the N - 1 others.
    shards = [187, 187, 188]
    expected = [steps * F32 * ((K - k) + (world - 1) * k) for k in shards]
    assert [r["all_servers"]["stats"]["grad/bytes_sent"] for r in results] == expected
    assert [r["one_server"]["stats"]["steps"] for r in results] == [steps] * world


def test_async_mode_runs_past_a_slowed_rank_while_sync_mode_waits_for_it():
    slow = [1, 0.25]  # rank 1 sleeps 0.25 s after every batch
    steps = 8
    common = {"devices": 2, "max_steps": steps, "slow_rank": slow, "strategy": "parameter_server"}
    scenarios = {
        "sync": common,
        "async": {**common, "kwargs": {"mode": "async", "sync_period": 1, "sync_period_unit": "steps"}},
        "pipelined": {
            **common,
            "kwargs": {
                "mode": "async",
                "sync_period": 2,
                "sync_period_unit": "steps",
                "pipeline": True,
                "adjust_learning_rate": "linear",
                "adjust_coefficient": 0.5,
                "adjust_nb_minibatch": 4,
            },
        },
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    fast, slowed = results
    # sync: the fast rank waits at every step for the slow one
    assert fast["sync"]["train_seconds"] > 0.8 * slowed["sync"]["train_seconds"]
    # async: it does not (8 x 0.25 s = 2 s of sleep on rank 1 alone)
    for name in ("async", "pipelined"):
        assert fast[name]["train_seconds"] < 0.5 * slowed[name]["train_seconds"], name
        assert slowed[name]["train_seconds"] > steps * slow[1]
        # at the end every rank holds the global model
        assert _max_diff(fast[name]["params"], slowed[name]["params"]) == 0.0
        # ... which moved: both workers' steps are in it
        moved = torch.cat([p.reshape(-1) for p in fast[name]["params"].values()]) - fast[name]["start_params"]
        assert moved.abs().max() > 1e-3, name
    # bytes: rank 1 pushes K values at every sync and once more when the ranks meet at the end;
    # rank 0 (the server) replies to each of those pushes and to rank 1's final pull
    pushes = {"async": steps + 1, "pipelined": steps // 2 + 1}
    for name, n in pushes.items():
        assert slowed[name]["stats"]["weights/bytes_sent"] == n * K * F32
        assert fast[name]["stats"]["weights/bytes_sent"] == (n + 1) * K * F32


def test_checkpoints_resume_sync_exactly_and_async_with_its_counters():
    # 256 samples, 2 ranks x 4: 32 steps an epoch; the checkpoint at step 32 is at an epoch's end
    sync = {"strategy": "parameter_server", "kwargs": {"num_servers": 2}}
    asyn = {
        "strategy": "parameter_server",
        "kwargs": {"mode": "async", "sync_period": 4, "sync_period_unit": "steps", "adjust_learning_rate": "linear"},
    }
    scenarios = {
        "sync_straight": {**sync, "max_steps": 40, "ckpt_every": 32},
        "sync_resumed": {**sync, "max_steps": 40, "resume": ["sync_straight", 32]},
        "async_straight": {**asyn, "max_steps": 40, "ckpt_every": 32, "state_trace": True},
        "async_resumed": {**asyn, "max_steps": 40, "resume": ["async_straight", 32], "state_trace": True},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        assert _max_diff(res["sync_resumed"]["params"], res["sync_straight"]["params"]) == 0.0
        assert _max_diff(res["async_resumed"]["params"], results[0]["async_resumed"]["params"]) == 0.0
        saved = res["async_straight"]["checkpoint"]["mine"]
        assert saved["syncs"] == 32 // 4 + 1  # 8 pushes, and one when the ranks met for the checkpoint
        assert len(saved["optimizers"]) == 1  # each worker's own optimizer state
        first = res["async_resumed"]["states"][0]["rank"]
        assert first["syncs"] == saved["syncs"]  # carried on from the checkpoint (no push at step 33)
    # the server's shard carries its count of updates on: 2 x 9 pushes up to the checkpoint, then
    # 2 x 3 (steps 36 and 40, and the meeting at the end) in the straight run and the resumed one
    # alike. (Read once fit has ended: during it, the other rank may already have pushed.)
    server = results[0]["async_straight"]["checkpoint"]["mine"]["shards"][0]
    assert server["version"] == 2 * (32 // 4 + 1)
    for run in ("async_straight", "async_resumed"):
        assert results[0][run]["rank_state_after_fit"]["shards"][0]["version"] == server["version"] + 2 * 3


def test_a_one_rank_run_trains_alone():
    res = run_ranks({"scenarios": {"one": {"strategy": "parameter_server", "devices": 1}}}, 1)[0]
    assert res["one"]["stats"]["bytes_sent"] == 0
    assert torch.isfinite(torch.tensor(res["one"]["losses"])).all()


def test_more_servers_than_ranks_is_refused_when_the_ranks_connect():
    scenario = {"strategy": "parameter_server", "kwargs": {"num_servers": 3}}
    with pytest.raises(RuntimeError, match="num_servers=3 but there are 2 ranks"):
        run_ranks({"scenarios": {"too_many": scenario}}, 2, timeout=120)
