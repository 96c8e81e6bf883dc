"""The parameter server's pieces without ranks: a shard's rounds and updates, CNTK's adjustment
factor, the shard layout, argument checks."""

import pytest
import torch

from lightning_commstrats.strategies.parameter_server import (
    ParameterServerStrategy,
    ServerShard,
    adjust_factor,
    shard_bounds,
)


def test_a_sync_round_averages_in_rank_order_whatever_the_arrival_order():
    grads = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 10 ** (r - 1) for r in range(3)]
    results = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        shard = ServerShard(0, 0, 1000, 3)
        futures = {r: shard.push_gradients(r, grads[r]) for r in order}
        assert all(f.done() for f in futures.values()) and shard.version == 1
        values = [futures[r].wait() for r in range(3)]
        assert all(torch.equal(v, values[0]) for v in values)  # every worker gets the same average
        results.append(values[0])
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])  # bit for bit
    torch.testing.assert_close(results[0], (grads[0].double() + grads[1] + grads[2]).float() / 3)


def test_a_round_waits_for_every_worker_and_refuses_a_second_push():
    shard = ServerShard(1, 10, 20, 2)
    first = shard.push_gradients(0, torch.ones(10))
    assert not first.done()
    with pytest.raises(RuntimeError, match="rank 0 pushed twice to shard 1"):
        shard.push_gradients(0, torch.ones(10))
    with pytest.raises(ValueError, match="shard 1 holds 10 values; rank 1 sent shape"):
        shard.push_gradients(1, torch.ones(11))
    shard.push_gradients(1, torch.full((10,), 3.0))
    assert torch.equal(first.wait(), torch.full((10,), 2.0))


def test_async_pushes_add_to_the_weights_at_once():
    shard = ServerShard(0, 0, 4, 2)
    with pytest.raises(RuntimeError, match="no weights yet"):
        shard.push_delta(0, torch.ones(4))
    shard.seed(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    after = shard.push_delta(1, torch.tensor([0.5, 0.0, -1.0, 0.0]))
    assert torch.equal(after, torch.tensor([1.5, 2.0, 2.0, 4.0]))
    after[0] = 100.0  # a reply is a copy
    assert torch.equal(shard.pull(), torch.tensor([1.5, 2.0, 2.0, 4.0]))
    assert shard.version == 1
    state = shard.state_dict()
    other = ServerShard(0, 0, 4, 2)
    other.load_state_dict(state)
    assert other.version == 1
    with pytest.raises(ValueError, match=r"shard 0 was \[0, 4\) and is \[0, 5\)"):
        ServerShard(0, 0, 5, 2).load_state_dict(state)


def test_cntk_adjustment_factor():
    # linear: from the coefficient to 1 over the period's syncs, then 1
    assert [adjust_factor("linear", 0.2, 10, k) for k in (0, 5, 10, 20)] == pytest.approx([0.2, 0.6, 1.0, 1.0])
    # staircase: the coefficient times the stair's number, up to 1
    assert [adjust_factor("staircase", 0.2, 10, k) for k in (0, 9, 10, 19, 20, 40, 99)] == pytest.approx(
        [0.2, 0.2, 0.4, 0.4, 0.6, 1.0, 1.0]
    )
    assert adjust_factor("none", 0.2, 10, 0) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "async", "pipeline": True, "pipeline_start": "cntk"}, "pipeline_start='cntk' is not supported"),
        ({"mode": "async", "pipeline_start": "pulled"}, "pipeline_start='pulled' applies to pipeline=True"),
        ({"pipeline_start": "pulled"}, "pipeline_start='pulled' applies to pipeline=True"),
    ],
)
def test_bad_pipeline_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParameterServerStrategy(**kwargs)


def test_shards_are_contiguous_and_balanced():
    assert shard_bounds(562, 3) == [(0, 187), (187, 374), (374, 562)]
    assert shard_bounds(5, 5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    with pytest.raises(ValueError, match="cannot cut 4 parameter values into 5 non-empty shards"):
        shard_bounds(4, 5)
