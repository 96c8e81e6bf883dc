"""Checkpoints on real ranks: each rank writes only its own state (a shard beside the file), so the
memory of a save does not grow with the ranks; expert-parallel evaluation from a checkpoint uses
every rank's own experts."""

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

MIB = 2**20


@pytest.mark.slow  # 19 s; the reshard tests save and load sharded checkpoints in the quick suite
def test_a_save_holds_one_ranks_state_whatever_the_number_of_ranks():
    # model averaging keeps every rank's local weights and momentum: 32 MiB a rank here
    sc = {"model": "wide", "strategy": "model_averaging", "kwargs": {"sync_period": 2, "sync_period_unit": "steps"}}
    sc.update(max_steps=2, batch_size=2, save_memory=True)
    rises = {}
    for world in (2, 4):
        results = run_ranks({"scenarios": {"save": {**sc, "devices": world}}}, world, timeout=600)
        files = results[0]["save"]["files"]
        assert files == ["save.ckpt", *(f"save.ckpt.rank{r}-of-{world}" for r in range(world))]
        state = results[0]["save"]["save_memory"]["rank_state_bytes"]
        assert state > 30 * MIB
        rises[world] = [r["save"]["save_memory"]["rise"] for r in results]
        shown = ", ".join(f"{x / MIB:.0f}" for x in rises[world])
        print(f"{world} ranks: resident memory rose by {shown} MiB on ranks 0.. during a save", end="")
        print(f" ({state / MIB:.0f} MiB of rank state)")
    # Gathering every rank's state onto every rank had made each rank rise by 2N + 1 states (its
    # pickle, the gathered buffer, the unpickled copies: 211-374 MiB here). Now a rank that only
    # streams its shard rises by at most its flat copy of the weights (0 to 33 MiB, in the
    # allocator's 16 MiB steps), and rank 0, which also writes the file (model, optimizer state,
    # global model: the same for any N), stays under 4 states.
    for world in (2, 4):
        assert max(rises[world][1:]) < 1.5 * state, world
        assert rises[world][0] < 4 * state, world


def test_shards_hold_each_ranks_own_state_and_the_file_none():
    # period 3: at the checkpoint after step 4 each rank's local weights have moved on alone
    sc = {"strategy": "model_averaging", "kwargs": {"sync_period": 3, "sync_period_unit": "steps"}}
    sc.update(max_steps=4, ckpt_every=4, trace=True)
    results = run_ranks({"scenarios": {"avg": sc}}, 2)
    for res in results:
        saved = res["avg"]["checkpoint"]
        assert saved["keys"] == ["shards", "state", "strategy", "world_size"]  # no rank's own state in the file
        assert saved["shards"] == ["step=4.ckpt.rank0-of-2", "step=4.ckpt.rank1-of-2"]
        assert torch.equal(saved["mine"]["weights"], res["avg"]["trace"][3])  # this rank's weights at step 4
    assert not torch.equal(results[0]["avg"]["trace"][3], results[1]["avg"]["trace"][3])


def test_expert_parallel_validates_a_checkpoint_with_each_ranks_own_experts():
    moe = {"model": "moe", "strategy": "expert_parallel", "kwargs": {"ep_size": 2}, "max_steps": 4, "ckpt_every": 4}
    moe["val_every"] = 4
    scenarios = {
        "fit": {**moe, "validate_after": True},
        "validate": {**moe, "validate_ckpt": ["fit", 4]},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        fitted, validated = res["fit"], res["validate"]
        # the model evaluated from the file is the one that was trained, experts and all, on every rank
        for key, value in fitted["params"].items():
            assert torch.equal(validated["params"][key], value), key
        assert validated["val_loss"] == pytest.approx(fitted["val_loss"], rel=0, abs=0)
    r0, r1 = (r["fit"]["params"] for r in results)
    experts = [k for k in r0 if ".experts." in k]
    assert experts and any(not torch.equal(r0[k], r1[k]) for k in experts)  # the ranks hold other experts


def _reshard(tmp_path, strategy, kwargs, before, after):
    """Train on ``before`` ranks to step 6 (mid-block), resume on ``after`` ranks to step 10."""
    first = {"strategy": strategy, "kwargs": kwargs, "max_steps": 6, "ckpt_every": 6, "state_trace": True}
    first.update(devices=before, ckpt_dir=str(tmp_path / strategy))
    saved = run_ranks({"scenarios": {"first": first}}, before)[0]["first"]
    path = str(tmp_path / strategy / "step=6.ckpt")
    resumed = {"strategy": strategy, "kwargs": {**kwargs, "resume_mismatch": "reshard"}, "max_steps": 10}
    resumed.update(devices=after, resume_path=path, state_trace=True)
    return saved, run_ranks({"scenarios": {"resumed": resumed}}, after), path


@pytest.mark.parametrize(("before", "after"), [(4, 2), pytest.param(2, 4, marks=pytest.mark.slow)])
def test_reshard_keeps_the_global_model_and_the_schedule_on_another_number_of_ranks(tmp_path, before, after):
    kwargs = {"sync_period": 4, "pseudo_grad_bits": 4, "small_tensor_numel": 0}
    saved, results, _ = _reshard(tmp_path, "diloco", kwargs, before, after)
    at_save = saved["states"][5]["state"]  # after step 6: the block that began at step 4 is half done
    for res in results:
        states = res["resumed"]["states"]
        first = states[0]["state"]  # after step 7: no sync yet
        assert first["optimizer_steps"] == 7 and first["block_start"] == at_save["block_start"] == [4]
        for w, v in zip(first["outer"]["weights"], at_save["outer"]["weights"], strict=True):
            assert torch.equal(w, v)  # the global model and its momentum carried over exactly
        momenta = [first["outer"]["optimizer"]["state"], at_save["outer"]["optimizer"]["state"]]
        for m, n in zip(*(x.values() for x in momenta), strict=True):
            assert torch.equal(m["momentum_buffer"], n["momentum_buffer"])
        assert states[1]["state"]["outer"]["syncs"] != first["outer"]["syncs"]  # the block ends at step 8
    for res in results[1:]:
        for key, value in res["resumed"]["params"].items():
            assert torch.equal(value, results[0]["resumed"]["params"][key]), key


@pytest.mark.slow  # 25 s
def test_reshard_restarts_the_residuals_of_a_gradient_scheme(tmp_path):
    _, results, path = _reshard(tmp_path, "onebit_sgd", {"small_tensor_numel": 64}, 2, 4)
    for res in results:
        states = res["resumed"]["states"]
        assert [s["state"]["optimizer_steps"] for s in states] == [7, 8, 9, 10]
        assert states[0]["rank"]["residuals"]  # new residuals, cut for 4 ranks
    # without "reshard" the mismatch is an error that says what to pass
    plain = {"strategy": "onebit_sgd", "kwargs": {"small_tensor_numel": 64}, "max_steps": 10, "resume_path": path}
    with pytest.raises(RuntimeError, match="failed") as info:
        run_ranks({"scenarios": {"plain": {**plain, "devices": 4}}}, 4, timeout=120)
    assert "saved by 2 ranks and this run has 4" in str(info.value) and "'reshard'" in str(info.value)
