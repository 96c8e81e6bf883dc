"""The MoE layer's options in one process: shared expert, fine-grained experts, router initialisation."""

from pathlib import Path

import pytest
import torch
import yaml

from lightning_commstrats.models import LanguageModel
from lightning_commstrats.models.transformer import FeedForward
from lightning_commstrats.moe import MoELayer

REPO = Path(__file__).resolve().parents[2]


def test_shared_expert_is_a_dense_ffn_of_its_width_when_the_routed_experts_are_zero():
    torch.manual_seed(0)
    layer = MoELayer(8, 4, num_experts=4, top_k=2, shared_dim=16)
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.zero_()
    dense = FeedForward(8, 16, dropout=0.0)
    dense.load_state_dict(
        {
            "up.weight": layer.shared.up.weight,
            "up.bias": layer.shared.up.bias,
            "down.weight": layer.shared.down.weight,
            "down.bias": layer.shared.down.bias,
        }
    )
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(layer(x), dense(x))


def test_shared_expert_adds_to_the_routed_output():
    torch.manual_seed(0)
    with_shared = MoELayer(8, 4, num_experts=4, top_k=2, shared_dim=16)
    routed_only = MoELayer(8, 4, num_experts=4, top_k=2)
    routed_only.load_state_dict({k: v for k, v in with_shared.state_dict().items() if not k.startswith("shared.")})
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(with_shared(x), routed_only(x) + with_shared.shared(x))


@pytest.mark.parametrize(
    ("experts", "top_k", "expert_dim", "shared"),
    [(4, 1, None, 0), (8, 2, 32, 0), (4, 1, 32, 32), (8, 2, 16, 32)],
)
def test_every_token_goes_through_as_many_hidden_units_as_the_dense_ffn(experts, top_k, expert_dim, shared):
    """Active size: shared width + top_k x routed width = ffn_dim = 64 in every configuration."""
    model = LanguageModel(
        arch="transformer", vocab_size=50, hidden_dim=16, num_layers=2, ffn_dim=64, max_seq_len=8,
        num_experts=experts, top_k=top_k, expert_dim=expert_dim, shared_expert_dim=shared,
    )  # fmt: skip
    layers = model.net.moe_layers()
    assert len(layers) == 2
    for layer in layers:
        assert layer.active_dim == 64
        assert layer.experts.w1.shape == (experts, 16, expert_dim or 64)
        assert (layer.shared is None) == (shared == 0)
    model(torch.randint(0, 50, (3, 8)))
    routing = layers[0].routing
    # every token fills top_k slots (dropless), each slot runs one routed expert
    assert int(routing.kept.sum()) == 3 * 8 * top_k


def test_router_init_std_survives_the_transformer_initialisation():
    torch.manual_seed(0)
    default = LanguageModel(arch="transformer", hidden_dim=64, ffn_dim=64, num_experts=8, max_seq_len=8)
    small = LanguageModel(
        arch="transformer", hidden_dim=64, ffn_dim=64, num_experts=8, max_seq_len=8, router_init_std=1e-3
    )
    for layer in default.net.moe_layers():
        assert layer.router.weight.std().item() == pytest.approx(0.02, rel=0.1)
    for layer in small.net.moe_layers():
        assert layer.router.weight.std().item() == pytest.approx(1e-3, rel=0.1)
    # the standalone layer draws its router the same way
    assert MoELayer(64, 16, 8, router_init_std=0.5).router.weight.std().item() == pytest.approx(0.5, rel=0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expert_dim": 0}, "expert_dim must be >= 1"),
        ({"shared_expert_dim": -1}, "shared_expert_dim must be >= 0"),
        ({"router_init_std": 0.0}, "router_init_std must be > 0"),
    ],
)
def test_bad_moe_model_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LanguageModel(arch="transformer", hidden_dim=16, ffn_dim=32, num_experts=4, max_seq_len=8, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ffn_dim": 0}, "ffn_dim .* must be >= 1"),
        ({"shared_dim": -2}, "shared_dim must be >= 0"),
        ({"router_init_std": -1.0}, "router_init_std must be > 0"),
    ],
)
def test_bad_layer_options(kwargs, message):
    args = {"d_model": 8, "ffn_dim": 16, "num_experts": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        MoELayer(**args)


def test_moe_shared_config_has_the_active_size_of_its_dense_twin():
    """moe_shared.yaml is compared with the same config at num_experts=0: equal hidden units per token."""
    config = yaml.safe_load((REPO / "lightning_commstrats" / "configs" / "moe_shared.yaml").read_text())["model"]
    model = LanguageModel(**{**config, "vocab_size": 50, "max_seq_len": 8})
    layers = model.net.moe_layers()
    assert len(layers) == config["num_layers"] and layers[0].shared is not None
    assert all(layer.active_dim == config["ffn_dim"] for layer in layers)


def _experts_loop(experts, x, counts):
    """The experts one after the other, as ``Experts.forward`` ran them before it batched them."""
    outs = []
    for e, chunk in enumerate(x.split(counts)):
        h = torch.nn.functional.gelu(torch.addmm(experts.b1[e], chunk, experts.w1[e]))
        outs.append(torch.addmm(experts.b2[e], h, experts.w2[e]))
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("d", "f", "counts", "grouped"),
    [
        (8, 16, [5, 0, 11, 3], True),  # float32 rows of 16-byte multiples: torch's grouped GEMM
        (8, 16, [0, 0, 0, 0], True),  # no token at all
        (6, 10, [5, 0, 11, 3], False),  # rows that grouped_mm refuses: the padded bmm
        (6, 10, [0, 7, 0, 0], False),
        (6, 10, [0, 0, 0, 0], False),
    ],
)
def test_batched_experts_equal_the_loop_forward_and_backward(d, f, counts, grouped):
    from lightning_commstrats.moe.layer import Experts, grouped_mm_fits

    torch.manual_seed(0)
    experts = Experts(len(counts), d, f)
    with torch.no_grad():  # biases that are not zero, so that their gradients are checked too
        experts.b1.normal_()
        experts.b2.normal_()
    x = torch.randn(sum(counts), d, requires_grad=True)
    weight = torch.randn(sum(counts), d)
    assert grouped_mm_fits(x, experts.w1) == grouped
    y = experts(x, counts)
    (y * weight).sum().backward()
    grads = [x.grad, *(p.grad for p in experts.parameters())]
    assert all(g is not None for g in grads)  # every expert stays in the graph, also with no token
    x_ref = x.detach().clone().requires_grad_()
    for p in experts.parameters():
        p.grad = None
    y_ref = _experts_loop(experts, x_ref, counts)
    (y_ref * weight).sum().backward()
    tight = {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(y, y_ref, **tight)
    for got, want in zip(grads, [x_ref.grad, *(p.grad for p in experts.parameters())], strict=True):
        torch.testing.assert_close(got, want, **tight)
    for e, c in enumerate(counts):
        if c == 0:
            assert not experts.w1.grad[e].any() and not experts.b2.grad[e].any()


def test_batched_experts_take_a_gradient_that_is_not_contiguous():
    from lightning_commstrats.moe.layer import Experts

    experts = Experts(2, 8, 8)
    x = torch.randn(5, 8, requires_grad=True)
    experts(x, [2, 3]).sum().backward()  # sum's gradient is an expanded (stride 0) tensor
    torch.testing.assert_close(experts.b2.grad, torch.tensor([[2.0] * 8, [3.0] * 8]))


@pytest.mark.parametrize(("d", "f", "grouped"), [(8, 16, True), (6, 10, False)])
def test_batched_experts_follow_autocast_as_the_loop_did(d, f, grouped):
    from lightning_commstrats.moe.layer import Experts, grouped_mm_fits

    experts = Experts(3, d, f)
    x = torch.randn(7, d, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_mm_fits(x, experts.w1) == grouped
        y = experts(x, [3, 0, 4])
        y_ref = _experts_loop(experts, x, [3, 0, 4])
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    y.float().sum().backward()
    assert experts.w1.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_batched_experts_in_half_parameters_as_a_precision_policy_casts_them():
    from lightning_commstrats.moe.layer import Experts

    experts = Experts(3, 8, 16).to(torch.bfloat16)
    x = torch.randn(7, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(experts(x, [2, 5, 0]), _experts_loop(experts, x, [2, 5, 0]), atol=1e-2, rtol=1e-2)
