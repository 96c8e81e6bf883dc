"""Dynamic loss scaling: keep small fp16 gradients representable, back off and skip on overflow.

Pure PyTorch. The loss is multiplied by ``scale`` before backward, the gradients are divided by it
before anything reads them. After a step whose gradients hold an inf or a NaN the step is skipped
and ``scale`` shrinks by ``backoff_factor``; after ``growth_interval`` clean steps in a row it grows
by ``growth_factor`` (Micikevicius et al., "Mixed precision training", 2018; as torch's GradScaler).
Deciding whether to skip is the caller's business (every rank must agree: see the plugin).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


class LossScalerState:
    """The scale and its bookkeeping.

    Args:
        init_scale: the first scale (default ``2**16``). Too high costs a few skipped steps at the
            start while it backs off; too low loses small gradients to fp16 underflow until it grows.
        growth_factor: multiplier after ``growth_interval`` clean steps (default 2, > 1). Powers of
            two keep scaling exact in binary floating point; larger factors overshoot into overflow.
        backoff_factor: multiplier after an overflow (default 0.5, in (0, 1)). Smaller recovers
            from a burst of large gradients in fewer skipped steps but leaves the scale lower.
        growth_interval: clean optimizer steps in a row before growing (default 2000, >= 1).
            Short intervals probe upwards often and skip a step each time the probe overflows;
            long ones leave the scale low for long after a backoff. If ``skipped_steps`` grows by
            more than about one per interval, lengthen it.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1 (optimizer steps), got {growth_interval!r}")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.scale = float(init_scale)
        self.clean_steps = 0  # clean steps since the scale last changed
        self.skipped_steps = 0  # overflowing steps skipped so far

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and adjust the scale."""
        if overflow:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale = float(state["scale"])
        if not scale > 0:
            raise ValueError(f"a loss scale must be > 0, the checkpoint holds {scale}")
        self.scale = scale
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def unscale_(grads: Iterable[Tensor], scale: float) -> bool:
    """Divide ``grads`` by ``scale`` in place; True when any of them holds an inf or a NaN."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    found = False
    for (device, _), tensors in groups.items():
        flag = torch.zeros(1, device=device)
        # one fused pass per dtype: checks every element and multiplies by 1/scale
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, torch.full((1,), 1.0 / scale, device=device))
        found = found or bool(flag.item())
    return found
