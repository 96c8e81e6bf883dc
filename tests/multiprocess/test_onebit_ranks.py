"""`onebit_sgd` on real ranks: identical ranks after every step, 32 bits = allreduce, warm start,
bytes from the codec's formula, and resume = uninterrupted run."""

import math

import pytest
import torch
from harness import run_ranks

from lightning_commstrats.compression import ColumnCodec

pytestmark = pytest.mark.multiprocess

ONEBIT = {"strategy": "onebit_sgd", "trace": True}
SMALL = 100  # quantize the Mlp's 16x32 weight (512 values); the rest is small


def _identical_every_step(results, scenario):
    steps = results[0][scenario]["trace"]
    assert steps, "no steps traced"
    for res in results[1:]:
        for a, b in zip(res[scenario]["trace"], steps, strict=True):
            assert torch.equal(a, b)


def _stage_bytes(rows, cols, world, rank, bits=1):
    """Per-step bytes of the quantized part from the codec's payload formula."""
    codec = ColumnCodec(bits)
    width = -(-cols // world)
    stripes = [(min(k * width, cols), min((k + 1) * width, cols)) for k in range(world)]
    sizes = [codec.payload_bytes(c1 - c0, rows) if c1 > c0 else 0 for c0, c1 in stripes]
    return sum(sizes) - sizes[rank] + (world - 1) * max(sizes)


def test_two_ranks_identical_after_every_step_and_32_bits_is_allreduce():
    kw = {"small_tensor_numel": SMALL}
    scenarios = {
        "ar": {"strategy": "allreduce", "trace": True},
        "q32": {**ONEBIT, "kwargs": {**kw, "num_quantization_bits": 32}},
        "q1": {**ONEBIT, "kwargs": kw},
        "q1_warm": {**ONEBIT, "kwargs": {**kw, "distributed_after": 3, "distributed_after_unit": "steps"}},
        "q1_warm_samples": {**ONEBIT, "kwargs": {**kw, "distributed_after": 3 * 4 * 2}},  # 3 steps x 4 x 2 ranks
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for name in scenarios:
        _identical_every_step(results, name)
    for a, b in zip(results[0]["q32"]["trace"], results[0]["ar"]["trace"], strict=True):
        assert torch.equal(a, b)
    ar, q1 = results[0]["ar"]["trace"], results[0]["q1"]["trace"]
    assert not torch.equal(ar[-1], q1[-1])  # quantization really happened
    for warm in ("q1_warm", "q1_warm_samples"):
        trace = results[0][warm]["trace"]
        assert all(torch.equal(trace[i], ar[i]) for i in range(3))  # full precision before the warm start ends
        assert not torch.equal(trace[3], ar[3])
    # the 16x32 weight is the only quantized matrix: 32 columns of 16 values
    for rank, res in enumerate(results):
        stats = res["q1"]["stats"]
        assert stats["grad_quantized/bytes_sent"] == 8 * _stage_bytes(16, 32, 2, rank)
        assert stats["grad_quantized/calls"] == 8 * 2
        assert res["q1_warm"]["stats"]["grad_quantized/calls"] == 5 * 2
        assert res["q32"]["stats"].get("grad_quantized/calls", 0) == 0


def test_four_ranks_identical_after_every_step():
    scenarios = {"q1": {**ONEBIT, "devices": 4, "kwargs": {"small_tensor_numel": SMALL}}}
    results = run_ranks({"scenarios": scenarios}, 4)
    _identical_every_step(results, "q1")
    for rank, res in enumerate(results):
        assert res["q1"]["stats"]["grad_quantized/bytes_sent"] == 8 * _stage_bytes(16, 32, 4, rank)


def test_resume_equals_the_uninterrupted_run():
    # 256 samples / (2 ranks x 4) = 32 steps per epoch: checkpoint at the epoch boundary, run 2 epochs
    kw = {"small_tensor_numel": SMALL}
    scenarios = {
        "straight": {**ONEBIT, "kwargs": kw, "max_steps": 64, "ckpt_every": 32},
        "resumed": {**ONEBIT, "kwargs": kw, "max_steps": 64, "resume": ["straight", 32]},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        straight, resumed = res["straight"]["params"], res["resumed"]["params"]
        for k in straight:
            torch.testing.assert_close(resumed[k], straight[k], atol=1e-6, rtol=0)
        assert len(res["resumed"]["trace"]) == 32
        assert res["resumed"]["stats"]["grad_quantized/calls"] == 32 * 2
    assert math.isfinite(results[0]["resumed"]["losses"][-1])
