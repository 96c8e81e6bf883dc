"""The weight-exchange family on real ranks: its equivalences, bytes, final synchronisation,
validation on the global model, and resume mid-block."""

import pytest
import torch
from harness import ring_bytes, run_ranks

pytestmark = pytest.mark.multiprocess

N_PARAMS = 32 * 16 + 16 + 16 * 2 + 2
STEPS = {"sync_period_unit": "steps"}


def _close(a, b, atol):
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def _ranks_identical(results, scenario):
    for res in results[1:]:
        _close(res[scenario]["params"], results[0][scenario]["params"], 0.0)


def _weights_per_step(result) -> list[int]:
    return [int(s.get("weights/bytes_sent", 0)) for s in result["step_bytes"]]


def test_equivalences_bytes_final_sync_and_validation_on_two_ranks():
    scenarios = {
        "ma4": {"strategy": "model_averaging", "kwargs": {"sync_period": 4, **STEPS}, "trace": True},
        "bmuf_as_ma4": {
            "strategy": "bmuf",
            "kwargs": {
                "sync_period": 4,
                **STEPS,
                "block_momentum": 0.0,
                "block_learning_rate": 1.0,
                "use_nesterov_momentum": False,
                "reset_sgd_momentum": False,
            },
        },
        "ar_sgd": {"strategy": "allreduce", "momentum": 0.0},
        "ma1_sgd": {"strategy": "model_averaging", "momentum": 0.0, "kwargs": {"sync_period": 1, **STEPS}},
        "bmuf_partial": {"strategy": "bmuf", "max_steps": 10, "trace": True, "kwargs": {"sync_period": 4, **STEPS}},
        "bmuf_val": {
            "strategy": "bmuf",
            "max_steps": 12,
            "val_every": 6,
            "trace": True,
            "kwargs": {"sync_period": 4, **STEPS},
        },
        "ma_samples": {"strategy": "model_averaging", "kwargs": {"sync_period": 16}},  # 16 samples = 4 batches of 4
        "bmuf_warm": {"strategy": "bmuf", "kwargs": {"sync_period": 2, **STEPS, "parallelization_start": 4}},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for name in scenarios:
        _ranks_identical(results, name)  # the final synchronisation leaves every rank with the global model
    for res in results:
        _close(res["bmuf_as_ma4"]["params"], res["ma4"]["params"], 1e-6)
        _close(res["ma1_sgd"]["params"], res["ar_sgd"]["params"], 1e-6)
        _close(res["ma_samples"]["params"], res["ma4"]["params"], 0.0)
        # between synchronisations the ranks really differ
        assert not torch.equal(res["ma4"]["trace"][1], results[0]["ma4"]["trace"][1]) or res is results[0]
        # bytes: the model's ring all-reduce once per period (8 steps / 4 = 2 synchronisations)
        assert res["ma4"]["stats"]["weights/bytes_sent"] == 2 * ring_bytes(N_PARAMS, 4, 2)
        assert res["ma4"]["stats"].get("grad/bytes_sent", 0) == 0
        # 10 steps with period 4: two blocks and a final partial one
        assert res["bmuf_partial"]["stats"]["weights/calls"] == 3
        # each sync's bytes are in the step that made it; the end-of-fit sync in the last step
        sync = ring_bytes(N_PARAMS, 4, 2)
        assert _weights_per_step(res["ma4"]) == [0, 0, 0, sync, 0, 0, 0, sync]
        assert _weights_per_step(res["bmuf_partial"]) == [0, 0, 0, sync, 0, 0, 0, sync, 0, 0]
        # the SIGTERM flag round: 4 bytes a batch, read one batch later
        assert [s.get("control/bytes_sent", 0) for s in res["ma4"]["step_bytes"]] == [0] + [4] * 7
        assert res["bmuf_partial"]["last_step"]["weights/bytes_sent"] == sync
        assert res["bmuf_partial"]["last_step"]["steps"] == 1
        # warm start: 4 synchronous steps, then blocks of 2 steps
        assert res["bmuf_warm"]["stats"]["grad/calls"] == 4
        assert res["bmuf_warm"]["stats"]["weights/calls"] == 2
    # validation in the middle of a block sees the global model, the same on every rank
    validated = [res["bmuf_val"]["validated"] for res in results]
    assert len(validated[0]) == 2
    for v in validated[1:]:
        for a, b in zip(v, validated[0], strict=True):
            assert torch.equal(a, b)
    # ... and training continued from the local weights, not from the global model
    assert not torch.equal(validated[0][0], results[0]["bmuf_val"]["trace"][5])


def test_resume_mid_block_reproduces_the_uninterrupted_run():
    # 32 steps per epoch; a checkpoint at step 32 falls in the middle of a 5-step block
    kw = {"sync_period": 5, **STEPS}
    scenarios = {
        "straight": {"strategy": "bmuf", "kwargs": kw, "max_steps": 64, "ckpt_every": 32},
        "resumed": {"strategy": "bmuf", "kwargs": kw, "max_steps": 64, "resume": ["straight", 32]},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        _close(res["resumed"]["params"], res["straight"]["params"], 1e-6)


@pytest.mark.mpi
def test_local_sgd_over_mpi_equals_model_averaging_over_gloo():
    scenarios = {
        "local": {"strategy": "local_sgd", "kwargs": {"sync_period": 4}},
        "ma": {"strategy": "model_averaging", "kwargs": {"sync_period": 4, **STEPS, "backend": "gloo"}},
    }
    results = run_ranks({"scenarios": scenarios}, 2, launcher="mpiexec")
    assert "MPICommunicator" in results[0]["local"]["comm"]
    for res in results:
        _close(res["local"]["params"], res["ma"]["params"], 1e-6)
        assert res["local"]["stats"]["weights/calls"] == 2 * 4  # two exchanges, one Allreduce per tensor
    _ranks_identical(results, "local")
