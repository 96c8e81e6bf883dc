"""A callback that prints how far Adam's second moment has settled, for choosing ``onebit_adam``'s
``freeze_step`` or ``zero_one_adam``'s ``var_freeze_step`` (issue #45).

Every ``every`` optimizer steps, on rank 0, from the optimizer's own state: the share of values whose
bias-corrected ``sqrt(v)`` is under ``floor`` times their tensor's RMS (what ``variance_floor`` would
floor at a freeze now), and how much ``sqrt(v)`` moved since the last report (L1 of the change over
L1 of ``sqrt(v)``; the strategies measure the same figure once, at the freeze:
``lightning_commstrats.strategies.settling``). Meaningful before the freeze only: a frozen ``v`` is
not updated, and the bias correction moves with the step count. From the repository root::

    PYTHONPATH=benchmarks commstrats-lm fit --config tr.yaml --trainer.callbacks+=variance_settling.VarianceSettling
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_commstrats.strategies.settling import variance_roots


class VarianceSettling(pl.Callback):
    """Print ``[floor] step N: S% under the floor; sqrt(v) moved M% (L1) since step N - every``."""

    def __init__(self, every: int = 10, floor: float = 0.1) -> None:
        self.every, self.floor = every, floor
        self.last: torch.Tensor | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step % self.every or trainer.global_rank != 0:
            return
        opt = trainer.optimizers[0]
        params = [p for group in opt.param_groups for p in group["params"]]
        roots = [r.detach().clone() for r in variance_roots(opt, params)]
        below = total = 0
        per = []
        for r in roots:
            n = int((r < r.square().mean().sqrt() * self.floor).sum())
            below, total = below + n, total + r.numel()
            if r.numel() > 10000:
                per.append(f"{tuple(r.shape)}:{n / r.numel():.1%}")
        if not total:
            return
        flat = torch.cat([r.flatten() for r in roots])
        sums = torch.stack([r.sum() for r in roots])  # per tensor: its values' sum of sqrt(v)
        moved = ""
        if self.last is not None and self.last.shape == flat.shape:
            share = float((flat - self.last).abs().sum() / flat.abs().sum())
            # the same change with each tensor's values averaged first: per-value noise cancels,
            # a drift of the tensor's gradient scale stays
            drift = float((sums - self.last_sums).abs().sum() / sums.sum())
            b2 = opt.param_groups[0]["betas"][1]
            t, w = float(next(iter(opt.state.values()))["step"]), self.every
            forgets = 1 - b2**w * (1 - b2 ** (t - w)) / (1 - b2**t)  # the last w steps' weight in v's average
            moved = (
                f"; sqrt(v) moved {share:.1%} (L1) since step {step - self.every}, per-tensor means {drift:.2%};"
                f" the last {w} steps' weight in v {forgets:.3f} (0.65x: {0.65 * forgets:.1%})"
            )
        self.last = flat
        self.last_sums = sums
        print(f"[floor] step {step}: {below / total:.2%} under the floor ({below}/{total}){moved}; " + " ".join(per))
