"""Expert parallelism on real ranks against the unsharded layer in one process."""

import pytest
import torch
from harness import WORKER, ring_bytes, run_ranks

pytestmark = pytest.mark.multiprocess

MOE_WORKER = WORKER.parent / "moe_worker.py"
BASE = {"experts": 4, "tokens": 24, "d": 8, "f": 16}


@pytest.mark.parametrize(
    ("world", "dp", "ep", "inner", "top_k", "balance", "policy"),
    # about 10 s each: the quick suite keeps one of each layout (2 ranks, ep over 4, inner "ep") and
    # the precision; the other balances and top-2 layouts run in the slow suite
    [
        (2, 1, 2, "dp", 1, "aux", None),
        pytest.param(2, 1, 2, "dp", 2, "capacity", None, marks=pytest.mark.slow),
        (4, 1, 4, "dp", 1, "swipe", None),
        pytest.param(4, 2, 2, "dp", 2, "aux", None, marks=pytest.mark.slow),
        (4, 2, 2, "ep", 1, "capacity", None),
        (2, 1, 2, "dp", 2, "aux", "bf16"),  # layered precision: experts and the all-to-all in bf16
        pytest.param(2, 1, 2, "dp", 2, "bias", None, marks=pytest.mark.slow),
        pytest.param(4, 2, 2, "ep", 1, "bias", None, marks=pytest.mark.slow),
    ],
)
def test_sharded_forward_and_backward_equal_the_single_process_layer(world, dp, ep, inner, top_k, balance, policy):
    spec = {**BASE, "dp": dp, "ep": ep, "inner": inner, "top_k": top_k, "balance": balance, "policy": policy}
    results = run_ranks(spec, world, script=MOE_WORKER)
    for res in results:
        # all-to-all bytes: the rows that left for other ranks, out and back, x hidden x element bytes
        # (the return trip sends back exactly what came in from others: summed over ranks they match)
        assert res["backward_bytes"] == res["forward_bytes"]
    total_forward = sum(r["forward_bytes"] for r in results)
    element_bytes = 2 if policy else 4
    assert all(r["element_bytes"] == element_bytes for r in results)
    assert total_forward == 2 * sum(r["sent_rows"] for r in results) * BASE["d"] * element_bytes
    assert sorted({(r["first"], r["count"]) for r in results}) == [(i * 4 // ep, 4 // ep) for i in range(ep)]
    if balance == "swipe":
        for r in results:
            assert max(r["load"]) == min(r["load"]) == BASE["tokens"] // 4 and r["dropped"] == 0
    if balance == "bias":
        # every rank's bias is the single-process layer's, which saw all ranks' tokens (the ranks'
        # own loads differ: their tokens route differently)
        for r in results:
            assert torch.equal(r["bias"]["sharded"], r["bias"]["reference"]) and r["bias"]["sharded"].any()


def _expert_slice(name, value, ep_rank, per_rank):
    return value[ep_rank * per_rank : (ep_rank + 1) * per_rank] if ".experts." in name else value


def test_expert_parallel_training_equals_data_parallel_training_and_resumes():
    moe = {"model": "moe", "max_steps": 6, "momentum": 0.0}
    scenarios = {
        "ar": {**moe, "strategy": "allreduce"},
        "ep": {**moe, "strategy": "expert_parallel", "kwargs": {"ep_size": 2}},
        "ep_straight": {**moe, "strategy": "expert_parallel", "max_steps": 64 + 8, "ckpt_every": 64},
        "ep_resumed": {**moe, "strategy": "expert_parallel", "max_steps": 64 + 8, "resume": ["ep_straight", 64]},
        # a clip that bites: the norm must be the whole model's, the same on both ranks
        "ar_clip": {**moe, "strategy": "allreduce", "clip": 0.05},
        "ep_clip": {**moe, "strategy": "expert_parallel", "kwargs": {"ep_size": 2}, "clip": 0.05},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for rank, res in enumerate(results):
        for ar, ep in (
            (res["ar"]["params"], res["ep"]["params"]),
            (res["ar_clip"]["params"], res["ep_clip"]["params"]),
        ):
            assert ep["net.blocks.1.ffn.experts.w1"].shape[0] == 2  # half of the 4 experts
            for name, value in ep.items():
                torch.testing.assert_close(value, _expert_slice(name, ar[name], rank, 2), atol=1e-5, rtol=1e-4)
        assert any(not torch.allclose(res["ar_clip"]["params"][k], res["ar"]["params"][k]) for k in res["ar"]["params"])
        assert res["ep"]["stats"]["tokens/bytes_sent"] > 0
        for name, value in res["ep_straight"]["params"].items():
            torch.testing.assert_close(res["ep_resumed"]["params"][name], value, atol=1e-6, rtol=0)
    for name, value in results[0]["ep_clip"]["params"].items():  # dense replicas stay identical
        if ".experts." not in name:
            assert torch.equal(value, results[1]["ep_clip"]["params"][name]), name
    # the two ranks hold different experts
    assert not torch.equal(
        results[0]["ep"]["params"]["net.blocks.1.ffn.experts.w1"],
        results[1]["ep"]["params"]["net.blocks.1.ffn.experts.w1"],
    )


def test_the_strategys_clip_is_the_only_clip():
    """With the experts' gradients zero, each rank's own norm equals the global one: Lightning's clip
    after the strategy's scaled the gradients once more (by max / (norm + 1e-6), a factor of each
    rank's own norm), so the dense replicas could drift. It must not touch them."""
    moe = {"model": "moe", "max_steps": 4, "momentum": 0.0, "clip_check": True, "scale_expert_grads": 0.0}
    scenarios = {"ep": {**moe, "strategy": "expert_parallel", "kwargs": {"ep_size": 2}, "clip": 0.05}}
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        assert res["ep"]["clip_untouched"] == [True] * 4, res["ep"]["clip_untouched"]


BIAS = "net.blocks.1.ffn.expert_bias"
# TinyMoELM's experts: 4 x (w1 16 x 32 + b1 32 + w2 32 x 16 + b2 16) floats
EXPERT_NUMEL = 4 * (16 * 32 + 32 + 32 * 16 + 16)


def test_bias_balancing_agrees_over_ranks_and_expert_gradients_travel_in_one_bucket():
    moe = {
        "model": "moe",
        "max_steps": 6,
        "momentum": 0.0,
        "model_kwargs": {"balance": "bias", "bias_update_rate": 0.01},
    }
    scenarios = {
        "ar": {**moe, "strategy": "allreduce"},
        "ep": {**moe, "strategy": "expert_parallel", "kwargs": {"ep_size": 2}},
        # every rank holds all experts: their gradients are all-reduced over the two replicas
        "dp": {**moe, "strategy": "expert_parallel", "kwargs": {"ep_size": 1, "dp_size": 2}},
        # 16 optimizer steps of two batches: an epoch boundary, where the worker's data resumes exactly
        "straight": {**moe, "strategy": "expert_parallel", "max_steps": 20, "accumulate": 2, "ckpt_every": 16},
        "resumed": {**moe, "strategy": "expert_parallel", "max_steps": 20, "accumulate": 2, "resume": ["straight", 16]},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for name in scenarios:
        first, second = (r[name]["params"][BIAS] for r in results)
        # the ranks route other tokens, yet hold the same bias: the load that moves it is both ranks'
        assert torch.equal(first, second), name
        assert first.any() and torch.allclose(first / 0.01, (first / 0.01).round(), atol=1e-4), name
    for rank, res in enumerate(results):
        ar, ep, dp = (res[k]["params"] for k in ("ar", "ep", "dp"))
        assert torch.equal(ar[BIAS], ep[BIAS]) and torch.equal(ar[BIAS], dp[BIAS])
        for name, value in ep.items():
            torch.testing.assert_close(value, _expert_slice(name, ar[name], rank, 2), atol=1e-5, rtol=1e-4)
        for name, value in dp.items():
            torch.testing.assert_close(value, ar[name], atol=1e-5, rtol=1e-4)
        # one fused all-reduce of all expert gradients per step, charged as a ring over the one buffer
        stats = res["dp"]["stats"]
        assert stats["grad_experts/calls"] == 6
        assert stats["grad_experts/bytes_sent"] == 6 * ring_bytes(EXPERT_NUMEL, 4, 2)
        assert "grad_experts/calls" not in res["ep"]["stats"]  # dp = 1: nothing to sum
        for name, value in res["straight"]["params"].items():
            torch.testing.assert_close(res["resumed"]["params"][name], value, atol=1e-6, rtol=0)


def test_the_quantile_rules_gain_agrees_over_ranks_and_resumes():
    """The quantile rule's bias, gain and last step come from the counts and shifts summed over the
    ranks: the same on both ranks though they route other tokens, and restored by a resume."""
    moe = {
        "model": "moe",
        "momentum": 0.0,
        "model_kwargs": {"balance": "bias", "bias_update_rule": "quantile"},
        "strategy": "expert_parallel",
        "max_steps": 20,
        "accumulate": 2,  # the load and shifts of two batches per update
    }
    scenarios = {  # the checkpoint at an epoch's end, where the worker's data resumes exactly
        "straight": {**moe, "ckpt_every": 16},
        "resumed": {**moe, "resume": ["straight", 16]},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    names = [BIAS, BIAS.replace("expert_bias", "bias_gain"), BIAS.replace("expert_bias", "bias_last_step")]
    for name in scenarios:
        for key in names:
            first, second = (r[name]["params"][key] for r in results)
            assert torch.equal(first, second), (name, key)
        bias, gain = results[0][name]["params"][names[0]], results[0][name]["params"][names[1]]
        assert bias.any() and 0.05 <= float(gain) <= 1.0
    for res in results:
        for key in names:
            assert torch.equal(res["resumed"]["params"][key], res["straight"]["params"][key]), key
