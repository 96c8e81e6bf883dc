"""LayeredMixedPrecision on real ranks: an overflow on one rank skips the step on all of them and
leaves every scheme's state as it was; the plugin runs with each strategy of the package."""

import math

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

TRANSFORMER = {"arch": "transformer", "hidden_dim": 16, "num_heads": 2, "num_layers": 2, "ffn_dim": 32}
LM = {"model": "lm", "model_kwargs": {**TRANSFORMER, "dropout": 0.0}}
SCALED = {"preset": "layered", "dtype": "bf16", "loss_scaling": True, "init_scale": 1024.0}
SKIP = 3  # the optimizer step whose gradient gets an inf, on rank 1 only


def equal(a, b):
    """Bit-for-bit equality of nested states."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize(
    ("strategy", "kwargs"),
    [
        ("onebit_sgd", {"small_tensor_numel": 64}),
        # blocks of 2 steps: the skipped step would have ended a block
        ("bmuf", {"sync_period": 2, "sync_period_unit": "steps"}),
    ],
)
def test_an_overflow_on_one_rank_skips_the_step_everywhere_and_keeps_the_scheme_state(strategy, kwargs):
    sc = {**LM, "strategy": strategy, "kwargs": kwargs, "precision": SCALED, "max_steps": 6}
    scenarios = {"skip": {**sc, "inject_inf": [SKIP, 1], "trace": True, "state_trace": True}}
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        states, trace = res["skip"]["states"], res["skip"]["trace"]
        assert [s["skipped"] for s in states] == [i == SKIP for i in range(6)]
        assert [s["scale"] for s in states][SKIP - 1 : SKIP + 1] == [1024.0, 512.0]
        before, after = states[SKIP - 1], states[SKIP]
        assert equal(after["state"], before["state"]) and equal(after["rank"], before["rank"])
        assert after["rank"] or after["state"]["optimizer_steps"]  # there is state to compare
        assert torch.equal(trace[SKIP], trace[SKIP - 1])  # no update on either rank
        assert not torch.equal(trace[SKIP + 1], trace[SKIP])  # the next step trains
        assert res["skip"]["stats"]["precision/calls"] == 6  # one agreement per step
        assert all(math.isfinite(x) for x in res["skip"]["losses"])
        assert torch.isfinite(trace[-1]).all()
    r0, r1 = (r["skip"] for r in results)
    if strategy == "onebit_sgd":
        assert all(torch.equal(a, b) for a, b in zip(r0["trace"], r1["trace"], strict=True))
        assert r0["states"][SKIP]["rank"]["residuals"]  # 1-bit residuals exist and were kept
    else:
        blocks = [s["state"]["optimizer_steps"] for s in r0["states"]]
        assert blocks == [1, 2, 3, 3, 4, 5]
    for k, v in r0["params"].items():  # both ranks end on the same model
        assert torch.equal(v, r1["params"][k]), k


def test_layered_bf16_runs_with_every_strategy():
    layered = {"preset": "layered", "dtype": "bf16"}
    moe = {**TRANSFORMER, "dropout": 0.0, "num_experts": 2, "moe_every": 2}
    scenarios = {
        name: {**LM, "strategy": name, "kwargs": kwargs, "precision": layered, "max_steps": 6}
        for name, kwargs in {
            "allreduce": {},
            "onebit_sgd": {"small_tensor_numel": 64},
            "model_averaging": {"sync_period": 2, "sync_period_unit": "steps"},
            "bmuf": {"sync_period": 2, "sync_period_unit": "steps"},
            "sampled_vocab": {"alpha": 10, "beta": 5, "word_counts": "data"},
        }.items()
    }
    scenarios["expert_parallel"] = {
        "model": "lm", "model_kwargs": moe, "strategy": "expert_parallel", "kwargs": {"ep_size": 2},
        "precision": layered, "max_steps": 6,
    }  # fmt: skip
    scenarios["allreduce_fp32"] = {**scenarios["allreduce"], "precision": None}
    # Lightning's ddp too, with loss scaling: the overflow flag goes through torch.distributed
    scenarios["ddp"] = {**LM, "strategy": "ddp", "precision": SCALED, "max_steps": 6, "inject_inf": [SKIP, 1]}
    results = run_ranks({"scenarios": scenarios}, 2)
    for name in scenarios:
        r0, r1 = (r[name] for r in results)
        assert all(math.isfinite(x) for x in r0["losses"] + r1["losses"]), name
        assert r0["losses"][-1] < r0["losses"][0], name
        if name == "ddp":
            assert r0["precision"]["scaler"]["skipped_steps"] == r1["precision"]["scaler"]["skipped_steps"] == 1
        else:  # bf16 without scaling: no agreement needed
            assert r0["stats"].get("precision/calls", 0) == 0, name
        for k, v in r0["params"].items():
            assert v.dtype == torch.float32, (name, k)
            if ".experts." not in k:  # experts are sharded; everything else is replicated
                assert torch.equal(v, r1["params"][k]), (name, k)
    # same gradient bytes as float32: the masters and their gradients are float32
    fp32, bf16 = results[0]["allreduce_fp32"]["stats"], results[0]["allreduce"]["stats"]
    assert bf16["grad/bytes_sent"] == fp32["grad/bytes_sent"]


@pytest.mark.mpi
def test_local_sgd_under_mpiexec_skips_an_overflow_on_every_rank():
    sc = {
        **LM, "strategy": "local_sgd", "kwargs": {"sync_period": 2},
        "precision": SCALED, "max_steps": 6, "inject_inf": [SKIP, 1], "trace": True, "state_trace": True,
    }  # fmt: skip
    results = run_ranks({"scenarios": {"local": sc}}, 2, launcher="mpiexec")
    for res in results:
        states, trace = res["local"]["states"], res["local"]["trace"]
        assert [s["skipped"] for s in states] == [i == SKIP for i in range(6)]
        assert equal(states[SKIP]["state"], states[SKIP - 1]["state"])
        assert torch.equal(trace[SKIP], trace[SKIP - 1])
    r0, r1 = (r["local"] for r in results)
    for k, v in r0["params"].items():
        assert torch.equal(v, r1["params"][k]), k
