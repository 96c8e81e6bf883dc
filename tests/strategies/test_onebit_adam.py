"""``onebit_adam``'s settings and optimizer are checked before anything runs; on one rank after the
freeze it is Adam with its variance frozen (nothing to compress)."""

from __future__ import annotations

import warnings

import pytest
import torch
from one_rank import Optimized, one_rank_trainer

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
        ({"variance_floor": -0.1}, "variance_floor"),
        ({"variance_floor": 1.0}, "variance_floor"),
        ({"variance_floor": True}, "variance_floor"),
        ({"compress_after_preconditioner": "yes"}, "compress_after_preconditioner"),
        ({"floor_warning": 1.5}, "floor_warning"),
        ({"floor_warning": False}, "floor_warning"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_setting(kwargs, named):
    with pytest.raises(ValueError, match=named):
        OneBitAdamStrategy(**kwargs)


def _fit(make, steps=6, **kwargs):
    strategy = OneBitAdamStrategy(**kwargs)
    trainer = one_rank_trainer(strategy, steps)
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


def _frozen_state(v: torch.Tensor, m: torch.Tensor, steps: int = 4):
    w = torch.nn.Parameter(torch.zeros_like(v))
    opt = torch.optim.Adam([w], lr=0.01)
    opt.state[w] = {"step": torch.tensor(float(steps)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    return w, opt


@pytest.mark.parametrize("preconditioned", [True, False])
def test_the_frozen_preconditioner_is_floored_and_what_travels_is_the_momentum_over_it(preconditioned):
    # 3 rows of 4: a row of settled values, a row with a tiny variance, a row that never had a gradient
    v = torch.tensor([[4e-4, 1e-4, 9e-4, 4e-4], [1e-12, 4e-12, 1e-12, 1e-12], [0.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1e-3, -2e-3, 3e-3, 1e-3], [1e-6, 0.0, -1e-6, 0.0], [0.0, 0.0, 0.0, 0.0]])
    g = torch.full_like(v, 1e-3)
    w, opt = _frozen_state(v, m)
    adam = FrozenVarianceAdam(4, variance_floor=0.1, compress_after_preconditioner=preconditioned)
    w.grad = g.clone()
    adam.local_momentum(opt, [w], ["w"])
    # the formula, by hand (b1 0.9, b2 0.999, eps 1e-8; frozen after T = 4 steps)
    r = (v / (1 - 0.999**4)).sqrt()
    d = torch.maximum(r, 0.1 * r.square().mean().sqrt()) + 1e-8
    mi = 0.9 * m + 0.1 * g
    sent = mi / d if preconditioned else mi
    torch.testing.assert_close(w.grad, sent, rtol=1e-6, atol=0)
    assert (d[1:] > 100 * r[1:]).all()  # the unsettled rows take the floor, the settled one its own r
    torch.testing.assert_close(d[0], r[0] + 1e-8)
    # what the ranks' average would be: this rank's alone; then the step
    adam.step(opt, [w], ["w"])
    step = 0.01 / (1 - 0.9**5)
    torch.testing.assert_close(opt.state[w]["exp_avg"], mi, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(w.detach(), -step * mi / d, rtol=1e-5, atol=1e-12)
    assert w.detach()[2].abs().max() < 1e-2  # the row without a gradient steps by at most about lr
    assert adam.frozen_at == {"w": 4} and w.grad is None


def test_the_papers_update_is_kept_with_no_floor():
    v = torch.tensor([[4e-4, 0.0]])
    w, opt = _frozen_state(v, torch.tensor([[1e-3, 1e-4]]))
    adam = FrozenVarianceAdam(4, variance_floor=0.0, compress_after_preconditioner=False, floor_warning=None)
    w.grad = torch.zeros_like(v)
    adam.local_momentum(opt, [w], ["w"])
    adam.step(opt, [w], ["w"])
    # 0.9e-4 / eps: the paper's step of a value whose frozen variance is zero
    assert w.detach()[0, 1] == pytest.approx(-0.01 / (1 - 0.9**5) * 0.9e-4 / 1e-8, rel=1e-5)


def test_a_freeze_with_unsettled_values_is_warned_of_with_the_share():
    v = torch.cat([torch.full((4, 8), 1e-4), torch.zeros((12, 8))])  # 12 of 16 rows never had a gradient
    w, opt = _frozen_state(v, torch.zeros_like(v))
    w.grad = torch.zeros_like(v)
    with pytest.warns(
        UserWarning, match=r"froze after 4 optimizer steps with 75.0% of the values \(96 of 128\) that never had a grad"
    ):
        FrozenVarianceAdam(4).local_momentum(opt, [w], ["w"])
    w.grad = torch.zeros_like(v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FrozenVarianceAdam(4, floor_warning=None).local_momentum(opt, [w], ["w"])
        w.grad = torch.zeros_like(v)
        FrozenVarianceAdam(4, floor_warning=0.8).local_momentum(opt, [w], ["w"])
        w.grad = torch.full_like(v, 1e-3)
        opt.state[w]["exp_avg_sq"].fill_(1e-4)  # every value settled: nothing to warn of
        FrozenVarianceAdam(4).local_momentum(opt, [w], ["w"])
        # rows far under the floor that had a gradient (a tied vocabulary's rare words): not warned of,
        # since they sit there at any freeze, good or early (the settling figure tells those apart)
        opt.state[w]["exp_avg_sq"][4:] = 1e-16
        w.grad = torch.full_like(v, 1e-3)
        FrozenVarianceAdam(4).local_momentum(opt, [w], ["w"])
