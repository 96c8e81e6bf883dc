"""Models built without their memory, trained sharded on real ranks (gloo, CPU).

``Trainer.init_module(empty_init=True)``, a ``configure_model`` that builds on the meta device, a
LitGPT-style ``configure_model`` that shards ``self.model`` itself, and Fabric's
``init_module(empty_init=True)``: every parameter ends a DTensor holding only this rank's shard, the
shards are initialised (each rank of a group draws its own, every group the same model), the run
trains (loss falls) and ends with every rank agreeing. Memory is counted by the kernel (VmHWM, see
``empty_init_worker.py``).
"""

import re
from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "empty_init_worker.py"
SHARD = {"shard": "fsdp", "group_size": 2, "shard_policy": {"min_unit_numel": 1}}
PERIOD = {"sync_period": 2, "sync_period_unit": "steps"}
SCHEMES = {
    "allreduce": {},
    "onebit_sgd": {"num_quantization_bits": 1},  # its 1-bit exchange across the groups, of the shards
    "model_averaging": PERIOD,
    "bmuf": PERIOD,
    "diloco": PERIOD,
    "streaming_diloco": {**PERIOD, "num_fragments": 2, "fragment_sync_delay": 0},
    "sparseloco": {**PERIOD, "topk_chunk": 32, "topk_per_chunk": 8, "fragment_sync_delay": 0},
}


def _is_norm(param: str) -> bool:
    return re.search(r"\.blocks\.\d+\.0\.", param) is not None  # model.blocks.<i>.0: the block's LayerNorm


def _check_run(name: str, runs: list[dict], groups: int = 2) -> None:
    """Sharded in halves, initialised, equal across groups at the start, trained, agreeing at the end."""
    g = len(runs) // groups
    for r in runs:
        assert r["sharded"], name
        assert r["tied"] in (True, None), name
        for param, n in r["full_numel"].items():
            assert r["local_numel"][param] * g == n, (name, param)
        losses = r["losses"]
        assert all(torch.isfinite(torch.tensor(losses))), (name, losses)
        assert sum(losses[-2:]) < sum(losses[:2]), (name, losses)
    for i in range(g):  # rank i of every group starts from the same shards, bit for bit
        for k in range(1, groups):
            other = runs[i + k * g]
            for param, t in runs[i]["start"].items():
                assert torch.equal(t, other["start"][param]), (name, i, param)
    # the shards of one group are drawn apart (not one shard repeated) and are initialised
    first, second = runs[0]["start"], runs[1]["start"]
    for param, t in first.items():
        assert torch.isfinite(t).all(), (name, param)
        if not _is_norm(param) and not param.endswith("bias"):
            assert not torch.equal(t, second[param]), (name, param)
    norm = [p for p in first if _is_norm(p) and p.endswith("weight")]  # LayerNorm's reset: ones
    assert norm and all(torch.equal(first[p], torch.ones_like(first[p])) for p in norm), name
    emb = torch.cat([r["start"]["model.emb.weight"] for r in runs[:g]])
    assert 0.8 < emb.std().item() < 1.2, (name, emb.std())  # nn.Embedding's reset: N(0, 1)
    for i in range(g):  # every group ends on the same model
        for k in range(1, groups):
            for param, t in runs[i]["final"].items():
                torch.testing.assert_close(t, runs[i + k * g]["final"][param], atol=0, rtol=0)


def test_models_built_empty_or_on_meta_train_sharded_with_allreduce_and_diloco():
    scenarios = {
        "diloco_empty": {"strategy": "diloco", "kwargs": {**PERIOD, **SHARD}, "build": "empty"},
        "allreduce_meta": {"strategy": "allreduce", "kwargs": SHARD, "build": "meta"},
        "fabric_diloco_empty": {
            "front": "fabric",
            "strategy": "diloco",
            "kwargs": {**PERIOD, **SHARD},
            "build": "empty",
        },
    }
    runs = run_ranks({"scenarios": scenarios}, 4, script=WORKER)
    for name in scenarios:
        _check_run(name, [r[name] for r in runs])
    assert any("reset_parameters" in c for c in runs[0]["diloco_empty"]["init_calls"])


def test_a_litgpt_style_configure_model_sharding_self_model_trains():
    # the network is self.model, built on meta and sharded (its blocks, self.model, self) by
    # configure_model; the steps call self.model(x), never the root's forward
    scenarios = {"wrapped": {"strategy": "diloco", "kwargs": {**PERIOD, **SHARD}, "build": "wrapped", "devices": 2}}
    # and a group whose ranks built the model apart (rank 0 empty, rank 1 with memory) is refused on both
    # ranks before either waits in a collective the other never reaches
    scenarios["mixed"] = {
        **scenarios["wrapped"],
        "build": "whole",
        "build_by_rank": {"0": "empty"},
        "expect_error": True,
    }
    runs = run_ranks({"scenarios": scenarios}, 2, script=WORKER)
    _check_run("wrapped", [r["wrapped"] for r in runs], groups=1)
    for r in runs:
        assert "some ranks built the model on the meta device and others with memory" in (r["mixed"]["error"] or "")


@pytest.mark.slow
def test_every_scheme_that_shards_trains_a_model_built_empty_and_one_built_on_meta():
    scenarios = {
        f"{scheme}_{build}": {"strategy": scheme, "kwargs": {**kwargs, **SHARD}, "build": build, "max_steps": 6}
        for scheme, kwargs in SCHEMES.items()
        for build in ("empty", "meta")
    }
    runs = run_ranks({"scenarios": scenarios}, 4, script=WORKER, timeout=600)
    for name in scenarios:
        _check_run(name, [r[name] for r in runs])


@pytest.mark.slow
def test_no_rank_built_empty_ever_holds_the_whole_model_by_the_kernels_count():
    # 4 ranks, one group of 4, plain SGD: the steady state is a quarter of the parameters and a quarter
    # of the gradients (0.5x the model) plus one gathered unit. Built whole, every rank first holds the
    # whole model (>= 1x); built empty it never does. Counted by the kernel (VmHWM above VmRSS before
    # the build, glibc's mmap threshold fixed so that freed blocks go back)
    dims = {"vocab": 64, "dim": 2048, "blocks": 8}  # 33.7M parameters, 135 MB in fp32
    # memory_phases=False: the strategy never resets the kernel's peak, which this test reads itself
    base = {"strategy": "allreduce", "kwargs": {"shard": "fsdp", "group_size": 4, "memory_phases": False}, "dims": dims}
    base.update(optimizer="sgd_plain", record_weights=False, max_steps=3)
    scenarios = {"whole": {**base, "build": "whole"}, "empty": {**base, "build": "empty"}}
    runs = run_ranks({"scenarios": scenarios}, 4, script=WORKER, timeout=600)
    for r in runs:
        model = r["empty"]["rss"]["model_bytes"]
        whole, empty = r["whole"]["rss"], r["empty"]["rss"]
        built_whole = (whole["build_peak"] - whole["start"]) / model
        built_empty = (empty["build_peak"] - empty["start"]) / model
        trained_empty = (empty["train_peak"] - empty["start"]) / model
        # measured here: built whole 1.11x, built empty 0.26x, its training 0.81x (every rank)
        assert built_whole >= 1.0, built_whole
        assert built_empty < 0.6 and trained_empty < 0.9, (built_empty, trained_empty)
