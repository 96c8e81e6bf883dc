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


def _swipe_reference(probs):
    """The round-by-round SWIPE this package had before it ran without host round trips: each round
    gathers the waiting tokens with ``nonzero`` and works on them alone."""
    t, e = probs.shape
    share = torch.full((e,), t // e, dtype=torch.long)
    share[: t % e] += 1
    order = probs.argsort(dim=-1, descending=True)
    assigned = torch.full((t,), -1, dtype=torch.long)
    room = share.clone()
    for r in range(e):
        waiting = (assigned < 0).nonzero().squeeze(1)
        if waiting.numel() == 0:
            break
        choice = order[waiting, r]
        score = probs[waiting, choice]
        by_score = torch.argsort(score, descending=True, stable=True)
        by_expert = torch.argsort(choice[by_score], stable=True)
        ranked = by_score[by_expert]
        chosen = choice[ranked]
        starts = torch.searchsorted(chosen, torch.arange(e))
        rank_in_expert = torch.arange(ranked.numel()) - starts[chosen]
        accept = rank_in_expert < room[chosen]
        assigned[waiting[ranked[accept]]] = chosen[accept]
        room -= torch.bincount(chosen[accept], minlength=e)
    return assigned


def test_swipe_equals_the_round_by_round_reference_on_random_inputs_with_ties():
    g = torch.Generator().manual_seed(0)
    remainders = set()
    for i in range(600):
        t = int(torch.randint(1, 70, (1,), generator=g))
        e = int(torch.randint(1, 9, (1,), generator=g))
        logits = torch.randn(t, e, generator=g) * float(4 * torch.rand(1, generator=g))
        logits[:, 0] += float(3 * torch.rand(1, generator=g))  # skewed towards expert 0
        probs = logits.softmax(-1)
        if i % 3 < 2:  # coarse scores: many ties within an expert's askers and within a token's preferences
            levels = 4 if i % 3 == 0 else 20
            probs = (probs * levels).round() / levels
        assigned = swipe_assign(probs)
        assert torch.equal(assigned, _swipe_reference(probs)), (t, e)
        share = torch.full((e,), t // e)
        share[: t % e] += 1
        assert torch.equal(torch.bincount(assigned, minlength=e), share)
        remainders.add(t % e != 0)
    assert remainders == {True, False}


def test_swipe_runs_without_host_round_trips():
    """Dynamo traces the whole function into one graph only if no shape depends on the data and
    nothing is read back to the host (``nonzero``, ``.item()``, a boolean mask)."""
    probs = torch.softmax(skewed_logits(tokens=24, experts=4), -1)
    traced = torch.compile(swipe_assign, fullgraph=True, backend="eager", dynamic=False)
    assert torch.equal(traced(probs), _swipe_reference(probs))
    with pytest.raises(Exception, match="data-dependent"):
        torch.compile(_swipe_reference, fullgraph=True, backend="eager", dynamic=False)(probs)


def test_bias_chooses_the_experts_and_the_unbiased_probabilities_weigh_them():
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.1, 0.4]])
    logits = probs.log()
    plain = route(logits, 1, "bias", bias=torch.zeros(3))
    assert plain.experts[:, 0].tolist() == [0, 0] and plain.dropped == 0
    bias = torch.tensor([-0.2, 0.0, 0.15])  # biased scores: [0.4, 0.3, 0.25], [0.3, 0.1, 0.55]
    top1 = route(logits, 1, "bias", bias=bias)
    assert top1.experts[:, 0].tolist() == [0, 2] and top1.load.tolist() == [1, 0, 1]
    torch.testing.assert_close(top1.weights[:, 0], torch.tensor([0.6, 0.4]))  # not 0.4 and 0.55
    top2 = route(logits, 2, "bias", bias=torch.tensor([-0.25, 0.0, 0.0]))  # [0.35, 0.3, 0.1], [0.25, 0.1, 0.4]
    assert top2.experts.tolist() == [[0, 1], [2, 0]]
    torch.testing.assert_close(top2.weights, torch.tensor([[0.6 / 0.9, 0.3 / 0.9], [0.4 / 0.9, 0.5 / 0.9]]))
    assert top2.kept.all() and top2.load.tolist() == [2, 1, 1]
    # the auxiliary loss is still reported (of the unbiased first choices), for comparison
    torch.testing.assert_close(top1.aux_loss, route(logits, 1, "aux").aux_loss)


@pytest.mark.parametrize(
    ("balance", "bias", "message"),
    [
        ("bias", None, "a bias goes with balance='bias' and only with it"),
        ("aux", torch.zeros(3), "a bias goes with balance='bias' and only with it"),
        ("bias", torch.zeros(4), r"bias must have shape \(3,\)"),
    ],
)
def test_bias_and_balance_must_agree(balance, bias, message):
    with pytest.raises(ValueError, match=message):
        route(torch.randn(5, 3), 1, balance, bias=bias)
