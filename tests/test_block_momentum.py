"""The BMUF update rule against numbers worked out by hand."""

import math

import pytest
import torch

from lightning_commstrats.block_momentum import (
    BlockMomentumFilter,
    block_momentum_from_time_constant,
    time_constant_from_block_momentum,
)


def test_two_blocks_with_momentum_and_nesterov_by_hand():
    f = BlockMomentumFilter(block_momentum=0.5, block_lr=1.0, nesterov=True)
    f.start(torch.tensor([1.0, 2.0]))
    # block 1 started at w_start = [1, 2]; the workers' average is [0.6, 2.4]
    #   G = [-0.4, 0.4]; delta = [-0.4, 0.4]; w_global = [0.6, 2.4]; next start = w_global + 0.5 delta = [0.4, 2.6]
    start = f.update(torch.tensor([0.6, 2.4]))
    torch.testing.assert_close(f.delta, torch.tensor([-0.4, 0.4]))
    torch.testing.assert_close(f.w_global, torch.tensor([0.6, 2.4]))
    torch.testing.assert_close(start, torch.tensor([0.4, 2.6]))
    # block 2 started at [0.4, 2.6]; average [0.3, 2.5]
    #   G = [-0.1, -0.1]; delta = 0.5 [-0.4, 0.4] + G = [-0.3, 0.1]; w_global = [0.3, 2.5]
    #   next start = [0.3 - 0.15, 2.5 + 0.05] = [0.15, 2.55]
    start = f.update(torch.tensor([0.3, 2.5]))
    torch.testing.assert_close(f.delta, torch.tensor([-0.3, 0.1]))
    torch.testing.assert_close(f.w_global, torch.tensor([0.3, 2.5]))
    torch.testing.assert_close(start, torch.tensor([0.15, 2.55]))
    assert f.blocks == 2


def test_two_blocks_classical_momentum_and_block_learning_rate_by_hand():
    f = BlockMomentumFilter(block_momentum=0.5, block_lr=0.5, nesterov=False)
    f.start(torch.tensor([1.0]))
    # G = -1; delta = 0.5 * -1 = -0.5; w_global = 0.5; start = 0.5
    torch.testing.assert_close(f.update(torch.tensor([0.0])), torch.tensor([0.5]))
    # G = 1.5 - 0.5 = 1; delta = 0.5 * -0.5 + 0.5 * 1 = 0.25; w_global = 0.75
    torch.testing.assert_close(f.update(torch.tensor([1.5])), torch.tensor([0.75]))
    torch.testing.assert_close(f.delta, torch.tensor([0.25]))


def test_no_momentum_unit_rate_is_model_averaging():
    f = BlockMomentumFilter(block_momentum=0.0, block_lr=1.0, nesterov=False)
    f.start(torch.randn(100))
    for _ in range(3):
        avg = torch.randn(100)
        torch.testing.assert_close(f.update(avg), avg)


def test_time_constant_round_trip():
    bm = block_momentum_from_time_constant(time_constant=1000.0, sync_period=100)
    assert bm == pytest.approx(math.exp(-0.1))
    assert time_constant_from_block_momentum(bm, 100) == pytest.approx(1000.0)
    assert time_constant_from_block_momentum(0.0, 100) == 0.0


def test_bad_filter_arguments():
    with pytest.raises(ValueError, match="block_momentum must be in"):
        BlockMomentumFilter(1.0)
    with pytest.raises(ValueError, match="block_learning_rate must be > 0"):
        BlockMomentumFilter(0.5, block_lr=0.0)
    with pytest.raises(ValueError, match="block_momentum_as_time_constant must be > 0"):
        block_momentum_from_time_constant(0.0, 10)
