"""LayeredMixedPrecision in a real Trainer: presets, masters, overflow skipping, checkpoints, errors."""

import math
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_commstrats import LayeredMixedPrecision

sys.path.insert(0, str(Path(__file__).parents[1] / "multiprocess"))
from worker import InjectInf, ManualTwoOptimizers, TinyLM

TRANSFORMER = {"arch": "transformer", "hidden_dim": 16, "num_heads": 2, "num_layers": 2, "ffn_dim": 32}
MOE = {**TRANSFORMER, "num_experts": 2, "moe_every": 2}


def fit(model, plugins=(), steps=6, strategy="allreduce", callbacks=(), ckpt_path=None, **kwargs):
    options = dict(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        plugins=list(plugins), callbacks=list(callbacks),
    )  # fmt: skip
    trainer = L.Trainer(**{**options, **kwargs})
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def tiny(seed=0, **kwargs):
    L.seed_everything(seed, verbose=False)
    return TinyLM(**{**MOE, "dropout": 0.0, "optimizer": "adam", "lr": 0.01, **kwargs})


class Inject(InjectInf):
    """An inf in one gradient at one optimizer step; keeps the weights and Adam state after every step."""

    def __init__(self, step):
        super().__init__(step, rank=0)
        self.weights, self.adam = [], []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.weights.append({k: v.clone() for k, v in pl_module.state_dict().items()})
        state = trainer.optimizers[0].state
        self.adam.append([{k: v.clone() for k, v in state[p].items()} for p in pl_module.parameters() if p in state])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"preset": "O4"}, "preset='O4'"),
        ({"dtype": "fp32"}, "must be a half dtype"),
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"preset": "O1", "policy": {"ffn": "fp32"}}, "per-module presets"),
        ({"policy": {"ffn": "fp64"}}, r"policy\['ffn'\]"),
        ({"init_scale": -1.0, "loss_scaling": True}, "init_scale"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayeredMixedPrecision(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_device_that_cannot_run_the_dtype_fails_at_construction():
    with pytest.raises(ValueError, match="CUDA is not available"):
        LayeredMixedPrecision(dtype="fp16", device="cuda")


def test_a_policy_naming_no_module_fails_before_training():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"\['blocks.9.ffn'\]"):
        fit(model, [LayeredMixedPrecision(policy={"blocks.9.ffn": "fp32"})])
    assert model.losses == []
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_o0_equals_fp32_training_exactly():
    plain, o0 = tiny(), tiny()
    fit(plain)
    fit(o0, [LayeredMixedPrecision("O0", dtype="fp16")])
    assert o0.losses == plain.losses
    for k, v in plain.state_dict().items():
        assert torch.equal(o0.state_dict()[k], v), k


@pytest.mark.parametrize("preset", ["O1", "O2", "O3", "layered"])
def test_each_preset_runs_modules_in_its_dtypes(preset):
    model = tiny()
    seen = {}
    for name, module in model.named_modules():
        if name.endswith(("attn.qkv", "norm1", "experts", "net.output", "net.embedding")):
            module.register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(name.split(".")[-1], o.dtype))
    trainer = fit(model, [LayeredMixedPrecision(preset, dtype="bf16")], steps=3)
    bf16, fp32 = torch.bfloat16, torch.float32
    expected = {
        # autocast op lists: linear layers in half, layer norm and embedding lookups in float32
        "O1": {"qkv": bf16, "norm1": fp32, "experts": bf16, "output": bf16, "embedding": fp32},
        "O2": {"qkv": bf16, "norm1": fp32, "experts": bf16, "output": bf16, "embedding": bf16},
        "O3": {"qkv": bf16, "norm1": bf16, "experts": bf16, "output": bf16, "embedding": bf16},
        "layered": {"qkv": bf16, "norm1": fp32, "experts": bf16, "output": fp32, "embedding": fp32},
    }[preset]
    assert seen == expected
    masters = bf16 if preset == "O3" else fp32  # O3 alone trains half weights without masters
    params = list(model.parameters())
    assert {p.dtype for p in params} == {masters}
    adam = trainer.optimizers[0].state
    assert {adam[p]["exp_avg"].dtype for p in params} == {masters}
    assert all(math.isfinite(loss) for loss in model.losses)


def test_overflow_skips_the_step_halves_the_scale_and_training_goes_on():
    model = tiny()
    inject = Inject(step=2)
    plugin = LayeredMixedPrecision("layered", dtype="bf16", loss_scaling=True, init_scale=1024.0)
    trainer = fit(model, [plugin], steps=5, callbacks=[inject])
    w, adam = inject.weights, inject.adam
    for k in w[1]:  # the third batch (global step 2) changed nothing
        assert torch.equal(w[2][k], w[1][k]), k
    for before, after in zip(adam[1], adam[2], strict=True):
        for k in before:
            assert torch.equal(before[k], after[k]), k
    assert any(not torch.equal(w[3][k], w[2][k]) for k in w[2])  # and the next batch trains again
    assert plugin.scaler.scale == 512.0 and plugin.scaler.skipped_steps == 1
    assert trainer.strategy.optimizer_steps == 4  # the skipped step is not counted by the strategy
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_loss_scaling_keeps_gradients_equal_to_unscaled_training():
    unscaled, scaled = tiny(), tiny()
    fit(unscaled, [LayeredMixedPrecision("layered", dtype="bf16")], steps=3)
    fit(scaled, [LayeredMixedPrecision("layered", dtype="bf16", loss_scaling=True, init_scale=2.0**10)], steps=3)
    # scaling by a power of two and dividing again is exact in binary floating point
    for k, v in unscaled.state_dict().items():
        assert torch.equal(scaled.state_dict()[k], v), k


def test_scaler_state_is_saved_and_restored(tmp_path):
    model = tiny()
    plugin = LayeredMixedPrecision(dtype="bf16", loss_scaling=True, init_scale=256.0, growth_interval=2)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="last", every_n_train_steps=5)
    fit(model, [plugin], steps=5, callbacks=[ckpt, Inject(step=1)], enable_checkpointing=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["LayeredMixedPrecision"]
    assert saved["scaler"] == plugin.scaler.state_dict()
    assert saved["scaler"]["skipped_steps"] == 1 and saved["scaler"]["scale"] == 256.0  # halved, grown back once

    resumed = LayeredMixedPrecision(dtype="bf16", loss_scaling=True, init_scale=4.0, growth_interval=2)
    fit(tiny(), [resumed], steps=6, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.scaler.skipped_steps == 1 and resumed.scaler.clean_steps == 0 and resumed.scaler.scale == 512.0


def test_fp16_pure_half_fails_where_layered_trains():
    """The paper's finding on a tiny LM: O3 (half weights, half Adam state) breaks, layered trains."""
    results = {}
    for preset in ("O3", "layered"):
        model = tiny(**TRANSFORMER)  # dense, to keep fp16 matmuls (slow on CPU) few
        fit(model, [LayeredMixedPrecision(preset, dtype="fp16")], steps=24)
        results[preset] = model.losses
    layered, o3 = results["layered"], results["O3"]
    assert all(math.isfinite(x) for x in layered) and sum(layered[-4:]) / 4 < layered[0] - 0.1
    # diverged (inf/NaN) or stalled (no better than the start)
    assert not all(math.isfinite(x) for x in o3) or sum(o3[-4:]) / 4 > o3[0] - 0.02


def test_lightning_grad_scaler_is_refused_by_package_strategies():
    with pytest.raises(ValueError, match="LayeredMixedPrecision"):
        fit(tiny(), [MixedPrecision("16-mixed", "cpu")])


class InjectAtBackward(L.Callback):
    """An inf in the first layer's gradient at the given backward call (manual optimization)."""

    def __init__(self, call):
        self.call, self.calls = call, 0
        self.second_layer = []

    def on_after_backward(self, trainer, pl_module):
        if self.calls == self.call:
            pl_module.layer[0].weight.grad.view(-1)[0] = math.inf
        self.calls += 1

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.second_layer.append(pl_module.layer[2].weight.detach().clone())


def test_two_optimizers_one_overflowing_the_other_unscaled_by_the_scale_of_its_backward():
    runs = {}
    for name, call in (("clean", -1), ("inject", 2)):
        L.seed_everything(0, verbose=False)
        model = ManualTwoOptimizers()
        callback = InjectAtBackward(call)
        plugin = LayeredMixedPrecision("O2", dtype="bf16", loss_scaling=True, init_scale=1024.0)
        fit(model, [plugin], steps=8, callbacks=[callback])  # 4 batches, 2 optimizer steps each
        runs[name] = (callback.second_layer, plugin.scaler)
    (clean, _), (inject, scaler) = runs["clean"], runs["inject"]
    assert scaler.skipped_steps == 1 and scaler.scale == 512.0
    # the Adam layer stepped normally in the batch where the SGD layer overflowed
    assert torch.equal(inject[2], clean[2]) and not torch.equal(inject[2], inject[1])


def test_the_plugin_says_which_modules_it_put_in_half_and_warns_about_bf16_on_cpu(caplog):
    import logging

    from lightning_commstrats.models import LanguageModel
    from lightning_commstrats.precision.plugin import describe_dtypes

    model = LanguageModel(
        arch="transformer", vocab_size=64, embed_dim=16, hidden_dim=16, num_layers=2, num_heads=2,
        ffn_dim=32, max_seq_len=8, num_experts=2,
    )  # fmt: skip
    plugin = LayeredMixedPrecision(preset="layered", dtype="bf16")
    with caplog.at_level(logging.INFO, logger="lightning_commstrats"):
        plugin.convert_module(model)
    # the layered preset: attention's and the FFNs' Linears and the experts in bf16; embeddings, norms,
    # the router and the output layer in float32 (counted from the model here, not from the plugin)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    kept = [n for n in linears if n.endswith(("router", "output"))]
    expected = (
        f"bf16: Experts x2, Linear x{len(linears) - len(kept)};"
        f" fp32: Embedding x2, LayerNorm x5, Linear x{len(kept)} (output, router)"
    )
    assert describe_dtypes(model, plugin.module_dtypes) == expected
    assert expected in caplog.text
    assert "on CPU: the half modules compute on bf16 copies" in caplog.text and "peak memory" in caplog.text
