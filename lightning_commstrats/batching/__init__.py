"""Batch sizes that change during fit: the mechanism (:mod:`.resize`) and the callbacks that use it."""

from lightning_commstrats.batching.auto_adjust import AutoAdjust
from lightning_commstrats.batching.noise_scale import GradientNoiseScale
from lightning_commstrats.batching.resize import (
    BATCH_SIZE_KEY,
    LR_SCALINGS,
    ResizableBatchSampler,
    current_batch_size,
    in_trial,
    log_batch_size,
    lr_factor,
    lr_scale,
    make_resizable,
    scale_learning_rates,
    set_batch_size,
)

__all__ = [
    "BATCH_SIZE_KEY",
    "LR_SCALINGS",
    "AutoAdjust",
    "GradientNoiseScale",
    "ResizableBatchSampler",
    "current_batch_size",
    "in_trial",
    "log_batch_size",
    "lr_factor",
    "lr_scale",
    "make_resizable",
    "scale_learning_rates",
    "set_batch_size",
]
