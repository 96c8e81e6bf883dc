"""BMUF in the paper's form and in CNTK's, and model averaging weighted as CNTK weights it, on real
ranks, block by block against references written here from the paper's equations and from CNTK's
``BlockMomentumSGD`` / ``BasicModelAveragingSGD`` (not from this package's code). Each reference
takes the ranks' own local models at the end of each block (``w_local = w_start - G``, from the
pseudo-gradient each rank computed) and nothing else of the package's."""

import math

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = {"sync_period_unit": "steps"}


def _flat(named):
    return torch.cat([t.reshape(-1) for t in named.values()])


def _global(state):
    return torch.cat(state["state"]["outer"]["weights"])


def _local_models(results, scenario, k, start):
    """Every rank's local model at the end of block ``k``: its block's start point minus the
    pseudo-gradient ``G = w_start - w_local`` it sent."""
    return [start - _flat(r[scenario]["exchanges"][k]["mine"]).double() for r in results]


def _cntk_bmuf(results, scenario, w0, steps, bm, blr, nesterov):
    """CNTK's BlockMomentumSGD::ModelAggregationProcessing per block: blockGrad = prevWeight -
    currentWeight on each worker, summed over workers (AllReduce); sg = bm sg + (1 - bm) blr
    blockGrad (ScaleAndAdd); currentWeight = prevWeight - sg, then, with Nesterov, currentWeight -=
    bm sg; prevWeight = currentWeight. Yields (step, prevWeight): CNTK's one model, where the next
    block starts and what it validates and saves."""
    prev, sg = w0.double(), torch.zeros_like(w0, dtype=torch.float64)
    for k, step in enumerate(steps):
        block_grad = sum(prev - w for w in _local_models(results, scenario, k, prev))
        sg = bm * sg + (1 - bm) * blr * block_grad
        current = prev - sg
        if nesterov:
            current = current - bm * sg
        prev = current
        yield step, prev


def _paper_bmuf(results, scenario, w0, steps, eta, zeta, nesterov):
    """Chen & Huo (ICASSP 2016): W_bar(t) the average of the workers' models, G(t) = W_bar(t) -
    W_g(t-1), Delta(t) = eta Delta(t-1) + zeta G(t), W(t) = W(t-1) + Delta(t); the next block starts
    from W_g(t) = W(t) + eta Delta(t) with Nesterov, else W(t). Yields (step, W(t), W_g(t))."""
    w, start, delta = w0.double(), w0.double(), torch.zeros_like(w0, dtype=torch.float64)
    for k, step in enumerate(steps):
        local = _local_models(results, scenario, k, start)
        g = sum(local) / len(local) - start
        delta = eta * delta + zeta * g
        w = w + delta
        start = w + eta * delta if nesterov else w
        yield step, w, start


def test_bmuf_paper_and_cntk_forms_block_by_block_against_their_references():
    world, bm, blr = 2, 0.5, 0.8
    common = {"max_steps": 12, "record_exchange": True, "state_trace": True}
    kw = {"sync_period": 4, **STEPS, "block_momentum": bm, "block_learning_rate": blr}
    scenarios = {
        "paper": {**common, "strategy": "bmuf", "kwargs": kw},
        "paper_classic": {**common, "strategy": "bmuf", "kwargs": {**kw, "use_nesterov_momentum": False}},
        "cntk": {**common, "strategy": "bmuf", "kwargs": {**kw, "variant": "cntk"}},
        "cntk_classic": {
            **common,
            "strategy": "bmuf",
            "kwargs": {**kw, "variant": "cntk", "use_nesterov_momentum": False},
        },
        # CNTK's units: blocks of 16 samples per worker (4 batches of 4), blockSize 2 x 16 = 32 over
        # both workers; a time constant of 64 samples over all workers: bm = exp(-32 / 64)
        "cntk_time_constant": {
            **common,
            "strategy": "bmuf",
            "kwargs": {"sync_period": 16, "variant": "cntk", "block_momentum_as_time_constant": 64.0},
        },
    }
    results = run_ranks({"scenarios": scenarios}, world)
    syncs = (4, 8, 12)
    for name, nesterov in (("cntk", True), ("cntk_classic", False), ("cntk_time_constant", True)):
        momentum = math.exp(-world * 16 / 64.0) if name == "cntk_time_constant" else bm
        rate = 1.0 if name == "cntk_time_constant" else blr
        states = [r[name]["states"] for r in results]
        assert [e["step"] for e in results[0][name]["exchanges"]] == list(syncs), name
        w0 = _global(states[0][0])  # before the first sync: the initial weights
        for step, prev in _cntk_bmuf(results, name, w0, syncs, momentum, rate, nesterov):
            for rank in range(world):
                s = states[rank][step - 1]
                # the next block starts at CNTK's model, and that model is what validation and checkpoints see
                torch.testing.assert_close(s["rank"]["weights"].double(), prev, atol=2e-6, rtol=0, msg=name)
                torch.testing.assert_close(_global(s).double(), prev, atol=2e-6, rtol=0, msg=name)
        for rank in range(world):  # every rank ends with CNTK's model
            final = torch.cat([t.reshape(-1) for t in results[rank][name]["params"].values()]).double()
            torch.testing.assert_close(final, prev, atol=2e-6, rtol=0, msg=name)
    for name, nesterov in (("paper", True), ("paper_classic", False)):
        states = [r[name]["states"] for r in results]
        w0 = _global(states[0][0])
        for step, w, start in _paper_bmuf(results, name, w0, syncs, bm, blr, nesterov):
            for rank in range(world):
                s = states[rank][step - 1]
                torch.testing.assert_close(_global(s).double(), w, atol=2e-6, rtol=0, msg=name)  # W(t)
                torch.testing.assert_close(s["rank"]["weights"].double(), start, atol=2e-6, rtol=0, msg=name)
        for rank in range(world):  # the end of fit: the global model W(t), not the look-ahead point
            final = torch.cat([t.reshape(-1) for t in results[rank][name]["params"].values()]).double()
            torch.testing.assert_close(final, w, atol=2e-6, rtol=0, msg=name)
    # the forms really differ on this run: CNTK sums the workers' block gradients, so the same blr moves further
    first = [_global(r["cntk"]["states"][3]) - _global(r["paper"]["states"][3]) for r in results]
    assert first[0].abs().max() > 1e-3


def test_bmuf_one_unit_per_block_on_four_ranks():
    # every rank's one weight moves +1/4 a step: a block of 4 steps moves each worker one unit from
    # its start. N = 4 and the defaults: block momentum 0.75, block learning rate 1 (both forms)
    world = 4
    base = {"model": "unit", "devices": world, "max_steps": 12, "trace": True}
    kw = {"sync_period": 4, **STEPS}
    scenarios = {
        "paper": {**base, "strategy": "bmuf", "kwargs": kw},
        "cntk": {**base, "strategy": "bmuf", "kwargs": {**kw, "variant": "cntk"}},
    }
    results = run_ranks({"scenarios": scenarios}, world)
    starts = {"paper": [1.75, 4.0625, 6.796875], "cntk": [1.75, 4.8125, 8.859375]}
    final = {"paper": 5.0625, "cntk": 8.859375}  # the paper form ends on W(t), CNTK on its one model
    for res in results:
        for name in scenarios:
            trace = [t.item() for t in res[name]["trace"]]
            assert [trace[3], trace[7], trace[11]] == starts[name], name
            assert trace[4] == starts[name][0] + 0.25  # training continues from the start point
            assert res[name]["params"]["layer.weight"].item() == final[name], name


def test_model_averaging_weighted_by_each_rank_s_samples_on_uneven_batches():
    # rank 0 trains on batches of 4, rank 1 on batches of 6
    base = {"model": "uneven", "batch_size": 4, "momentum": 0.0, "max_steps": 8}
    record = {"record_exchange": True, "state_trace": True}
    scenarios = {
        "steps": {**base, **record, "strategy": "model_averaging", "kwargs": {"sync_period": 4, **STEPS}},
        # a schedule in samples is decided on the agreed count (the mean, 5 a step): every 2 steps
        "samples": {**base, **record, "strategy": "model_averaging", "kwargs": {"sync_period": 10}},
        "uniform": {**base, **record, "strategy": "model_averaging", "kwargs": {"sync_period": 4, **STEPS}},
    }
    for name in ("steps", "samples"):
        scenarios[name]["kwargs"]["weighting"] = "samples"
    results = run_ranks({"scenarios": scenarios}, 2, timeout=180)
    for name, period in (("steps", 4), ("samples", 2), ("uniform", 4)):
        # CNTK: factor_r = samplesSinceLastSync_r / sum over ranks; w = sum_r factor_r w_r
        samples = [period * 4, period * 6] if name != "uniform" else [1, 1]
        states = [r[name]["states"] for r in results]
        syncs = [e["step"] for e in results[0][name]["exchanges"]]
        assert syncs == list(range(period, 9, period)), name
        start = _global(states[0][0]).double()
        for k, step in enumerate(syncs):
            local = _local_models(results, name, k, start)
            expected = sum(n * w for n, w in zip(samples, local, strict=True)) / sum(samples)
            for rank in range(2):
                torch.testing.assert_close(_global(states[rank][step - 1]).double(), expected, atol=1e-6, rtol=0)
            if name != "uniform":  # uneven counts: not the plain mean
                assert (expected - sum(local) / 2).abs().max() > 1e-4, name
            start = expected
        for res in results:  # the counts restart after every average; a checkpoint would hold this rank's
            assert res[name]["states"][-1]["rank"].get("block_samples", 0) == 0
