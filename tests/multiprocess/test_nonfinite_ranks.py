"""Non-finite averages on real ranks: residuals never take an inf or a NaN, every rank reports the
same parameters, and the ``nonfinite`` policy raises or skips the step on every rank at once."""

import pytest
import torch
from harness import WORKER, run_ranks
from test_precision_ranks import equal

from lightning_commstrats.comm import MPI4PY_AVAILABLE

pytestmark = pytest.mark.multiprocess

NONFINITE_WORKER = WORKER.parent / "nonfinite_worker.py"
SKIP = 3  # the optimizer step whose gradient gets an inf, on rank 1 only


def _finite(residuals):
    return all(bool(torch.isfinite(r).all()) for d in residuals.values() for r in d.values())


@pytest.mark.parametrize("bits", [1, 4, 16])
def test_an_inf_on_one_rank_is_reported_everywhere_and_keeps_the_residuals(bits):
    rounds = ["normal", "inf", "normal", "nan_small", "normal"]
    results = run_ranks({"bits": bits, "rounds": rounds}, 2, script=NONFINITE_WORKER)
    for res in results:
        assert [r["bad"] for r in res] == [[], ["w"], [], ["b"], []]
        for i in (1, 3):  # the residuals of a round with a non-finite average are those before it
            assert equal(res[i]["residuals"], res[i - 1]["residuals"])
        assert res[0]["residuals"]["residuals"]  # there are residuals to keep
        assert all(_finite(r["residuals"]) for r in res)
        assert not equal(res[2]["residuals"], res[1]["residuals"])  # and the next round moves them again
        assert torch.isfinite(res[4]["avg"]["w"]).all()
    for a, b in zip(*results, strict=True):  # the same averages on both ranks, NaN where NaN
        for name in a["avg"]:
            torch.testing.assert_close(a["avg"][name], b["avg"][name], rtol=0, atol=0, equal_nan=True)


def test_a_float16_sum_that_overflows_keeps_the_residuals():
    # each rank's 40000 is a float16, their sum of 80000 is not: the owner's re-quantization overflows
    results = run_ranks({"bits": 16, "rounds": ["normal", "overflow", "normal"]}, 2, script=NONFINITE_WORKER)
    for res in results:
        assert [r["bad"] for r in res] == [[], ["w"], []]
        assert equal(res[1]["residuals"], res[0]["residuals"])
        assert all(_finite(r["residuals"]) for r in res)


def _trace_scenario(strategy, kwargs):
    return {
        "strategy": strategy,
        "kwargs": kwargs,
        "max_steps": 6,
        "momentum": 0.0,  # an inf in SGD's momentum would poison the next steps of that rank anyway
        "inject_inf": [SKIP, 1],
        "trace": True,
        "state_trace": True,
    }


def test_skip_policy_skips_the_step_on_every_rank_and_changes_no_state():
    scenarios = {
        "onebit": _trace_scenario("onebit_sgd", {"small_tensor_numel": 64, "nonfinite": "skip"}),
        # blocks of 2 steps: the inf makes rank 1's weights non-finite just before a sync
        "diloco": _trace_scenario(
            "diloco", {"sync_period": 2, "pseudo_grad_bits": 4, "small_tensor_numel": 16, "nonfinite": "skip"}
        ),
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        states, trace = res["onebit"]["states"], res["onebit"]["trace"]
        assert [s["skipped"] for s in states] == [i == SKIP for i in range(6)]
        assert equal(states[SKIP]["rank"], states[SKIP - 1]["rank"]) and states[SKIP]["rank"]["residuals"]
        assert equal(states[SKIP]["state"], states[SKIP - 1]["state"])
        assert torch.equal(trace[SKIP], trace[SKIP - 1])
        assert not torch.equal(trace[SKIP + 1], trace[SKIP])
        assert torch.isfinite(trace[-1]).all()
        # diloco: the block ending at the inf is discarded: the global model and its momentum stay,
        # every rank restarts from it
        states, trace = res["diloco"]["states"], res["diloco"]["trace"]
        before, after = states[SKIP - 2]["state"], states[SKIP]["state"]  # the syncs after steps 2 and 4
        assert equal(after["outer"], before["outer"])
        assert torch.equal(trace[SKIP], torch.cat([w.reshape(-1) for w in after["outer"]["weights"]]))
        assert all(torch.isfinite(r).all() for r in states[SKIP]["rank"]["exchange"]["residuals"].values())
        assert not equal(states[SKIP + 2]["state"]["outer"], after["outer"])  # the next block syncs
        assert torch.isfinite(trace[-1]).all()
    for name in scenarios:
        r0, r1 = (r[name] for r in results)
        for k, v in r0["params"].items():
            assert torch.equal(v, r1["params"][k]), (name, k)


def test_a_skipped_step_leaves_every_residual_of_a_sharded_compressed_exchange_on_every_rank():
    """Sharded (2 groups of 2), an inf in rank 1's shard: the exchange of shard 0 (ranks 0 and 2) is
    finite, that of shard 1 is not, and every rank skips the step. The compressed exchange's residuals
    used to move on ranks 0 and 2 all the same (committed at their own exchange, before the step's
    vote), so the ranks' states parted; now they wait for the vote on every rank."""
    shard = {"shard": "fsdp", "group_size": 2, "shard_policy": {"min_unit_numel": 1}}
    scenarios = {
        "onebit": {
            **_trace_scenario("onebit_sgd", {"small_tensor_numel": 64, "nonfinite": "skip", **shard}),
            "devices": 4,
        },
        "expert_parallel": {
            **_trace_scenario(
                "expert_parallel",
                {"ep_size": 2, "num_quantization_bits": 1, "small_tensor_numel": 16, "nonfinite": "skip", **shard},
            ),
            "model": "moe",
            "devices": 4,
        },
    }
    results = run_ranks({"scenarios": scenarios}, 4, timeout=400)
    for name in scenarios:
        for rank, res in enumerate(results):
            states = res[name]["states"]
            assert [s["skipped"] for s in states] == [i == SKIP for i in range(6)], (name, rank)
            residuals = states[SKIP]["rank"]["residuals"]
            assert residuals, (name, rank)  # there are residuals to keep
            assert equal(residuals, states[SKIP - 1]["rank"]["residuals"]), (name, rank)
            assert equal(states[SKIP]["rank"]["residuals2"], states[SKIP - 1]["rank"]["residuals2"]), (name, rank)
            assert not equal(states[SKIP + 1]["rank"]["residuals"], residuals), (name, rank)  # the next step moves them


def test_raise_policy_stops_every_rank_naming_the_parameter():
    scenarios = {"raise": _trace_scenario("onebit_sgd", {"small_tensor_numel": 64})}
    with pytest.raises(RuntimeError, match="failed") as info:
        run_ranks({"scenarios": scenarios}, 2, timeout=120)
    logs = str(info.value).split("--- log ")
    assert len(logs) == 3
    for log in logs[1:]:  # both ranks raised, not only the one with the inf
        assert "FloatingPointError: OneBitSGDStrategy: the averaged gradients of layer.0.weight hold inf or NaN" in log
        assert f"at optimizer step {SKIP}" in log


# A NaN in one rank's gradient at step SKIP, under every scheme with nonfinite="skip": every rank
# skips the step (or discards the block it poisoned) and the ranks end finite and equal.
STEPS = {"sync_period_unit": "steps"}
EVERY_SCHEME = {
    "allreduce": ("allreduce", {}),
    "allreduce_two_level": ("allreduce", {"group_size": 1}),
    "allreduce_two_level_4bit": ("allreduce", {"group_size": 1, "slow_hop_bits": 4}),
    "onebit": ("onebit_sgd", {"small_tensor_numel": 64}),
    "model_averaging": ("model_averaging", {"sync_period": 2, **STEPS}),
    "bmuf_warm_start": ("bmuf", {"sync_period": 2, **STEPS, "parallelization_start": 6}),
    "diloco_4bit": ("diloco", {"sync_period": 2, "pseudo_grad_bits": 4, "small_tensor_numel": 16}),
    "streaming": ("streaming_diloco", {"sync_period": 4, "num_fragments": 2, "fragment_sync_delay": 1}),
    "parameter_server": ("parameter_server", {"mode": "sync"}),
}
# the vocabulary schemes, on the language model (the NaN in the embedding's gradient)
VOCAB_SCHEMES = {
    "sampled_vocab": ("sampled_vocab", {"alpha": 3, "beta": 2, "word_counts": "data"}),
    "sampled_vocab_residuals": (
        "sampled_vocab",
        {"alpha": 3, "beta": 2, "word_counts": "data", "error_feedback": True},
    ),
}


def _nan_scenario(strategy: str, kwargs: dict, policy: str) -> dict:
    return {
        "strategy": strategy,
        "kwargs": {**kwargs, "nonfinite": policy},
        "max_steps": 8,
        "momentum": 0.0,
        "inject_inf": [SKIP, 1, "nan"],
        "state_trace": True,
    }


def test_every_scheme_skips_a_nan_on_every_rank():
    scenarios = {name: _nan_scenario(s, kw, "skip") for name, (s, kw) in EVERY_SCHEME.items()}
    scenarios.update({name: {**_nan_scenario(s, kw, "skip"), "model": "lm"} for name, (s, kw) in VOCAB_SCHEMES.items()})
    results = run_ranks({"scenarios": scenarios}, 2)
    for name in scenarios:
        r0, r1 = (r[name] for r in results)
        for k, v in r0["params"].items():
            assert torch.isfinite(v).all(), (name, k)
            assert torch.equal(v, r1["params"][k]), (name, k)
        skipped = [[s["skipped"] for s in r["states"]] for r in (r0, r1)]
        assert skipped[0] == skipped[1], (name, skipped)
        if name not in ("model_averaging", "diloco_4bit", "streaming"):  # gradient exchanges skip the step
            assert skipped[0] == [i == SKIP for i in range(8)], (name, skipped[0])


def test_expert_parallel_skips_a_nan_in_one_ranks_expert_on_every_rank():
    """Ranks hold different experts: a NaN in rank 1's expert gradient was seen by rank 1 alone
    (and applied to its experts); every rank must skip the step."""
    scenario = {
        "strategy": "expert_parallel",
        "model": "moe",
        "kwargs": {"ep_size": 2, "nonfinite": "skip"},
        "max_steps": 6,
        "momentum": 0.0,
        "inject_inf": [SKIP, 1, "nan", ".experts."],
        "state_trace": True,
    }
    results = run_ranks({"scenarios": {"ep": scenario}}, 2)
    for res in results:
        assert [s["skipped"] for s in res["ep"]["states"]] == [i == SKIP for i in range(6)]
        assert all(torch.isfinite(v).all() for v in res["ep"]["params"].values())
    for name, value in results[0]["ep"]["params"].items():
        if ".experts." not in name:
            assert torch.equal(value, results[1]["ep"]["params"][name]), name


@pytest.mark.parametrize("name", ["allreduce", pytest.param("bmuf_warm_start", marks=pytest.mark.slow)])
def test_a_nan_raises_on_every_rank(name):
    strategy, kwargs = EVERY_SCHEME[name]
    with pytest.raises(RuntimeError, match="failed") as info:
        run_ranks({"scenarios": {name: _nan_scenario(strategy, kwargs, "raise")}}, 2, timeout=120)
    logs = str(info.value).split("--- log ")
    assert len(logs) == 3
    for log in logs[1:]:  # both ranks raised, not only the one with the NaN
        assert "FloatingPointError" in log and "layer.0.weight hold inf or NaN" in log, log[-2000:]
        assert f"at optimizer step {SKIP}" in log


@pytest.mark.mpi
@pytest.mark.mpi4py
@pytest.mark.skipif(not MPI4PY_AVAILABLE, reason=str(MPI4PY_AVAILABLE))
@pytest.mark.parametrize("bits", [32, pytest.param(4, marks=pytest.mark.slow)])
def test_local_sgd_over_mpi_skips_a_nan_on_every_rank(bits):
    """local_sgd averaged a NaN in fp32 without a word, and dropped the 4-bit exchange's report."""
    kwargs = {"sync_period": 2, "pseudo_grad_bits": bits, "small_tensor_numel": 16}
    results = run_ranks({"scenarios": {"l": _nan_scenario("local_sgd", kwargs, "skip")}}, 2, launcher="mpiexec")
    r0, r1 = (r["l"] for r in results)
    for k, v in r0["params"].items():
        assert torch.isfinite(v).all() and torch.equal(v, r1["params"][k]), k
