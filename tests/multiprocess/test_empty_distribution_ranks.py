"""A model built empty is the model built whole, in distribution, on real ranks (4, gloo, CPU).

Per tensor, the statistics of an empty build (``Trainer.init_module(empty_init=True)``, sharded) against
those of a whole build of the same model: the std of every weight, the rows that must be zero (an
embedding's padding row), the norms' ones, a buffer drawn in ``__init__``, the MoE router's own std; and
the seeds follow the mesh: dense tensors equal on every rank, an expert equal on its replicas and
different from every other expert. Across layouts: ``allreduce`` sharded in 2 groups of 2, and
``expert_parallel`` (dp 2 x ep 2) with ``inner="dp"`` and ``inner="ep"``.
"""

from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "empty_distribution_worker.py"
SHARD = {"shard": "fsdp", "shard_policy": {"min_unit_numel": 1}}
LAYOUTS = {
    "allreduce": ("allreduce", {**SHARD, "group_size": 2}),
    "ep_dp_inner": ("expert_parallel", {**SHARD, "ep_size": 2, "inner": "dp"}),
    "ep_ep_inner": ("expert_parallel", {**SHARD, "ep_size": 2, "inner": "ep"}),
}
PROJ_STD, ROUTER_STD = 0.5, 0.02  # the worker's


@pytest.fixture(scope="module")
def runs():
    scenarios = {
        f"{layout}_{build}": {"strategy": strategy, "kwargs": kwargs, "build": build}
        for layout, (strategy, kwargs) in LAYOUTS.items()
        for build in ("whole", "empty")
    }
    return run_ranks({"scenarios": scenarios}, 4, script=WORKER, timeout=600)


def _experts(runs, name):
    """{global expert index: [(ep rank, tensors) of every rank holding it]}."""
    held = {}
    for r in runs:
        for index, tensors in r[name]["experts"].items():
            held.setdefault(index, []).append((r[name]["ep_rank"], tensors))
    return held


def _check_build(runs, name):
    first = runs[0][name]
    dense, buffers = first["dense"], first["buffers"]
    # dense tensors and buffers: the same on every rank, bit for bit
    for r in runs[1:]:
        for key, t in dense.items():
            assert torch.equal(t, r[name]["dense"][key]), (name, key)
        for key, b in buffers.items():
            assert torch.equal(b, r[name]["buffers"][key]), (name, key)
    emb = dense["model.emb.weight"]
    assert torch.equal(emb[0], torch.zeros_like(emb[0])), (name, "the padding row")
    assert 0.8 < emb[1:].std().item() < 1.2, (name, emb[1:].std())
    assert torch.equal(dense["model.norm.weight"], torch.ones_like(dense["model.norm.weight"])), name
    router = dense["model.moe.router.weight"]
    assert 0.6 * ROUTER_STD < router.std().item() < 1.4 * ROUTER_STD, (name, router.std())
    proj = buffers["model.proj"]
    assert torch.isfinite(proj).all() and 0.8 * PROJ_STD < proj.std().item() < 1.2 * PROJ_STD, (name, proj.std())
    # experts: every one held, equal on its replicas, different from every other expert
    held = _experts(runs, name)
    assert sorted(held) == [0, 1, 2, 3], (name, sorted(held))
    for index, copies in held.items():
        for _, tensors in copies[1:]:
            for key, t in tensors.items():
                assert torch.equal(t, copies[0][1][key]), (name, index, key)
        assert 0.015 < copies[0][1]["w1"].std().item() < 0.025, (name, index)
    for a in held:
        for b in held:
            if a < b:
                assert not torch.equal(held[a][0][1]["w1"], held[b][0][1]["w1"]), (name, a, b)
    return {key: t.std().item() for key, t in dense.items() if t.numel() > 1 and t.std() > 0}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_model_built_empty_is_the_model_built_whole_in_distribution(runs, layout):
    whole = _check_build(runs, f"{layout}_whole")
    empty = _check_build(runs, f"{layout}_empty")
    assert whole.keys() == empty.keys(), (sorted(whole), sorted(empty))
    for key, std in whole.items():  # every weight's spread as the whole build draws it
        assert abs(empty[key] - std) < 0.25 * std, (layout, key, std, empty[key])
