"""Auxiliary-loss-free balancing (``balance="bias"``): the bias rule, its control loop, where the
Trainer runs it, and what strategies and checkpoints do with the bias."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_commstrats import AllReduceStrategy, ExpertParallelStrategy
from lightning_commstrats.models import LanguageModel
from lightning_commstrats.moe import MoELayer, update_expert_biases
from lightning_commstrats.moe.gating import balancing_bias, balancing_shift


def skewed_layer(rate=1e-3, top_k=1, experts=4, d=16, rule="sign"):
    torch.manual_seed(0)
    layer = MoELayer(
        d, 8, experts, top_k=top_k, balance="bias", bias_update_rate=rate, bias_update_rule=rule, router_init_std=0.3
    )
    with torch.no_grad():
        layer.router.weight[0, 0] += 0.5  # the router loves expert 0 (tokens have feature 0 at 2)
    return layer


def tokens(*shape, d=16):
    x = torch.randn(*shape, d)
    x[..., 0] = 2.0
    return x


def balance(load):
    load = load.float()
    return (load.max() / load.mean()).item()


def test_the_sign_rule_by_hand():
    layer = MoELayer(8, 8, 4, balance="bias", bias_update_rate=0.01)
    layer.update_bias(torch.tensor([5, 1, 2, 0]))  # mean 2: over, under, even, under
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.01]))
    layer.update_bias(torch.tensor([5, 1, 2, 0]))
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-0.02, 0.02, 0.0, 0.02]))


def test_the_load_counts_training_forwards_since_the_last_update():
    layer = skewed_layer()
    x = tokens(3, 10)
    layer(x)
    first = layer.routing.load.clone()
    layer(x)
    torch.testing.assert_close(layer.load_since_update(), 2 * first)
    layer.eval()
    layer(tokens(2, 10))  # evaluation does not move the bias
    torch.testing.assert_close(layer.load_since_update(), 2 * first)
    layer.update_bias()
    assert not layer.load_since_update().any()
    assert torch.equal(torch.sign(layer.expert_bias), torch.sign(2 * first.float().mean() - 2 * first))


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_bias_balances_a_skewed_router_and_leaves_the_weights_alone(top_k):
    layer = skewed_layer(rate=2e-3, top_k=top_k)
    x = tokens(4, 64)
    layer(x)
    assert balance(layer.routing.load) > 1.3  # top-2 cannot exceed 2: a token takes an expert once
    for _ in range(300):
        layer(x)
        layer.update_bias()
    layer(x)
    assert balance(layer.routing.load) <= 1.1 and layer.routing.dropped == 0
    assert layer.expert_bias[0] < 0  # the favourite was pushed down
    probs = torch.softmax(layer.router(x.reshape(-1, 16)), -1)
    chosen = probs.gather(1, layer.routing.experts)
    torch.testing.assert_close(layer.routing.weights, chosen / chosen.sum(-1, keepdim=True) if top_k > 1 else chosen)


def test_without_updates_nothing_balances():
    layer = skewed_layer(rate=0.0)
    x = tokens(4, 64)
    for _ in range(20):
        layer(x)
        layer.update_bias()
    assert balance(layer.routing.load) > 1.5 and not layer.expert_bias.any()


def test_one_collective_sums_every_layers_load_over_the_ranks():
    model = torch.nn.Sequential(skewed_layer(rate=0.01), MoELayer(16, 8, 4), skewed_layer(rate=0.01))
    x = tokens(2, 8)
    model(x)
    calls = []

    def other_ranks_load_the_other_experts(load):  # stands in for an all-reduce over two ranks
        calls.append(load.clone())
        return load + torch.tensor([0, 100, 100, 100])

    update_expert_biases(model, other_ranks_load_the_other_experts)
    assert len(calls) == 1 and calls[0].shape == (2, 4) and calls[0].dtype == torch.int64
    for layer, load in zip((model[0], model[2]), calls[0], strict=True):
        total = load + torch.tensor([0, 100, 100, 100])
        torch.testing.assert_close(layer.expert_bias, 0.01 * torch.sign(total.float().mean() - total))
    assert "expert_bias" not in dict(model[1].named_buffers())


def test_the_bias_is_a_buffer_in_the_state_dict_for_bias_balancing_only():
    assert "expert_bias" in MoELayer(8, 8, 4, balance="bias").state_dict()
    assert "expert_bias" not in MoELayer(8, 8, 4).state_dict()
    with pytest.raises(ValueError, match="update_bias needs balance='bias'"):
        MoELayer(8, 8, 4).update_bias(torch.zeros(4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bias_update_rate": -1e-3}, "bias_update_rate must be a finite number >= 0, got -0.001"),
        ({"bias_update_rate": float("inf")}, "bias_update_rate must be a finite number >= 0"),
        ({"bias_update_rate": "fast"}, "bias_update_rate must be a finite number >= 0, got 'fast'"),
    ],
)
def test_bad_bias_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoELayer(8, 16, 4, balance="bias", **kwargs)


def tiny_lm(**kwargs):
    torch.manual_seed(0)
    args = {
        "arch": "transformer", "vocab_size": 40, "hidden_dim": 16, "num_heads": 2, "num_layers": 2,
        "ffn_dim": 16, "max_seq_len": 8, "num_experts": 4, "moe_every": 2, "balance": "bias",
        "bias_update_rate": 0.01, "optimizer": "sgd", "lr": 0.1, **kwargs,
    }  # fmt: skip
    return LanguageModel(**args)


def test_aux_loss_weight_defaults_to_zero_with_bias_balancing_only():
    assert tiny_lm().aux_loss_weight == 0.0
    assert tiny_lm(balance="aux").aux_loss_weight == 0.01
    assert tiny_lm(aux_loss_weight=1e-4).aux_loss_weight == 1e-4  # DeepSeek-V3 keeps a tiny one
    with pytest.raises(ValueError, match="aux_loss_weight must be a finite number >= 0"):
        tiny_lm(aux_loss_weight=-0.01)


def test_the_trainer_updates_once_per_optimizer_step_from_the_accumulated_load(monkeypatch):
    model = tiny_lm()
    layer = model.net.moe_layers()[0]
    forwards, updates = [], []
    real_forward, real_update = MoELayer.forward, MoELayer.update_bias

    def forward(self, x):
        out = real_forward(self, x)
        if self.training:
            forwards.append(self.routing.load.clone())
        return out

    def update_bias(self, load=None):
        updates.append(load.clone())
        real_update(self, load)

    monkeypatch.setattr(MoELayer, "forward", forward)
    monkeypatch.setattr(MoELayer, "update_bias", update_bias)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 40, (12, 9), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=data)
    assert len(forwards) == 6 and len(updates) == 3  # two micro-batches per optimizer step
    for step, load in enumerate(updates):
        torch.testing.assert_close(load, forwards[2 * step] + forwards[2 * step + 1])
    expected = sum(0.01 * torch.sign(load.float().mean() - load) for load in updates)
    torch.testing.assert_close(layer.expert_bias, expected)
    assert "net.blocks.1.ffn.expert_bias" in model.state_dict()


@pytest.mark.parametrize("strategy", [AllReduceStrategy, ExpertParallelStrategy])
def test_strategies_leave_the_agreed_bias_out_of_the_buffer_averaging(strategy):
    model = tiny_lm()
    model.register_buffer("running", torch.zeros(3))  # a buffer the ranks do average
    scheme = strategy()
    scheme.connect(model)
    synced = {id(b) for b in scheme.buffers_to_sync()}
    assert id(model.running) in synced
    assert id(model.net.moe_layers()[0].expert_bias) not in synced


def test_the_default_rule_and_rates():
    layer = MoELayer(8, 8, 4, balance="bias")
    assert (layer.bias_update_rule, layer.bias_update_rate) == ("sign", 1e-3)
    assert MoELayer(8, 8, 4, balance="bias", bias_update_rule="quantile").bias_update_rate == 1.0
    assert MoELayer(8, 8, 4, balance="bias", bias_update_rule="quantile", bias_update_rate=0.2).bias_update_rate == 0.2


def steps_to_balance(layer, x, limit=300):
    for step in range(limit):
        layer(x)
        if balance(layer.routing.load) <= 1.1:
            return step
        layer.update_bias()
    return limit


def settled_balance(layer, x, steps=30):
    """The mean max/mean load over ``steps`` more updates."""
    ratios = []
    for _ in range(steps):
        layer(x)
        ratios.append(balance(layer.routing.load))
        layer.update_bias()
    return sum(ratios) / steps


def test_the_quantile_rule_undoes_a_collapsed_router_fast_and_settles():
    slow = skewed_layer(rate=2e-3)
    x = tokens(4, 64)
    with torch.no_grad():  # a collapsed router: nearly every token to expert 0
        slow.router.weight[0, 0] += 1.5
    slow(x)
    assert balance(slow.routing.load) > 3

    def copy(**kwargs):
        layer = MoELayer(16, 8, 4, balance="bias", **kwargs)
        layer.load_state_dict(slow.state_dict(), strict=False)  # a quantile layer has its gain on top
        return layer

    quantile, fast_sign = copy(bias_update_rule="quantile"), copy(bias_update_rate=0.05)
    assert steps_to_balance(quantile, x) <= 8 < steps_to_balance(slow, x) / 10  # here 4 steps against 229
    # and it stays there, where the sign rule fast enough to get there soon circles the balance
    assert settled_balance(quantile, x) < 1.03
    steps_to_balance(fast_sign, x)
    assert settled_balance(fast_sign, x) > 1.3


def test_bad_bias_update_rule():
    with pytest.raises(
        ValueError,
        match=r"bias_update_rule='linear' is not supported; choose one of \('sign', 'quantile'\)",
    ):
        MoELayer(8, 16, 4, balance="bias", bias_update_rule="linear")


def test_the_balancing_shift_by_hand():
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    experts = scores.argmax(1, keepdim=True)  # loads 3 and 1, mean 2
    shift = balancing_shift(scores, experts)
    # expert 0 gives up its token of smallest margin (0.2; next 0.6), expert 1 takes the closest (gap 0.2; next 0.6)
    torch.testing.assert_close(shift, torch.tensor([-0.4, 0.4]))
    for e in range(2):
        moved = scores.clone()
        moved[:, e] += shift[e]
        assert torch.bincount(moved.argmax(1), minlength=2).tolist() == [2, 2]
    assert not balancing_shift(scores[2:], scores[2:].argmax(1, keepdim=True)).any()  # already even


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_balancing_shift_brings_every_expert_alone_to_the_mean(top_k):
    torch.manual_seed(0)
    scores = torch.softmax(torch.randn(1000, 4) + torch.tensor([1.0, 0, 0, 0]), -1)
    shift = balancing_shift(scores, scores.topk(top_k, -1).indices)
    assert shift[0] < 0 and (shift[1:] > 0).all()
    for e in range(4):
        moved = scores.clone()
        moved[:, e] += shift[e]
        load = torch.bincount(moved.topk(top_k, -1).indices.reshape(-1), minlength=4)
        assert load[e] == 250 * top_k


def test_the_quantile_rule_by_hand_and_over_ranks():
    model = torch.nn.Sequential(skewed_layer(0.5, rule="quantile"), skewed_layer(0.5, rule="quantile"))
    x = tokens(2, 8)
    for layer in model:
        layer(x)
    shifts = [balancing_bias(torch.softmax(m.router(x.reshape(-1, 16)), -1), torch.zeros(4), 1) for m in model]
    calls = []

    def a_second_rank_with_the_same_tokens(both):
        calls.append(both.clone())
        return 2 * both

    update_expert_biases(model, a_second_rank_with_the_same_tokens)
    assert len(calls) == 1 and calls[0].shape == (2, 2, 4) and calls[0].dtype == torch.float64
    for layer, shift in zip(model, shifts, strict=True):
        # the first update takes the gain it starts with, the rate: 2 x 16 tokens x shift / (2 x 16 tokens)
        torch.testing.assert_close(layer.expert_bias, 0.5 * shift)
        assert not layer.shift_since_update().any() and not layer.load_since_update().any()


def test_the_quantile_rule_takes_at_most_the_whole_shift():
    with pytest.raises(ValueError, match=r"bias_update_rate must be in \[0, 1\] with bias_update_rule='quantile'"):
        MoELayer(8, 16, 4, balance="bias", bias_update_rule="quantile", bias_update_rate=2.0)
    assert MoELayer(8, 16, 4, balance="bias", bias_update_rule="quantile", bias_update_rate=1.0)


def test_the_quantile_rule_scores_the_last_tokens_with_the_router_after_the_step():
    layer = skewed_layer(rate=0.5, rule="quantile")
    x = tokens(2, 32)
    layer(x)
    stale = layer.routing.load
    with torch.no_grad():  # the optimizer step: the router now loves expert 1 instead
        layer.router.weight[[0, 1]] = layer.router.weight[[1, 0]]
    scores = torch.softmax(layer.router(x.reshape(-1, 16)), -1)
    fresh = balancing_bias(scores, torch.zeros(4), 1)
    layer.update_bias()
    torch.testing.assert_close(layer.expert_bias, 0.5 * fresh)
    assert fresh[1] < 0 and stale.argmax() == 0  # the step moved the favourite: the old scores would push expert 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_joint_balancing_bias_lands_every_expert_on_the_mean(top_k):
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(1120, 4) + torch.tensor([1.0, 0.3, 0.0, -0.5]), -1)
    bias = torch.tensor([0.01, 0.0, -0.02, 0.0])
    change = balancing_bias(probs, bias, top_k)
    load = torch.bincount((probs + bias + change).topk(top_k, -1).indices.reshape(-1), minlength=4)
    assert (load - 280 * top_k).abs().max() <= 1, load
    # every expert's lone shift taken whole at once overshoots: why the rounds take half of it
    scores = probs + bias
    whole = balancing_shift(scores, scores.topk(top_k, -1).indices)
    overshot = torch.bincount((scores + whole).topk(top_k, -1).indices.reshape(-1), minlength=4)
    assert (overshot - 280 * top_k).abs().max() > 50, overshot


def test_the_quantile_gain_grows_while_the_steps_agree_and_shrinks_when_they_turn_back():
    layer = MoELayer(8, 8, 4, balance="bias", bias_update_rule="quantile", bias_update_rate=0.8)
    load = torch.full((4,), 10)  # 40 tokens, top-1
    up, down = torch.tensor([1.0, -1.0, 0.0, 0.0]), torch.tensor([-1.0, 1.0, 0.0, 0.0])
    expected_bias = torch.zeros(4)
    # (step, gain after the update): it starts at the rate; agreeing steps grow it by 1.25x up to
    # the rate, opposed ones shrink it by 0.8x down to 5% of the rate
    script = [(up, 0.8), (up, 0.8), (down, 0.64), (up, 0.512), (up, 0.64), (up, 0.8), (up, 0.8)]
    gain = 0.8
    for i in range(20):  # turning back every time: 0.8x a turn, down to the floor, 0.04
        gain = max(0.04, gain * 0.8)
        script.append((down if i % 2 == 0 else up, gain))
    for step, gain in script:
        layer.update_bias(load, step * 40)
        assert float(layer.bias_gain) == pytest.approx(gain)
        expected_bias += gain * step
        torch.testing.assert_close(layer.expert_bias, expected_bias)
    assert gain == pytest.approx(0.04)  # the script reached the floor
    layer.update_bias(torch.zeros(4), torch.zeros(4))  # no tokens: no step, the gain kept
    assert float(layer.bias_gain) == pytest.approx(0.04)
    torch.testing.assert_close(layer.expert_bias, expected_bias)
    # the gain and the last step are checkpointed, and strategies leave them out of averaging
    kept = {"bias_gain", "bias_last_step"}
    assert kept <= set(layer.state_dict()) and kept <= set(layer.agreed_buffers)
    assert "bias_gain" not in MoELayer(8, 8, 4, balance="bias").state_dict()
