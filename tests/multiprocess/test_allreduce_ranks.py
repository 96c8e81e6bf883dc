"""`allreduce` on real ranks: the same weights as Lightning's DDP, identical on every rank, bytes
from the ring formula."""

import math

import pytest
import torch
from harness import ring_bytes, run_ranks

from lightning_commstrats.buckets import plan_buckets

pytestmark = pytest.mark.multiprocess

N_PARAMS = 32 * 16 + 16 + 16 * 2 + 2  # the worker's Mlp


def _assert_same_params(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def _check(results, scenario, reference="ddp", atol=1e-5):
    for res in results:
        _assert_same_params(res[scenario]["params"], res[reference]["params"], atol)
        _assert_same_params(res[scenario]["params"], results[0][scenario]["params"], 0.0)  # bit-identical ranks


def test_two_ranks_equal_ddp_plain_accumulation_clipping_and_two_optimizers():
    scenarios = {
        "ddp": {"strategy": "ddp"},
        "ar": {"strategy": "allreduce"},
        "ddp_acc": {"strategy": "ddp", "accumulate": 2, "clip": 0.05, "max_steps": 5},
        "ar_acc": {"strategy": "allreduce", "accumulate": 2, "clip": 0.05, "max_steps": 5},
        "ddp_manual": {"strategy": "ddp", "model": "manual2", "max_steps": 10},
        "ar_manual": {"strategy": "allreduce", "model": "manual2", "max_steps": 10},
        "ar_small_buckets": {"strategy": "allreduce", "kwargs": {"bucket_cap_mb": 0.001}},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    _check(results, "ar")
    _check(results, "ar_acc", "ddp_acc")
    _check(results, "ar_manual", "ddp_manual")
    _check(results, "ar_small_buckets", "ar", atol=0.0)
    # the run really trained: weights moved away from the initial ones shared by every scenario
    assert not torch.equal(
        results[0]["ar"]["params"]["layer.0.weight"], results[0]["ar_acc"]["params"]["layer.0.weight"]
    )

    per_step = ring_bytes(N_PARAMS, 4, 2)
    for res in results:
        stats = res["ar"]["stats"]
        assert stats["steps"] == 8
        assert stats["grad/bytes_sent"] == 8 * per_step
        assert stats["grad/calls"] == 8  # one 25 MB bucket per step
        assert res["ar"]["last_step"]["grad/bytes_sent"] == per_step
        assert res["ar_acc"]["stats"]["grad/calls"] == 5  # one exchange per optimizer step, not per micro-batch
        # manual optimization: Lightning's max_steps counts each optimizer's step, so 5 batches x 2
        assert res["ar_manual"]["stats"]["steps"] == 10
        assert res["ar_manual"]["stats"]["grad/bytes_sent"] == 5 * (
            ring_bytes(32 * 16 + 16, 4, 2) + ring_bytes(16 * 2 + 2, 4, 2)
        )
        small = res["ar_small_buckets"]["stats"]
        # a 1048-byte cap: the 2048-byte weight alone, the three small tensors together
        assert plan_buckets([torch.zeros(n) for n in (512, 16, 32, 2)], int(0.001 * 2**20)) == [[0], [1, 2, 3]]
        assert small["grad/calls"] == 8 * 2
        assert small["grad/bytes_sent"] == 8 * (ring_bytes(512, 4, 2) + ring_bytes(50, 4, 2))
    # the monitor logged rank 0's bytes of the last batch
    assert results[0]["ar"]["logged"]["comm/grad_bytes"] == per_step


def test_four_ranks_equal_ddp():
    scenarios = {"ddp": {"strategy": "ddp", "devices": 4}, "ar": {"strategy": "allreduce", "devices": 4}}
    results = run_ranks({"scenarios": scenarios}, 4)
    _check(results, "ar")
    for res in results:
        assert res["ar"]["stats"]["grad/bytes_sent"] == 8 * 2 * 3 * math.ceil(N_PARAMS / 4) * 4


@pytest.mark.mpi
def test_under_mpiexec_equal_ddp_over_mpi_and_gloo():
    scenarios = {
        "ddp": {"strategy": "ddp"},
        "ar_mpi": {"strategy": "allreduce", "kwargs": {"backend": "mpi"}},
        "ar_gloo": {"strategy": "allreduce", "kwargs": {"backend": "gloo"}},
    }
    results = run_ranks({"scenarios": scenarios}, 2, launcher="mpiexec")
    _check(results, "ar_mpi")
    _check(results, "ar_gloo")
    assert "MPICommunicator" in results[0]["ar_mpi"]["comm"]
    # torchmetrics under MPI (torch.distributed not initialised): the perplexity metric synchronises
    # through the communicator, the same value on both ranks as torchmetrics' own sync under ddp
    lm = {"model": "lm", "validate_after": True, "max_steps": 4, "val_every": 16}  # no validation during fit
    metric_scenarios = {  # MPI first: after ddp, torch.distributed would stay initialised in these processes
        "ar_mpi": {"strategy": "allreduce", "kwargs": {"backend": "mpi"}, **lm},
        "ddp": {"strategy": "ddp", **lm},
    }
    lm_results = run_ranks({"scenarios": metric_scenarios}, 2, launcher="mpiexec")
    mpi, ddp = [[res[name]["validated_metrics"]["val/ppl"] for res in lm_results] for name in metric_scenarios]
    assert mpi[0] == mpi[1]
    assert mpi == pytest.approx(ddp, rel=1e-5)
    assert lm_results[0]["ar_mpi"]["stats"]["metrics/bytes_sent"] > 0
    assert results[1]["ar_mpi"]["stats"]["grad/bytes_sent"] == 8 * ring_bytes(N_PARAMS, 4, 2)
