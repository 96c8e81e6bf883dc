"""Dynamic loss scaling: the schedule of the scale and the unscale/overflow check."""

import math

import pytest
import torch

from lightning_commstrats.precision import LossScalerState, unscale_


def test_backoff_on_overflow_and_growth_after_the_interval():
    s = LossScalerState(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    s.update(True)
    assert s.scale == 512.0 and s.skipped_steps == 1
    s.update(False)
    s.update(False)
    assert s.scale == 512.0
    s.update(False)
    assert s.scale == 1024.0 and s.clean_steps == 0
    s.update(False)
    s.update(True)  # an overflow restarts the count of clean steps
    s.update(False)
    s.update(False)
    assert s.scale == 512.0 and s.clean_steps == 2


def test_state_round_trip():
    s = LossScalerState(init_scale=8.0, growth_interval=2)
    for overflow in (False, True, False):
        s.update(overflow)
    t = LossScalerState()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {"scale": 4.0, "clean_steps": 1, "skipped_steps": 1}
    with pytest.raises(ValueError, match="loss scale must be > 0"):
        t.load_state_dict({"scale": 0.0, "clean_steps": 0, "skipped_steps": 0})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": 0}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
    ],
)
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScalerState(**kwargs)


def test_unscale_divides_exactly_and_finds_non_finite_values():
    a = torch.tensor([2.0, -4.0])
    b = torch.tensor([6.0], dtype=torch.float16)
    assert unscale_([a, b], 2.0) is False
    assert a.tolist() == [1.0, -2.0] and b.tolist() == [3.0]
    for bad in (math.inf, -math.inf, math.nan):
        assert unscale_([torch.ones(3), torch.tensor([1.0, bad], dtype=torch.bfloat16)], 4.0) is True
