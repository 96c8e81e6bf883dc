"""The plain-torch DiLoCo peer's outer step (``benchmarks/peers.py``) against numbers worked out by hand."""

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.testing import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from peers import DiLoCoOuter


class TwoFakeRanks:
    """An all-reduce mean between two threads, one per fake rank; keeps what each rank sent."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.sent: list[torch.Tensor | None] = [None, None]

    def all_reduce_mean(self, rank: int):
        def fn(t: torch.Tensor) -> torch.Tensor:
            self.sent[rank] = t.clone()
            self.barrier.wait(timeout=10)
            mean = (self.sent[0] + self.sent[1]) / 2
            self.barrier.wait(timeout=10)
            return mean

        return fn


def _sync(outers, params, local_updates):
    """Apply each rank's net inner update, then one outer step on both fake ranks at once."""
    for p, u in zip(params, local_updates, strict=True):
        p.add_(torch.tensor(u))
    ranks = TwoFakeRanks()
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(outers[r].step, [params[r]], ranks.all_reduce_mean(r)) for r in range(2)]
        for f in done:
            f.result()
    return ranks.sent


def test_two_outer_steps_match_the_hand_computed_nesterov_sgd():
    # Two ranks, one 2-element parameter, global start w0 = [1, 2]; outer SGD lr 0.7, momentum 0.9,
    # Nesterov (torch: buf = momentum * buf + g, starting at buf = g; w -= lr * (g + momentum * buf)).
    outers = [DiLoCoOuter([torch.tensor([1.0, 2.0])], lr=0.7, momentum=0.9) for _ in range(2)]
    params = [torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])]

    # Sync 1: local updates [-0.2, 0.4] and [-0.4, 0.0]; pseudo-gradients w0 - local = [0.2, -0.4]
    # and [0.4, 0.0], mean g1 = [0.3, -0.2]; buf = g1; step g1 + 0.9 g1 = [0.57, -0.38];
    # w1 = w0 - 0.7 * [0.57, -0.38] = [0.601, 2.266].
    sent = _sync(outers, params, [[-0.2, 0.4], [-0.4, 0.0]])
    assert_close(sent[0], torch.tensor([0.2, -0.4]))
    assert_close(sent[1], torch.tensor([0.4, 0.0]))
    for r in range(2):
        assert_close(outers[r].global_params[0], torch.tensor([0.601, 2.266]))
        assert_close(params[r], torch.tensor([0.601, 2.266]))  # every rank restarts from the global copy

    # Sync 2: local updates [0.1, 0.1] and [-0.3, 0.3]; pseudo-gradients [-0.1, -0.1] and [0.3, -0.3],
    # mean g2 = [0.1, -0.2]; buf = 0.9 [0.3, -0.2] + g2 = [0.37, -0.38]; step g2 + 0.9 buf =
    # [0.433, -0.542]; w2 = w1 - 0.7 * [0.433, -0.542] = [0.2979, 2.6454].
    sent = _sync(outers, params, [[0.1, 0.1], [-0.3, 0.3]])
    assert_close(sent[0], torch.tensor([-0.1, -0.1]))
    assert_close(sent[1], torch.tensor([0.3, -0.3]))
    for r in range(2):
        assert_close(outers[r].global_params[0], torch.tensor([0.2979, 2.6454]))
        assert_close(params[r], torch.tensor([0.2979, 2.6454]))
        assert outers[r].syncs == 2


def test_global_copy_is_fp32_on_cpu_and_local_keeps_its_dtype():
    local = torch.tensor([1.0, 2.0], dtype=torch.float64)
    outer = DiLoCoOuter([local])
    assert outer.global_params[0].dtype == torch.float32 and outer.global_params[0].device.type == "cpu"
    local.add_(1.0)
    outer.step([local], lambda t: t)  # one rank: the mean is its own pseudo-gradient
    assert local.dtype == torch.float64
    assert_close(local, outer.global_params[0].double())
