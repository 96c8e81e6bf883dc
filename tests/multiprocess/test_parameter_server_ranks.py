"""`parameter_server` on real ranks over torch.distributed.rpc: sync mode is synchronous SGD with
the server's bytes; async mode is CNTK's arithmetic push by push (the progress, its adjustment
factor, where a worker continues, the server's sum), with no worker waiting for another;
checkpoints resume."""

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

K = 32 * 16 + 16 + 16 * 2 + 2  # the worker's Mlp: 562 parameter values
F32 = 4
STEPS = {"sync_period_unit": "steps"}


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


def _cntk_factor(kind, coefficient, per, k):
    """CNTK's DecayCoefficient (AdjustLearningRateAtBeginning) at a worker's k-th push: its counter
    (m_parameterSyncCounter) is incremented before the factor is read, so the first push has k = 1."""
    if kind == "linear":
        return min(1.0, max(0.0, coefficient + (1 - coefficient) / per * k))
    if kind == "staircase":
        return min(1.0, max(0.0, coefficient * (k // per + 1)))
    return 1.0


def _seen(reply, w0, own, other):
    """How many of the other worker's pushes the server had added when it replied: the server adds
    every push to its model at once, so a reply is the initial model plus this worker's pushes so
    far plus a prefix of the other's. Returns that prefix's length (and raises if none fits)."""
    rest = reply.double() - w0 - sum(own, torch.zeros_like(w0))
    errors = [(rest - sum(other[:m], torch.zeros_like(w0))).abs().max().item() for m in range(len(other) + 1)]
    m = min(range(len(errors)), key=errors.__getitem__)
    assert errors[m] < 1e-5, errors
    return m


def test_async_arithmetic_is_cntk_s_push_by_push_and_no_worker_waits_for_another():
    # rank 1 starts its first batch only once rank 0 has ended its training loop: if a worker
    # waited for another, the run could not finish. The order of the pushes is then known.
    steps = 8
    common = {"devices": 2, "max_steps": steps, "strategy": "parameter_server", "record_pushes": True, "hold": [1, 0]}
    adjust = {"adjust_learning_rate": "linear", "adjust_coefficient": 0.5, "adjust_nb_minibatch": 4}
    scenarios = {
        "async": {**common, "kwargs": {"mode": "async", "sync_period": 1, **STEPS, **adjust}},
        "pipelined": {**common, "kwargs": {"mode": "async", "sync_period": 2, **STEPS, "pipeline": True, **adjust}},
        "pipelined_cntk": {
            **common,
            "kwargs": {
                "mode": "async",
                "sync_period": 2,
                **STEPS,
                "pipeline": True,
                "pipeline_start": "pulled",
                "adjust_learning_rate": "staircase",
                "adjust_coefficient": 0.25,
                "adjust_nb_minibatch": 2,
            },
        },
    }
    # sync mode with a slowed rank: the fast one waits for each of the slow one's gradients, at
    # least 7 of its 0.25 s sleeps (a bound, whatever the load on the machine)
    scenarios["sync"] = {"devices": 2, "max_steps": steps, "slow_rank": [1, 0.25], "strategy": "parameter_server"}
    results = run_ranks({"scenarios": scenarios}, 2)
    assert results[0]["sync"]["train_seconds"] > (steps - 1) * 0.25

    for name in ("async", "pipelined", "pipelined_cntk"):
        kw = scenarios[name]["kwargs"]
        pipelined, pulled = kw.get("pipeline", False), kw.get("pipeline_start") == "pulled"
        factor_args = (kw["adjust_learning_rate"], kw["adjust_coefficient"], kw["adjust_nb_minibatch"])
        pushes = [r[name]["pushes"] for r in results]
        w0 = results[0][name]["start_params"].double()
        for rank in range(2):
            mine = pushes[rank]
            # steps / period pushes in training, one more when the ranks meet at the end
            assert len(mine) == steps // kw["sync_period"] + 1, name
            assert [p["pipelined"] for p in mine] == [pipelined] * (len(mine) - 1) + [False], name
            assert torch.equal(mine[0]["base"], results[rank][name]["start_params"])
            for k, push in enumerate(mine, start=1):
                progress = push["local"] - push["base"]
                # what goes to the server: the progress since the base, scaled by CNTK's factor
                torch.testing.assert_close(
                    push["pushed"], _cntk_factor(*factor_args, k) * progress, atol=1e-7, rtol=1e-6
                )
                previous = mine[k - 2]["reply"] if k > 1 else None
                if not push["pipelined"]:
                    expected = push["reply"]  # waits for the reply and continues from it
                elif pulled:  # CNTK's usePipeline: the model pulled at the previous push
                    expected = previous if previous is not None else push["base"]
                else:  # rebase: that model plus the progress made since
                    expected = previous + progress if previous is not None else push["local"]
                torch.testing.assert_close(push["start"], expected, atol=1e-6, rtol=0, msg=f"{name} {rank} {k}")
                if k < len(mine):  # the next progress is measured from where it continued
                    assert torch.equal(mine[k]["base"], push["start"])
        # the server: each push added at once, the replies nested prefixes of one order of the pushes
        pushed = [[p["pushed"].double() for p in mine] for mine in pushes]
        seen = [
            [_seen(p["reply"], w0, pushed[r][:k], pushed[1 - r]) for k, p in enumerate(pushes[r], start=1)]
            for r in range(2)
        ]
        for r in range(2):
            assert seen[r] == sorted(seen[r]), (name, seen)
            for k, m in enumerate(seen[r], start=1):  # if push k saw push m of the other, that one saw < k of r's
                assert m == 0 or seen[1 - r][m - 1] < k, (name, seen)
        # rank 0 trained alone: none of its training pushes saw rank 1's; rank 1's first saw them all
        trained = steps // kw["sync_period"]
        assert seen[0][:trained] == [0] * trained, (name, seen)
        assert seen[1][0] >= trained, (name, seen)
        # the global model every rank ends with: the initial one plus every push, scaled
        total = w0 + sum(pushed[0] + pushed[1], torch.zeros_like(w0))
        for res in results:
            final = torch.cat([t.reshape(-1) for t in res[name]["params"].values()]).double()
            torch.testing.assert_close(final, total, atol=1e-5, rtol=0, msg=name)
    # bytes: rank 1 pushes K values at every sync and once more when the ranks meet at the end;
    # rank 0 (the server) replies to each of those pushes and to rank 1's final pull
    for name, n in (("async", steps + 1), ("pipelined", steps // 2 + 1), ("pipelined_cntk", steps // 2 + 1)):
        assert results[1][name]["stats"]["weights/bytes_sent"] == n * K * F32
        assert results[0][name]["stats"]["weights/bytes_sent"] == (n + 1) * K * F32


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
