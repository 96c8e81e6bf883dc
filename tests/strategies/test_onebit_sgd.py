"""`onebit_sgd` in one process: construction errors and what happens to mismatched checkpoints."""

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_commstrats import OneBitSGDStrategy
from lightning_commstrats.strategies.base import STATE_KEY


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_quantization_bits": 3},
            r"num_quantization_bits=3 is not supported; choose one of \(1, 2, 4, 8, 16, 32\)",
        ),
        ({"distributed_after": -1}, "distributed_after must be an int >= 0, got -1"),
        ({"distributed_after_unit": "epochs"}, "distributed_after_unit='epochs' is not supported"),
        ({"small_tensor_numel": -5}, "small_tensor_numel must be an int >= 0"),
        ({"half_dtype": "float8"}, "half_dtype='float8' is not supported"),
        ({"resume_mismatch": "ignore"}, "resume_mismatch='ignore' is not supported"),
        ({"backend": "ib"}, "backend='ib' is not supported"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OneBitSGDStrategy(**kwargs)


def test_registered_and_documented():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["onebit_sgd"]["strategy"] is OneBitSGDStrategy
    doc = OneBitSGDStrategy.__doc__
    for knob in ("num_quantization_bits", "distributed_after", "small_tensor_numel", "Seide"):
        assert knob in doc


def _fit(tmp_path, strategy, ckpt_path=None, max_steps=2, model=None):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model or BoringModel(), ckpt_path=ckpt_path)
    return trainer


class AdamModel(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize(("bits", "warns"), [(1, True), (4, True), (16, False)])
def test_a_quantized_exchange_under_adam_warns_and_names_onebit_adam(tmp_path, bits, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, OneBitSGDStrategy(num_quantization_bits=bits), max_steps=1, model=AdamModel())
    named = [str(w.message) for w in caught if "onebit_adam" in str(w.message)]
    assert bool(named) == warns, named
    if warns:
        assert named[0].startswith("onebit_sgd quantizes the gradients that AdamW then rescales")
    with warnings.catch_warnings(record=True) as caught:  # plain SGD: not a word of it
        warnings.simplefilter("always")
        _fit(tmp_path, OneBitSGDStrategy(num_quantization_bits=bits), max_steps=1)
    assert not [w for w in caught if "onebit_adam" in str(w.message)]


def _checkpoint_with(tmp_path, edit):
    trainer = _fit(tmp_path, OneBitSGDStrategy())
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    assert ckpt[STATE_KEY]["strategy"] == "OneBitSGDStrategy" and ckpt[STATE_KEY]["world_size"] == 1
    assert ckpt[STATE_KEY]["state"]["optimizer_steps"] == 2
    edit(ckpt[STATE_KEY])
    torch.save(ckpt, path)
    return path


def test_checkpoint_from_another_world_size_is_an_error_unless_reset(tmp_path):
    def two_ranks(state):
        state["world_size"] = 2

    path = _checkpoint_with(tmp_path, two_ranks)
    with pytest.raises(ValueError, match=r"saved by 2 ranks and this run has 1.*resume_mismatch='reset'"):
        _fit(tmp_path, OneBitSGDStrategy(), ckpt_path=path, max_steps=4)
    trainer = _fit(tmp_path, OneBitSGDStrategy(resume_mismatch="reset"), ckpt_path=path, max_steps=4)
    assert trainer.global_step == 4


def test_residual_of_the_wrong_shape_is_named(tmp_path):
    def wrong_shape(state):
        state["rank"]["residuals"]["layer.weight"] = torch.zeros(3, 3)

    path = _checkpoint_with(tmp_path, wrong_shape)
    with pytest.raises(
        ValueError, match=r"residuals for 'layer.weight' have shape \(3, 3\), this model needs \(32, 2\)"
    ):
        _fit(tmp_path, OneBitSGDStrategy(), ckpt_path=path, max_steps=4)


def test_counters_resume(tmp_path):
    path = _checkpoint_with(tmp_path, lambda state: None)
    trainer = _fit(tmp_path, OneBitSGDStrategy(), ckpt_path=path, max_steps=5)
    assert trainer.strategy.optimizer_steps == 5
    assert trainer.strategy.samples_per_worker == 5  # BoringModel: batches of one sample
