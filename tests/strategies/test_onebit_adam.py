"""``onebit_adam``'s settings and optimizer are checked before anything runs; on one rank after the
freeze it is Adam with its variance frozen (nothing to compress)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_commstrats import OneBitAdamStrategy
from lightning_commstrats.strategies.onebit_adam import FrozenVarianceAdam, refuse_grad_scaler


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"freeze_step": -1}, "freeze_step"),
        ({"freeze_step": 0}, "freeze_step"),
        ({"freeze_step": 2.5}, "freeze_step"),
        ({"num_quantization_bits": 3}, "num_quantization_bits"),
        ({"bias_correction": "yes"}, "bias_correction"),
        ({"small_tensor_numel": -1}, "small_tensor_numel"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_setting(kwargs, named):
    with pytest.raises(ValueError, match=named):
        OneBitAdamStrategy(**kwargs)


class Optimized(BoringModel):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def configure_optimizers(self):
        return self.make(self.parameters())


def _fit(make, steps=6, **kwargs):
    strategy = OneBitAdamStrategy(**kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    model = Optimized(make)
    trainer.fit(model)
    return model, strategy


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "got SGD"),
        (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), "amsgrad"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1, maximize=True), "maximize"),
    ],
)
def test_an_optimizer_it_cannot_continue_is_refused_at_setup(make, why):
    with pytest.raises(ValueError, match=why):
        _fit(make, freeze_step=2)


def test_one_rank_after_the_freeze_is_adam_with_its_variance_frozen():
    def make(ps):
        return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)

    torch.manual_seed(0)
    _, at_freeze = _fit(make, steps=4, freeze_step=4)
    torch.manual_seed(0)
    model, strategy = _fit(make, freeze_step=4)
    opt = strategy.optimizers[0]
    state = next(iter(opt.state.values()))
    assert int(state["step"]) == 6 and strategy.adam.frozen_at == dict.fromkeys(strategy.adam.frozen_at, 4)
    frozen = [s["exp_avg_sq"] for s in at_freeze.optimizers[0].state.values()]
    assert all(torch.equal(a, s["exp_avg_sq"]) for a, s in zip(frozen, opt.state.values(), strict=True))
    moved = [s["exp_avg"] for s in at_freeze.optimizers[0].state.values()]
    assert not all(torch.equal(a, s["exp_avg"]) for a, s in zip(moved, opt.state.values(), strict=True))
    assert set(strategy.adam.frozen_at) == {n for n, _ in model.named_parameters()}
    assert strategy.comm_stats.bytes_sent == 0  # one rank: nothing travels


def test_a_grad_scaler_is_refused():
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = OneBitAdamStrategy(freeze_step=2)
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="GradScaler"):
        refuse_grad_scaler(strategy, "onebit_adam")
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    refuse_grad_scaler(strategy, "onebit_adam")


def test_a_run_that_never_reaches_the_freeze_is_warned_of():
    with pytest.warns(UserWarning, match="freeze_step=10: it never compresses"):
        _fit(lambda ps: torch.optim.Adam(ps, lr=0.01), steps=6, freeze_step=10)


def test_the_frozen_state_saves_and_loads():
    adam = FrozenVarianceAdam(3)
    adam.frozen_at = {"w": 3}
    other = FrozenVarianceAdam(3)
    other.load_state_dict(adam.state_dict())
    assert other.frozen_at == {"w": 3}
