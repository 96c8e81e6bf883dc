"""The Fabric front end on real ranks: the same weights and bytes as the Trainer, checkpoints that
resume bit for bit, evaluation on the global model."""

from pathlib import Path

import pytest
import torch
from harness import ring_bytes, run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "fabric_worker.py"
N_PARAMS = 32 * 16 + 16 + 16 * 2 + 2
BMUF = {"strategy": "bmuf", "kwargs": {"sync_period": 4, "sync_period_unit": "steps"}}
# two fp32 steps (8 samples over both ranks each, counted at the batch), then 1 bit for the two
# matrices (the biases stay fp32)
ONEBIT = {"strategy": "onebit_sgd", "kwargs": {"distributed_after": 24, "small_tensor_numel": 16}}
SCHEME_TAGS = ("setup", "grad", "weights")


def _tag_bytes(stats, tag):
    return stats.get(f"{tag}/bytes_sent", 0)


def test_fabric_trains_as_the_trainer_does_with_the_same_bytes():
    scenarios = {
        "trainer_bmuf": {"front": "trainer", **BMUF},
        "fabric_bmuf": {"front": "fabric", **BMUF},  # by name, settings through FabricStrategy("bmuf", ...)
        "trainer_onebit": {"front": "trainer", **ONEBIT},
        "fabric_onebit": {"front": "fabric", "instance": True, **ONEBIT},  # FabricStrategy(OneBitSGDStrategy(...))
    }
    results = run_ranks({"scenarios": scenarios}, 2, script=WORKER, timeout=300)
    for front in ("trainer", "fabric"):
        for scheme in ("bmuf", "onebit"):
            name = f"{front}_{scheme}"
            torch.testing.assert_close(results[1][name]["params"], results[0][name]["params"], atol=0, rtol=0)
    assert results[0]["fabric_onebit"]["strategy"] == "FabricStrategy(OneBitSGDStrategy)"
    for res in results:
        for scheme in ("bmuf", "onebit"):
            trainer, fabric = res[f"trainer_{scheme}"], res[f"fabric_{scheme}"]
            # the same batches, the same steps, the same exchange: the same numbers
            assert fabric["losses"] == trainer["losses"]
            torch.testing.assert_close(fabric["params"], trainer["params"], atol=0, rtol=0)
            for tag in SCHEME_TAGS:
                assert _tag_bytes(fabric["stats"], tag) == _tag_bytes(trainer["stats"], tag), (scheme, tag)
        # bmuf: two syncs of the fp32 weights in 8 steps, a ring all-reduce each
        assert _tag_bytes(res["fabric_bmuf"]["stats"], "weights") == 2 * ring_bytes(N_PARAMS, 4, 2)
        # 1-bit SGD: two fp32 warm-start steps, then six steps at less than a quarter of fp32's bytes
        grad = _tag_bytes(res["fabric_onebit"]["stats"], "grad")
        assert 2 * ring_bytes(N_PARAMS, 4, 2) < grad < (2 + 6 / 4) * ring_bytes(N_PARAMS, 4, 2)


def test_fabric_checkpoint_resumes_mid_block_bit_for_bit_and_evaluates_the_global_model():
    scenarios = {
        "whole": {"front": "fabric", "max_steps": 12, **BMUF},
        "saved": {"front": "fabric", "max_steps": 6, "save_at": 6, "finish": False, **BMUF},  # mid-block
        "resumed": {"front": "fabric", "max_steps": 12, "resume": ["saved", 6], **BMUF},
        "evaluated": {
            "front": "fabric",
            "strategy": "model_averaging",
            "kwargs": {"sync_period": 4, "sync_period_unit": "steps"},
            "max_steps": 6,
            "evaluate": True,
        },
    }
    results = run_ranks({"scenarios": scenarios}, 2, script=WORKER, timeout=300)
    for res in results:
        assert res["saved"]["files"] == ["saved.ckpt", "saved.ckpt.rank0-of-2", "saved.ckpt.rank1-of-2"]
        # the global model, block momentum, local weights and optimizer state of each rank came back
        assert res["resumed"]["losses"] == res["whole"]["losses"][6:]
        torch.testing.assert_close(res["resumed"]["params"], res["whole"]["params"], atol=0, rtol=0)
    # evaluation mid-block: both ranks see the same (global) weights, then get their own back
    a, b = results[0]["evaluated"], results[1]["evaluated"]
    assert not torch.equal(a["local"], b["local"])
    torch.testing.assert_close(a["evaluated"], b["evaluated"], atol=0, rtol=0)
    assert not torch.equal(a["evaluated"], a["local"])
    for res in (a, b):
        torch.testing.assert_close(res["after_evaluation"], res["local"], atol=0, rtol=0)
    # finish(): the last sync, every rank ends with the same model
    torch.testing.assert_close(a["params"], b["params"], atol=0, rtol=0)


def test_fabric_runs_the_parameter_server_as_the_trainer_does():
    ps = {"strategy": "parameter_server", "kwargs": {"num_servers": "all"}}
    scenarios = {"trainer_ps": {"front": "trainer", **ps}, "fabric_ps": {"front": "fabric", **ps}}
    results = run_ranks({"scenarios": scenarios}, 2, script=WORKER, timeout=300)
    for res in results:
        trainer, fabric = res["trainer_ps"], res["fabric_ps"]
        assert fabric["losses"] == trainer["losses"]
        torch.testing.assert_close(fabric["params"], trainer["params"], atol=0, rtol=0)
        # two servers of 281 values each: a rank pushes the other's half and sends its half back, 8 steps
        assert _tag_bytes(fabric["stats"], "grad") == _tag_bytes(trainer["stats"], "grad") == 8 * 2 * 281 * 4
