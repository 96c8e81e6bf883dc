"""What a `sampled_vocab` step makes the host wait for, counted on real ranks (``benchmarks/hotpath.py``)."""

import pytest
from harness import WORKER, run_ranks

pytestmark = pytest.mark.multiprocess

HOTPATH_WORKER = WORKER.parent / "hotpath_worker.py"


def test_sampled_vocab_reads_device_memory_only_for_the_sizes_of_the_data():
    spec = {
        "scheme": "sampled_vocab",
        "steps": 4,
        "warmup": 1,
        "vocab": 500,
        "dim": 16,
        "kwargs": {"alpha": 0.2, "beta": 0.1, "error_feedback": True},
    }
    steps = run_ranks(spec, 2, script=HOTPATH_WORKER)[0]["steps"]
    assert len(steps) == 3
    for counts in steps:
        kinds = counts["sync_kinds"]
        # the words this rank saw and the words of the step (two nonzero), the all-gather's lengths
        # (one tolist); no boolean mask, no unique, no copy of the rows to the host
        assert kinds.get("aten::nonzero") == 2, kinds
        assert kinds.get("Tensor.tolist") == 1, kinds
        assert set(kinds) <= {"aten::nonzero", "Tensor.tolist", "aten::_local_scalar_dense"}, kinds
        # one .item() of the SIGTERM agreement's host flag, one of the fp32 exchange's finiteness,
        # one of the vocabulary rows' (every rank's vocabulary gradients finite or not)
        assert kinds.get("aten::_local_scalar_dense", 0) <= 3, kinds
