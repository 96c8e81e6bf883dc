"""The two-level all-reduce on 4 real ranks in 2 groups of 2: the flat average, the bytes of each
level, and error feedback on a quantized slow hop."""

from pathlib import Path

import pytest
import torch
from harness import ring_bytes, run_ranks

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "two_level_worker.py"
SIZES = [1000, 4097]  # one divisible by the group size, one not


def test_fp32_two_levels_equal_the_flat_average_and_charge_each_level():
    results = run_ranks({"group_size": 2, "sizes": SIZES}, 4, script=WORKER)
    for size in SIZES:
        outs = [res["sizes"][size]["outs"][0] for res in results]
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], atol=0, rtol=0)  # every rank the same
        # the flat ring's average, up to the order of the float sums
        torch.testing.assert_close(outs[0], results[0]["sizes"][size]["flat"], atol=1e-6, rtol=1e-6)
        chunk = -(-size // 2)  # each rank's share of the group's buffer
        # inside the group: a reduce-scatter and an all-gather of 2 chunks, each sending one chunk;
        # across the groups: a ring all-reduce of one chunk over 2 ranks
        inner = 2 * 1 * chunk * 4
        across = ring_bytes(chunk, 4, 2)
        for res in results:
            assert res["sizes"][size]["charged"]["two/bytes_sent"] == inner + across
    # a group's uplink: its 2 ranks each send `across`, against the flat ring's 2 (N - 1) / N of the buffer
    assert 2 * ring_bytes(-(-4097 // 2), 4, 2) < ring_bytes(4097, 4, 4)


@pytest.mark.slow  # 22 s; the strategies' two-level test below quantizes the slow hop too
def test_a_quantized_slow_hop_sends_less_and_its_error_does_not_accumulate():
    steps = 6
    fp32 = run_ranks({"group_size": 2, "sizes": [4096], "steps": 1}, 4, script=WORKER)
    results = run_ranks({"group_size": 2, "sizes": [4096], "slow_bits": 8, "steps": steps}, 4, script=WORKER)
    true = fp32[0]["sizes"][4096]["outs"][0]
    for res in results[1:]:
        for a, b in zip(res["sizes"][4096]["outs"], results[0]["sizes"][4096]["outs"], strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    outs = results[0]["sizes"][4096]["outs"]
    first = (outs[0] - true).norm() / true.norm()
    assert 0 < first < 0.05  # 8 bits: close, not exact
    # error feedback: what one call loses the next one sends, so the sum over calls stays as close
    # to the true sum as one call is to the true value (without it the gap would grow with the calls)
    drift = (torch.stack(outs).sum(0) - steps * true).norm() / true.norm()
    assert drift < 2 * first
    # the slow hop travels in 8 bits: its bytes are a quarter of fp32's and a bit (column scales)
    q = results[0]["sizes"][4096]["charged"]["slow_quantized/bytes_sent"] / steps
    assert ring_bytes(2048, 4, 2) / 4 <= q < ring_bytes(2048, 4, 2) / 3
    assert results[0]["state"]["residuals"]  # kept per call site, for checkpoints


@pytest.mark.slow  # 18 s: the quick suite's budget (the fp32 two-level average above stays quick)
def test_strategies_train_with_two_levels_as_with_one_and_resume_the_slow_hop_residuals():
    two = {"group_size": 2}
    q8 = {**two, "slow_hop_bits": 8}
    scenarios = {
        "flat": {"strategy": "allreduce", "devices": 4},
        "two": {"strategy": "allreduce", "devices": 4, "kwargs": two},
        "onebit_two": {"strategy": "onebit_sgd", "devices": 4, "kwargs": {**two, "num_quantization_bits": 32}},
        # 256 samples / (4 ranks x 4) = 16 steps an epoch: a checkpoint at the epoch's end, two epochs
        "q8": {"strategy": "allreduce", "devices": 4, "kwargs": q8, "ckpt_every": 16, "max_steps": 32},
        "q8_resumed": {"strategy": "allreduce", "devices": 4, "kwargs": q8, "resume": ["q8", 16], "max_steps": 32},
    }
    results = run_ranks({"scenarios": scenarios}, 4, timeout=400)
    for name in scenarios:
        for res in results[1:]:
            for key, value in res[name]["params"].items():
                torch.testing.assert_close(value, results[0][name]["params"][key], atol=0, rtol=0)
    res = results[0]
    for key, value in res["flat"]["params"].items():
        torch.testing.assert_close(res["two"]["params"][key], value, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(res["onebit_two"]["params"][key], value, atol=1e-6, rtol=1e-5)
        # the checkpoint held the slow hop's residuals: the resumed run lands where the whole one did
        torch.testing.assert_close(res["q8_resumed"]["params"][key], res["q8"]["params"][key], atol=0, rtol=0)
    assert res["q8"]["stats"]["slow_quantized/bytes_sent"] > 0
    assert "two_level" in res["q8"]["checkpoint"]["mine"]
