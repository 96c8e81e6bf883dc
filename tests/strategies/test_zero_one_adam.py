"""``zero_one_adam``'s settings and optimizer are checked before anything runs; on one rank its
variance steps are torch's Adam steps, and its schedules are DeepSpeed's documented ones."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from one_rank import Optimized, one_rank_trainer

from lightning_commstrats import AllReduceStrategy, ZeroOneAdamStrategy
from lightning_commstrats.strategies.zero_one_adam import ZeroOneAdam


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"var_freeze_step": -1}, "var_freeze_step"),
        ({"var_freeze_step": 0}, "var_freeze_step"),
        ({"var_freeze_step": 2.5}, "var_freeze_step"),
        ({"var_update_scaler": 0}, "var_update_scaler"),
        ({"local_step_scaler": True}, "local_step_scaler"),
        ({"local_step_clipper": 0}, "local_step_clipper"),
        ({"num_quantization_bits": 3}, "num_quantization_bits"),
        ({"bias_correction": 1}, "bias_correction"),
        ({"small_tensor_numel": -1}, "small_tensor_numel"),
        ({"variance_floor": -0.1}, "variance_floor"),
        ({"variance_floor": 1.0}, "variance_floor"),
        ({"compress_after_preconditioner": 1}, "compress_after_preconditioner"),
        ({"floor_warning": -0.5}, "floor_warning"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_setting(kwargs, named):
    with pytest.raises(ValueError, match=named):
        ZeroOneAdamStrategy(**kwargs)


def test_the_variance_schedule_doubles_its_interval_after_kappa_updates_and_stops_at_the_freeze():
    z = ZeroOneAdam(var_freeze_step=120, var_update_scaler=16)
    steps = [t for t in range(1, 300) if z.updates_variance(t)]
    # 16 at interval 1, 16 at 2 (18..48), 16 at 4 (52..112), then 8: 120 is the last before the freeze
    assert steps == list(range(1, 17)) + list(range(18, 49, 2)) + list(range(52, 113, 4)) + [120]
    assert z.variance_updates(1000) == len(steps) == 49


def test_the_local_interval_doubles_every_scaler_steps_after_the_freeze_up_to_the_clipper():
    z = ZeroOneAdam(var_freeze_step=10, local_step_scaler=5, local_step_clipper=4)
    assert [z.local_interval(t) for t in (10, 11, 15, 16, 20, 21, 25, 26, 1000)] == [1, 1, 1, 2, 2, 4, 4, 4, 4]
    assert [t for t in range(11, 30) if z.syncs(t)] == [11, 12, 13, 14, 15, 16, 18, 20, 24, 28]
    assert ZeroOneAdam(1, local_step_scaler=1, local_step_clipper=2**40).local_interval(10**6) == 2**40


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "needs torch.optim.Adam"),
        (lambda ps: torch.optim.Adam(ps, amsgrad=True), "amsgrad"),
    ],
)
def test_an_optimizer_it_cannot_continue_is_refused(make, why):
    with pytest.raises(ValueError, match=why):
        one_rank_trainer(ZeroOneAdamStrategy(var_freeze_step=2), 2).fit(Optimized(make))


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_while_every_step_updates_the_variance_it_is_torchs_adam(optimizer):
    def make(ps):
        return optimizer(ps, lr=0.01, weight_decay=0.1)

    torch.manual_seed(0)
    ours = Optimized(make)
    reference = Optimized(make)
    reference.load_state_dict(ours.state_dict())
    # kappa = 16: the first 16 steps update the variance, every one an Adam step on one rank
    torch.manual_seed(1)  # the same random data for both
    one_rank_trainer(ZeroOneAdamStrategy(var_freeze_step=100), 16).fit(ours)
    torch.manual_seed(1)
    one_rank_trainer(AllReduceStrategy(), 16).fit(reference)  # torch's Adam steps
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    s_ours = next(iter(ours.trainer.optimizers[0].state.values()))
    s_ref = next(iter(reference.trainer.optimizers[0].state.values()))
    assert int(s_ours["step"]) == int(s_ref["step"]) == 16
    torch.testing.assert_close(s_ours["exp_avg_sq"], s_ref["exp_avg_sq"])


def _watched_run(skip_sync_at: int | None = None):
    torch.manual_seed(0)
    model = Optimized(lambda ps: torch.optim.Adam(ps, lr=0.01))
    strategy = ZeroOneAdamStrategy(var_freeze_step=2, var_update_scaler=1, local_step_scaler=1, local_step_clipper=4)
    if skip_sync_at is not None:  # that step is taken as a local one instead
        syncs = strategy.adam.syncs
        strategy.adam.syncs = lambda t: t != skip_sync_at and syncs(t)
    seen = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            weights = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            moments = torch.cat([s["exp_avg"].reshape(-1) for s in trainer.optimizers[0].state.values()])
            seen.append((trainer.global_step, strategy.adam.open, weights, moments))

    trainer = one_rank_trainer(strategy, 12)
    trainer.callbacks.append(Watch())
    torch.manual_seed(1)
    trainer.fit(model)
    return strategy, seen


def test_on_one_rank_a_synchronisation_lands_where_the_local_steps_went():
    """Without weight decay a synchronisation of one rank, ``x' - u / d``, is the point its local
    steps reach (to rounding); its momentum becomes the lr-weighted mean of the interval's."""
    strategy, seen = _watched_run()
    opened = [step for step, is_open, _, _ in seen if is_open]
    assert opened == [5, 6, 7, 9, 10, 11]  # intervals 1, 2, 4, 4, ...: syncs at 3, 4, 8, 12
    assert not strategy.adam.open and strategy.comm_stats.bytes_sent == 0
    _, local = _watched_run(skip_sync_at=8)  # step 8 taken locally
    assert local[7][1] and not seen[7][1]
    torch.testing.assert_close(seen[7][2], local[7][2], rtol=1e-6, atol=1e-7)
    assert (seen[7][3] - local[7][3]).abs().max() > 1e-4  # the momentum: the mean, not the last


def test_a_run_that_never_passes_the_freeze_is_warned_of():
    with pytest.warns(UserWarning, match="var_freeze_step=10: it never takes a local step"):
        one_rank_trainer(ZeroOneAdamStrategy(var_freeze_step=10), 6).fit(Optimized(lambda ps: torch.optim.Adam(ps)))


def test_the_state_saves_and_loads():
    z = ZeroOneAdam(3)
    z.open, z.lr_sums, z.decays = True, {0: 0.5}, {0: 0.99}
    z.anchor, z.accum = {"w": torch.ones(2)}, {"w": torch.full((2,), 3.0)}
    other = ZeroOneAdam(3)
    other.load_state_dict(z.state_dict(), z.rank_state_dict(), torch.device("cpu"))
    assert other.open and other.lr_sums == {0: 0.5} and other.decays == {0: 0.99}
    assert torch.equal(other.anchor["w"], z.anchor["w"]) and torch.equal(other.accum["w"], z.accum["w"])
    with pytest.raises(ValueError, match="accumulated momentum"):
        ZeroOneAdam(3).load_state_dict(z.state_dict(), {"accum": {}}, torch.device("cpu"))


def test_the_preconditioner_is_floored_and_a_freeze_with_unsettled_values_is_warned_of():
    w = torch.nn.Parameter(torch.zeros(16, 8))
    opt = torch.optim.Adam([w], lr=0.01)
    v = torch.cat([torch.full((4, 8), 1e-4), torch.zeros((12, 8))])  # 12 of 16 rows never had a gradient
    opt.state[w] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(v), "exp_avg_sq": v.clone()}
    z = ZeroOneAdam(3)
    d = z._denominators(0, opt.param_groups[0], [opt.state[w]], ["w"], 3)[0]
    r = (v / (1 - 0.999**3)).sqrt()  # 3 variance updates by step 3
    torch.testing.assert_close(d, torch.maximum(r, 0.1 * r.square().mean().sqrt()) + 1e-8)
    with pytest.warns(UserWarning, match=r"zero_one_adam: the variance froze after 3 optimizer steps with 75.0%"):
        z.report_floor(opt, [w], ["w"], "zero_one_adam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroOneAdam(3, floor_warning=None).report_floor(opt, [w], ["w"], "zero_one_adam")


def test_accumulated_momentum_saved_in_other_units_is_refused():
    z = ZeroOneAdam(3, compress_after_preconditioner=False)
    z.open, z.anchor, z.accum = True, {"w": torch.ones(2)}, {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="'momentum' units"):
        ZeroOneAdam(3).load_state_dict(z.state_dict(), z.rank_state_dict(), torch.device("cpu"))
