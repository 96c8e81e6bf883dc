"""Which reduction each tensor takes, on real ranks: gradients through the (quantized) slow hop with a
residual of their own bucket, buffers exactly in fp32, a skipped step leaving every residual as it was.

The model (``routes_worker.TwinMlp``) has two layers of one shape, one never used: its gradient is
exactly zero on every rank, so under a gradient scheme it must not move, whatever the quantization
of the other layer's bucket of the same length. Two ranks as two groups of one: the hop between the
groups is the whole exchange, on the unsharded two-level path and on the sharded one.
"""

from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "routes_worker.py"
# buckets of one tensor each: the used and the spare weight give two buckets of equal length
ONE_TENSOR_BUCKETS = 0.01
PATHS = {
    "two_level": {"group_size": 1, "slow_hop_bits": 4, "bucket_cap_mb": ONE_TENSOR_BUCKETS},
    "sharded": {"shard": "fsdp", "group_size": 1, "slow_hop_bits": 4, "bucket_cap_mb": ONE_TENSOR_BUCKETS},
}


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    scenarios = {name: {"strategy": "allreduce", "kwargs": kwargs} for name, kwargs in PATHS.items()}
    scenarios.update(
        {
            f"{name}_skip": {
                "strategy": "allreduce",
                "kwargs": {**kwargs, "nonfinite": "skip"},
                "inject_inf": [3, 1],
            }
            for name, kwargs in PATHS.items()
        }
    )
    return run_ranks({"scenarios": scenarios}, 2, script=WORKER, timeout=240)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_weight_without_gradient_does_not_move_through_a_quantized_slow_hop(trained, path):
    for res in trained:
        run = res[path]
        # its own bucket of zeros; before buckets had keys of their own it took the residual of
        # used.weight's bucket of the same length and moved. Its bias shares a
        # bucket with tensors that have gradients: a quantized column mixes them, as 1-bit SGD does.
        torch.testing.assert_close(run["final"]["spare.weight"], run["init"]["spare.weight"], atol=0, rtol=0)
        assert not torch.equal(run["final"]["used.weight"], run["init"]["used.weight"])  # it trained
        # every bucket kept a residual of its own, named after its tensors
        residuals = run["hop_after"] or {}
        assert all("/" not in key.split(":")[0] for kind in residuals.values() for key in kind), residuals


@pytest.mark.parametrize("path", sorted(PATHS))
def test_buffers_are_the_exact_average_of_the_ranks_whatever_the_slow_hop(trained, path):
    own = [res[path]["own_buffers"] for res in trained]
    for name in ("norm.running_mean", "norm.running_var"):
        exact = torch.stack([mine[name].double() for mine in own]).mean(0).float()
        assert not torch.allclose(own[0][name], own[1][name])  # the ranks did differ
        for res in trained:
            torch.testing.assert_close(res[path]["buffers"][name], exact, atol=1e-6, rtol=1e-6, msg=name)
    for res in trained:  # counters are rank 0's
        assert int(res[path]["buffers"]["norm.num_batches_tracked"]) == int(own[0]["norm.num_batches_tracked"])


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_skipped_step_leaves_every_slow_hop_residual_as_it_was(trained, path):
    for res in trained:
        run = res[f"{path}_skip"]
        before, after = run["hop_before"], run["hop_after"]
        assert before["residuals"], "the quantized hop kept residuals before the skipped step"
        for kind in ("residuals", "residuals2"):
            assert sorted(after[kind]) == sorted(before[kind])
            for key, value in before[kind].items():
                torch.testing.assert_close(after[kind][key], value, atol=0, rtol=0, msg=key)
