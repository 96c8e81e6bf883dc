import pytest
import torch

from lightning_commstrats.data import IGNORE_INDEX
from lightning_commstrats.models import ROLES, build_model, lm_loss

V = 50


def make(arch, **kw):
    args = dict(
        vocab_size=V,
        embed_dim=16,
        hidden_dim=16,
        num_layers=2,
        dropout=0.0,
        tie_weights=False,
        order=4,
        num_heads=4,
        ffn_dim=32,
        max_seq_len=12,
    )
    args.update(kw)
    return build_model(arch, **args)


@pytest.mark.parametrize("arch", ["lstm", "ffn", "transformer"])
def test_models_declare_vocabulary_and_roles(arch):
    m = make(arch)
    vocab = m.vocab_parameters()
    assert vocab["input_embedding"].shape == (V, 16) and vocab["output_weight"].shape == (V, 16)
    assert vocab["output_bias"].shape == (V,)
    roles = m.module_roles()
    assert set(roles) <= set(ROLES) and {"embedding", "output"} <= set(roles)
    named = dict(m.named_modules())
    assert all(name in named for names in roles.values() for name in names)
    tied = make(arch, tie_weights=True).vocab_parameters()
    assert tied["input_embedding"] is tied["output_weight"]


def test_transformer_roles_cover_attention_ffn_and_norms():
    roles = make("transformer").module_roles()
    assert roles["attention"] == ["blocks.0.attn", "blocks.1.attn"]
    assert roles["ffn"] == ["blocks.0.ffn", "blocks.1.ffn"]
    assert "norm" in roles["norm"]


@pytest.mark.parametrize("arch", ["lstm", "transformer"])
def test_padding_does_not_change_the_loss(arch):
    torch.manual_seed(0)
    m = make(arch).eval()
    x = torch.randint(0, V, (2, 12))
    y = torch.randint(0, V, (2, 12))
    short = lm_loss(m(x[:, :7]), y[:, :7])
    xp, yp = x.clone(), y.clone()
    xp[:, 7:] = 2  # pad id
    yp[:, 7:] = IGNORE_INDEX
    torch.testing.assert_close(lm_loss(m(xp), yp), short)


def test_transformer_is_causal():
    torch.manual_seed(0)
    m = make("transformer").eval()
    x = torch.randint(0, V, (1, 10))
    x2 = x.clone()
    x2[0, 6:] = (x2[0, 6:] + 1) % V
    torch.testing.assert_close(m(x)[:, :6], m(x2)[:, :6])


def test_ffn_takes_order_minus_one_words():
    m = make("ffn", order=4)
    assert m(torch.randint(0, V, (5, 3))).shape == (5, 1, V)
    with pytest.raises(ValueError, match="expected 3 context words, got 4"):
        m(torch.randint(0, V, (5, 4)))


@pytest.mark.parametrize(
    ("arch", "kw", "message"),
    [
        ("lstm", {"vocab_size": 1}, "vocab_size must be >= 2"),
        ("ffn", {"order": 1}, "order"),
        ("transformer", {"num_heads": 3}, "divisible by num_heads"),
        ("lstm", {"tie_weights": True, "embed_dim": 8}, "tie_weights needs"),
        ("gru", {}, "arch='gru' is not supported"),
    ],
)
def test_bad_model_settings(arch, kw, message):
    with pytest.raises(ValueError, match=message):
        make(arch, **kw)
