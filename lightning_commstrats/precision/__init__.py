"""Mixed precision: the ``LayeredMixedPrecision`` plugin, its per-module policies and loss scaling."""

from lightning_commstrats.precision.plugin import DEVICES, LayeredMixedPrecision
from lightning_commstrats.precision.policy import DTYPES, PRESETS, apply_policy, preset_rules, resolve
from lightning_commstrats.precision.scaler import LossScalerState, unscale_

__all__ = [
    "DEVICES",
    "DTYPES",
    "PRESETS",
    "LayeredMixedPrecision",
    "LossScalerState",
    "apply_policy",
    "preset_rules",
    "resolve",
    "unscale_",
]
