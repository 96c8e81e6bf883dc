"""Per-module dtype policies: resolution by role and name, and the casts the hooks make."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_commstrats.models import build_model
from lightning_commstrats.precision import apply_policy, preset_rules, resolve
from lightning_commstrats.precision.policy import cast_floats, dtype_name, remove_policy


def transformer(**moe):
    return build_model("transformer", 40, 16, 16, 2, 0.0, True, 3, 2, 32, 8, moe=moe)


def record_dtypes(model):
    """Leaf module name -> (input dtype, its first parameter's dtype inside forward, output dtype)."""
    seen = {}

    def before(module, args, name):
        x = next((a for a in args if torch.is_tensor(a)), None)
        p = next(iter(module._parameters.values()), None)
        seen[name] = (x.dtype if x is not None else None, p.dtype if p is not None else None)

    def after(module, args, output, name):
        out = output[0] if isinstance(output, tuple) else output
        seen[name] = (*seen[name], out.dtype)

    for name, module in model.named_modules():
        if name and not list(module.children()):
            # registered after the policy's pre-hook: sees the inputs and weights forward computes with
            module.register_forward_pre_hook(lambda m, a, name=name: before(m, a, name))
            module.register_forward_hook(lambda m, a, o, name=name: after(m, a, o, name), prepend=True)
    return seen


def test_dtype_names_and_aliases():
    assert dtype_name("bfloat16") == "bf16" and dtype_name(torch.float16) == "fp16" and dtype_name("FP32") == "fp32"
    with pytest.raises(ValueError, match="dtype='int8'"):
        dtype_name("int8")


def test_layered_resolution_by_role_and_inheritance():
    model = transformer(num_experts=4, moe_every=2)
    default, rules = preset_rules("layered", "bf16")
    dtypes = resolve(model, default, rules)
    assert dtypes[""] == "fp32" and dtypes["embedding"] == "fp32" and dtypes["output"] == "fp32"
    assert dtypes["blocks.0.attn"] == dtypes["blocks.0.attn.qkv"] == "bf16"  # children inherit
    assert dtypes["blocks.0.ffn.up"] == "bf16" and dtypes["blocks.1.ffn.experts"] == "bf16"
    assert dtypes["blocks.1.ffn.router"] == "fp32" and dtypes["blocks.0.norm1"] == "fp32"
    o2 = resolve(model, *preset_rules("O2", "fp16"))
    assert o2["embedding"] == o2["blocks.0.attn.qkv"] == o2["output"] == "fp16"
    assert o2["blocks.0.norm2"] == o2["norm"] == o2["blocks.1.ffn.router"] == "fp32"


def test_name_patterns_win_over_roles_and_unknown_names_fail():
    model = transformer()
    default, rules = preset_rules("layered", "bf16")
    dtypes = resolve(model, default, {**rules, "blocks.0.*": "fp32", "output": "bf16"})
    assert dtypes["blocks.0.attn.qkv"] == "fp32" and dtypes["blocks.1.attn.qkv"] == "bf16"
    assert dtypes["output"] == "bf16"  # a role key: the output role's rule replaced
    with pytest.raises(ValueError, match=r"\['blocks.7.attn'\].*Roles are"):
        resolve(model, default, {**rules, "blocks.7.attn": "fp32"})
    with pytest.raises(ValueError, match="atention"):
        resolve(model, default, {**rules, "atention": "bf16"})


def test_layered_forward_computes_in_half_and_keeps_fp32_masters():
    torch.manual_seed(0)
    model = transformer(num_experts=2, moe_every=2)
    apply_policy(model, resolve(model, *preset_rules("layered", "bf16")))
    seen = record_dtypes(model)
    tokens = torch.randint(0, 40, (3, 8))
    logits = model(tokens)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert seen["blocks.0.attn.qkv"] == (bf16, bf16, bf16) and seen["blocks.0.ffn.down"] == (bf16, bf16, bf16)
    assert seen["blocks.1.ffn.experts"] == (bf16, bf16, bf16)
    assert seen["blocks.0.norm2"] == (fp32, fp32, fp32) and seen["norm"] == (fp32, fp32, fp32)
    assert seen["embedding"][1:] == (fp32, fp32) and seen["output"] == (fp32, fp32, fp32)
    assert logits.dtype == fp32
    assert model.blocks[1].ffn.dispatch_dtype == bf16  # tokens travel to the experts in bf16
    logits.logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():  # the optimizer sees float32 parameters and gradients
        assert isinstance(p, nn.Parameter) and p.dtype == fp32 and p.grad.dtype == fp32, name


def test_half_module_equals_a_half_reference_and_gradients_reach_the_masters():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    apply_policy(lin, {"": "bf16"})
    x = torch.randn(5, 8, requires_grad=True)
    y = lin(x)
    ref_w = lin.weight.detach().clone().requires_grad_()
    ref_b = lin.bias.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    ref = F.linear(ref_x.bfloat16(), ref_w.bfloat16(), ref_b.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    y.float().square().sum().backward()
    ref.float().square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref_w.grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)
    assert isinstance(lin.weight, nn.Parameter) and lin.weight.dtype == torch.float32


def test_lstm_recurrent_layer_in_half_by_policy():
    torch.manual_seed(0)
    model = build_model("lstm", 40, 16, 16, 1, 0.0, True, 3, 2, 32, 8)
    default, rules = preset_rules("layered", "bf16")
    apply_policy(model, resolve(model, default, {**rules, "recurrent": "bf16"}))
    seen = record_dtypes(model)
    out = model(torch.randint(0, 40, (2, 6)))
    recurrent = model.module_roles()["recurrent"][0]
    assert seen[recurrent] == (torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert all(p.dtype == torch.float32 and p.grad is not None for p in model.parameters())
    assert all(w.dtype == torch.float32 for w in dict(model.named_modules())[recurrent]._flat_weights)


def test_parameters_come_back_when_forward_raises():
    lin = nn.Linear(4, 4)
    weight = lin.weight
    apply_policy(lin, {"": "fp16"})
    with pytest.raises(RuntimeError):
        lin(torch.randn(3, 5))  # wrong width
    assert lin.weight is weight and lin.weight.dtype == torch.float32


def test_cast_floats_keeps_integers_and_structure():
    data = {"x": (torch.ones(2), torch.arange(3)), "y": [torch.zeros(1, dtype=torch.float64)]}
    out = cast_floats(data, torch.bfloat16)
    assert out["x"][0].dtype == torch.bfloat16 and out["x"][1].dtype == torch.int64
    assert out["y"][0].dtype == torch.bfloat16


def test_a_second_policy_replaces_the_first_and_remove_restores_fp32():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    apply_policy(lin, {"": "bf16"})
    apply_policy(lin, {"": "fp16"})  # e.g. a new Trainer with another plugin on the same model
    assert len(lin._forward_pre_hooks) == 1 and len(lin._forward_hooks) == 1
    assert lin(torch.randn(2, 8)).dtype == torch.float16
    assert isinstance(lin.weight, nn.Parameter) and lin.weight.dtype == torch.float32
    remove_policy(lin)
    assert lin(torch.randn(2, 8)).dtype == torch.float32 and not lin._forward_pre_hooks


def test_removing_the_policy_sends_moe_tokens_as_they_come_again():
    model = transformer(num_experts=2)
    apply_policy(model, resolve(model, *preset_rules("O2", "fp16")))
    assert {m.ffn.dispatch_dtype for m in model.blocks} == {torch.float16}
    remove_policy(model)
    assert {m.ffn.dispatch_dtype for m in model.blocks} == {None}
