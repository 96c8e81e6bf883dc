"""``shard="fsdp"`` on real ranks (gloo, CPU): 4 ranks as 2 groups x 2 shards.

Every periodic scheme and the gradient schemes against an unsharded run of the same scheme on the
same data: 2 ranks whose batch is the concatenation of one group's two batches (the loss is a mean,
so a group's reduce-scattered gradient is that batch's gradient). Tolerance: 1e-5 absolute on
weights of order 1. The two runs differ only in the order of float32 sums (FSDP2 sums two half-batch
means, the reference takes one mean of the whole batch; both round at ~6e-8 relative per step), and
over 8 steps of lr 0.5 SGD the measured difference is below 1e-6.
"""

import tempfile
from pathlib import Path

import pytest
import torch
from harness import ring_bytes, run_ranks

from lightning_commstrats.compression import ColumnCodec

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "shard_worker.py"
SHARD = {"shard": "fsdp", "group_size": 2, "shard_policy": {"min_unit_numel": 1}}
STEPS = {"sync_period": 4, "sync_period_unit": "steps"}
STREAM = {"num_fragments": 2, "fragment_sync_delay": 1, "keep_local_progress": True}
PERIODIC = {  # fp32 exchanges: the sharded run is the unsharded one up to the order of float sums
    "model_averaging": {},
    "bmuf": {},
    "diloco": {},
    "streaming_diloco": {**STREAM, "pseudo_grad_bits": 32},
}
# compressed exchanges with error feedback, per row (a row is never cut by FSDP2's dim-0 shards) and
# chunks of one row (32 values): the same codes as unsharded, but a code is a step function, and a
# 1e-7 difference at a bin's edge moves a value by one 4-bit bin (about 1e-2 here) or swaps two
# near-equal values of a top-k; these are compared within one bin
COMPRESSED = {
    "diloco_4bit": ("diloco", {"pseudo_grad_bits": 4, "small_tensor_numel": 0}),
    "streaming_4bit": ("streaming_diloco", {**STREAM, "small_tensor_numel": 0}),
    "sparseloco": (
        "sparseloco",
        {"topk_chunk": 32, "topk_per_chunk": 8, "fragment_sync_delay": 0, "small_tensor_numel": 32},
    ),
}
ATOL = 1e-5
BIN = 0.1


def _whole(parts: list[torch.Tensor]) -> torch.Tensor:
    """A parameter from its FSDP2 shards (dim 0, in rank order)."""
    return torch.cat(parts, dim=0)


def _runs(schemes: dict, steps: int = 8):
    """``schemes``: scenario name -> (registry name, settings)."""
    sharded = {
        k: {"strategy": s, "kwargs": {**STEPS, **kw, **SHARD}, "max_steps": steps, "optimizer": "sgd"}
        for k, (s, kw) in schemes.items()
    }
    reference = {
        k: {"strategy": s, "kwargs": {**STEPS, **kw}, "max_steps": steps, "optimizer": "sgd", "merge": 2, "devices": 2}
        for k, (s, kw) in schemes.items()
    }
    return run_ranks({"scenarios": sharded}, 4, script=WORKER), run_ranks({"scenarios": reference}, 2, script=WORKER)


def test_periodic_schemes_on_shards_match_the_unsharded_run():
    schemes = {**{k: (k, kw) for k, kw in PERIODIC.items()}, **COMPRESSED}
    sharded, reference = _runs(schemes)
    for scheme in schemes:
        atol = ATOL if scheme in PERIODIC else BIN
        runs = [r[scheme] for r in sharded]
        for res in runs:
            assert res["sharded"] and res["tied"], scheme
            for name, n in res["full_numel"].items():
                assert res["local_numel"][name] * 2 == n, (scheme, name)  # every rank holds half
        # after every sync rank i of both groups holds the same global shards, bit for bit
        assert [s for s, _ in runs[0]["syncs"]] == [s for s, _ in reference[0][scheme]["syncs"]], scheme
        assert len(runs[0]["syncs"]) >= 2, scheme
        for i in (0, 1):
            for (step_a, a), (step_b, b) in zip(runs[i]["syncs"], runs[i + 2]["syncs"], strict=True):
                assert step_a == step_b
                for name in a:
                    assert torch.equal(a[name], b[name]), (scheme, i, step_a, name)
        # the global model at every sync, put together from the two shards, is the reference's
        for k, (step, ref) in enumerate(reference[0][scheme]["syncs"]):
            for name, whole in ref.items():
                got = _whole([runs[0]["syncs"][k][1][name], runs[1]["syncs"][k][1][name]])
                torch.testing.assert_close(got, whole, atol=atol, rtol=0, msg=f"{scheme} step {step} {name}")
        for name, whole in reference[0][scheme]["final"].items():
            for res in runs:
                torch.testing.assert_close(res["final"][name], whole, atol=atol, rtol=0, msg=f"{scheme} {name}")


def test_gradient_schemes_across_groups():
    schemes = {"allreduce": {}, "onebit_sgd": {"small_tensor_numel": 64}}
    sharded = {
        k: {"strategy": k, "kwargs": {**kw, **SHARD}, "max_steps": 6, "optimizer": "sgd", "trace": True}
        for k, kw in schemes.items()
    }
    reference = {
        k: {"strategy": k, "kwargs": kw, "max_steps": 6, "optimizer": "sgd", "merge": 2, "devices": 2}
        for k, kw in schemes.items()
    }
    runs = run_ranks({"scenarios": sharded}, 4, script=WORKER)
    ref = run_ranks({"scenarios": reference}, 2, script=WORKER)
    for scheme in schemes:
        for i in (0, 1):  # the same shards in both groups after every step
            for a, b in zip(runs[i][scheme]["steps"], runs[i + 2][scheme]["steps"], strict=True):
                for name in a:
                    assert torch.equal(a[name], b[name]), (scheme, name)
    for name, whole in ref[0]["allreduce"]["final"].items():
        torch.testing.assert_close(runs[0]["allreduce"]["final"][name], whole, atol=ATOL, rtol=0)
    # bytes across groups, by hand: each rank all-reduces its own shard of the gradients (one fused
    # bucket of its local values, float32) over a ring of the 2 groups, once per step
    local = sum(runs[0]["allreduce"]["local_numel"].values())
    assert local == sum(runs[0]["allreduce"]["full_numel"].values()) // 2
    per_step = 2 * (2 - 1) * (-(-local // 2)) * 4
    assert per_step == ring_bytes(local, 4, 2)
    for res in runs:
        assert res["allreduce"]["stats"]["grad/bytes_sent"] == 6 * per_step
    # 1-bit across groups, by the payload formula: each rank's shards of the three matrices (the
    # embedding's 32 of 64 rows, each block's 16 of 32 rows; 32 columns) in two stripes of columns
    # between the 2 groups (this rank's place among them: its group), the biases' shards in fp32
    for rank, res in enumerate(runs):
        stats, group = res["onebit_sgd"]["stats"], rank // 2
        quantized = sum(_stage_bytes(rows, 32, 2, group) for rows in (32, 16, 16))
        assert stats["grad_quantized/bytes_sent"] == 6 * quantized
        assert stats["grad/bytes_sent"] == 6 * ring_bytes(16 + 16, 4, 2)


@pytest.mark.slow  # five 4-rank launches, about two minutes: make test-all
def _stage_bytes(rows: int, cols: int, world: int, rank: int) -> int:
    """What one rank sends of a matrix in the two-stage 1-bit aggregation: its stripes of columns
    to their owners, then its own stripe, re-quantized, to every other rank."""
    codec = ColumnCodec(1)
    width = -(-cols // world)
    stripes = [(min(k * width, cols), min((k + 1) * width, cols)) for k in range(world)]
    sizes = [codec.payload_bytes(c1 - c0, rows) if c1 > c0 else 0 for c0, c1 in stripes]
    return sum(sizes) - sizes[rank] + (world - 1) * sizes[rank]


@pytest.mark.slow  # 44 s: the quick suite's budget (test_checkpoint_ranks reshards unsharded runs quickly)
def test_checkpoint_mid_block_resumes_bit_for_bit_and_onto_other_layouts():
    ckpt = tempfile.mkdtemp(prefix="commstrats-shard-ckpt-")
    kw = {"sync_period": 3, "sync_period_unit": "steps", "pseudo_grad_bits": 4, **SHARD}
    common = {"strategy": "diloco", "max_steps": 8, "epoch_steps": 4}  # step 4: an epoch's end, mid-block
    scenarios = {
        "straight": {**common, "kwargs": kw, "ckpt_every": 4, "ckpt_dir": ckpt},
        "resumed": {**common, "kwargs": kw, "resume": ["straight", 4], "resume_dir": ckpt},
    }
    same = run_ranks({"scenarios": scenarios}, 4, script=WORKER)
    for res in same:
        for name, value in res["straight"]["final"].items():
            assert torch.equal(res["resumed"]["final"][name], value), name
    # the global model saved at step 4 is the one of the sync at step 3
    step, saved = same[0]["straight"]["syncs"][0]
    assert step == 3
    global_at_3 = {
        n: _whole([same[0]["straight"]["syncs"][0][1][n], same[1]["straight"]["syncs"][0][1][n]]) for n in saved
    }
    for group_size, shards in ((4, 4), (1, 1)):  # 1 group x 4 shards, 4 groups x 1
        other = {**kw, "group_size": group_size, "resume_mismatch": "reshard"}
        res = run_ranks(
            {"scenarios": {"x": {**common, "kwargs": other, "resume": ["straight", 4], "resume_dir": ckpt}}},
            4,
            script=WORKER,
        )
        for r in res:
            run = r["x"]
            for name, n in run["full_numel"].items():
                assert run["local_numel"][name] * shards == n
            for name, whole in global_at_3.items():  # every rank starts from the saved global model
                assert torch.equal(run["start"][name], whole), (group_size, name)
            assert [s for s, _ in run["syncs"]] == [6]
            assert run["losses"][-1] < run["losses"][0]
    refused = {**kw, "group_size": 4}  # another layout without resume_mismatch="reshard"
    with pytest.raises(RuntimeError, match="resume_mismatch"):
        run_ranks(
            {"scenarios": {"x": {**common, "kwargs": refused, "resume": ["straight", 4], "resume_dir": ckpt}}},
            4,
            script=WORKER,
        )


@pytest.mark.slow  # three 4-rank runs in one launch, about a minute: make test-all
def test_fabric_trains_sharded_as_the_trainer_does_and_resumes_bit_for_bit():
    kw = {"sync_period": 3, "sync_period_unit": "steps", "pseudo_grad_bits": 4, "small_tensor_numel": 0, **SHARD}
    scenarios = {
        "trainer": {"strategy": "diloco", "kwargs": kw, "max_steps": 8},
        "fabric": {"front": "fabric", "strategy": "diloco", "kwargs": kw, "max_steps": 8, "save_at": 4},
        "resumed": {"front": "fabric", "strategy": "diloco", "kwargs": kw, "max_steps": 8, "resume": ["fabric", 4]},
    }
    results = run_ranks({"scenarios": scenarios}, 4, script=WORKER)
    for res in results:
        assert res["fabric"]["tied"] and res["fabric"]["local_numel"]["emb.weight"] == 1024
        for name, value in res["trainer"]["final"].items():
            assert torch.equal(res["fabric"]["final"][name], value), name
            assert torch.equal(res["resumed"]["final"][name], value), name
        assert (
            res["fabric"]["stats"]["weights_quantized/bytes_sent"]
            == res["trainer"]["stats"]["weights_quantized/bytes_sent"]
        )


def test_a_hugging_face_gpt2_trains_sharded_as_it_does_unsharded():
    pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[hf]'")
    # transformers' GPT-2 (lm_head tied to wte): its blocks are units, the tie stays with the root
    scenario = {"strategy": "diloco", "model": "gpt2", "max_steps": 8, "optimizer": "sgd"}
    sharded = run_ranks({"scenarios": {"g": {**scenario, "kwargs": {**STEPS, **SHARD}}}}, 4, script=WORKER)
    reference = run_ranks(
        {"scenarios": {"g": {**scenario, "kwargs": STEPS, "merge": 2, "devices": 2}}}, 2, script=WORKER
    )
    for res in sharded:
        run = res["g"]
        assert run["sharded"] and run["tied"]
        assert all(run["local_numel"][n] * 2 == n_full for n, n_full in run["full_numel"].items())
        for name, whole in reference[0]["g"]["final"].items():
            torch.testing.assert_close(run["final"][name], whole, atol=ATOL, rtol=0, msg=name)


def test_a_nan_in_one_ranks_shard_is_every_ranks_decision():
    # rank 1's shard alone holds the NaN (its group's partner and the other group average theirs):
    # every rank of the run skips that step, none trains on while the others wait or diverge
    kw = {**SHARD, "nonfinite": "skip"}
    scenarios = {"ar": {"strategy": "allreduce", "kwargs": kw, "max_steps": 6, "nan_at": [2, 1], "trace": True}}
    results = run_ranks({"scenarios": scenarios}, 4, script=WORKER)
    assert [r["ar"]["optimizer_steps"] for r in results] == [5, 5, 5, 5]
    for i in (0, 1):
        for a, b in zip(results[i]["ar"]["steps"], results[i + 2]["ar"]["steps"], strict=True):
            for name in a:
                assert torch.equal(a[name], b[name]), name


def test_one_group_keeps_no_cross_group_bucket_and_still_agrees_on_a_nan():
    # 2 ranks, one group of 2: FSDP2's reduce-scatter is the whole exchange. No fused bucket (a copy of
    # the gradient shards) is kept, nothing is sent across groups, and a NaN in rank 1's shard alone
    # still makes both ranks skip the step
    kw = {**SHARD, "nonfinite": "skip"}
    scenarios = {"ar": {"strategy": "allreduce", "kwargs": kw, "max_steps": 6, "nan_at": [2, 1], "devices": 2}}
    results = run_ranks({"scenarios": scenarios}, 2, script=WORKER)
    assert [r["ar"]["optimizer_steps"] for r in results] == [5, 5]
    for r in results:
        assert r["ar"]["memory"]["scheme"] == {}, r["ar"]["memory"]
        assert "grad/bytes_sent" not in r["ar"]["stats"], sorted(r["ar"]["stats"])
    for name, t in results[0]["ar"]["final"].items():
        assert torch.equal(t, results[1]["ar"]["final"][name]), name
