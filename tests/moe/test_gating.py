import pytest
import torch

from lightning_commstrats.moe import MoELayer, capacity, route, swipe_assign


def skewed_logits(tokens=64, experts=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 0] += 3.0  # the router loves expert 0
    return logits


def test_swipe_gives_every_expert_exactly_its_share_where_capacity_drops():
    logits = skewed_logits()
    swiped = route(logits, 1, "swipe")
    assert swiped.load.tolist() == [16, 16, 16, 16]
    assert swiped.load.max() == swiped.load.float().mean() and swiped.dropped == 0
    capped = route(logits, 1, "capacity", capacity_factor=1.0)
    assert capped.dropped > 0 and capped.load.max() == capacity(64, 4, 1, 1.0) == 16
    dropless = route(logits, 1, "aux")
    assert dropless.dropped == 0 and dropless.load.max() > 16


def test_swipe_keeps_first_choices_when_there_is_room_and_moves_the_least_keen():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    # expert 0 is wanted by three tokens but has room for two: the least keen (0.6) moves to expert 1
    assert swipe_assign(probs).tolist() == [0, 0, 1, 1]


def test_swipe_shares_differ_by_at_most_one():
    loads = torch.bincount(swipe_assign(torch.softmax(skewed_logits(tokens=10, experts=4), -1)), minlength=4)
    assert sorted(loads.tolist()) == [2, 2, 3, 3]


def test_top2_weights_sum_to_one():
    r = route(torch.randn(32, 4), 2, "aux")
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(32))


def test_aux_loss_by_hand_punishes_one_overloaded_expert():
    # E * sum_e f_e * P_e with softmax([ln 3, 0]) = [0.75, 0.25]
    keen0 = torch.tensor([3.0, 1.0]).log()
    keen1 = torch.tensor([1.0, 3.0]).log()
    balanced = route(torch.stack([keen0, keen0, keen1, keen1]), 1, "aux")
    assert balanced.load.tolist() == [2, 2]
    # f = [1/2, 1/2], P = [1/2, 1/2]: 2 * (1/4 + 1/4)
    assert balanced.aux_loss.item() == pytest.approx(1.0)
    crowded = route(torch.stack([keen0] * 4).requires_grad_(), 1, "aux")
    assert crowded.load.tolist() == [4, 0]
    # f = [1, 0], P = [3/4, 1/4]: 2 * (3/4)
    assert crowded.aux_loss.item() == pytest.approx(1.5)
    logits = torch.stack([keen0] * 4).requires_grad_()
    route(logits, 1, "aux").aux_loss.backward()
    assert (logits.grad[:, 0] > 0).all() and (logits.grad[:, 1] < 0).all()  # descent moves tokens off expert 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 5}, "top_k=5 must be between 1 and num_experts=4"),
        ({"capacity_factor": 0.0}, "capacity_factor must be > 0"),
        ({"balance": "swipe", "top_k": 2}, "balance='swipe' routes top-1"),
        ({"balance": "random"}, "balance='random' is not supported"),
    ],
)
def test_bad_layer_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoELayer(8, 16, 4, **kwargs)
