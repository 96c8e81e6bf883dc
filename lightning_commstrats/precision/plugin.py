"""``LayeredMixedPrecision``: per-module compute dtypes, float32 masters, agreed dynamic loss scaling.

A Lightning precision plugin. The 2022 paper on training 174-trillion-parameter MoE models found
APEX's ``O2``/``O3`` fast but not converging and ``O0``/``O1`` converging but slow, and kept both
with a *layered* policy: attention and FFN (and experts) compute in half precision with float32
master weights; embeddings, norms, the router and the output softmax layer stay in float32; the
loss is scaled dynamically. The presets, by their APEX meanings:

=========== ==================================================================================
``O0``      float32 everything: this plugin does nothing (equals training without it, bit for bit).
``O1``      ``torch.autocast`` op lists: matmuls in half, reductions and softmax in float32.
``O2``      every module computes in half except norms (and the router); float32 masters.
``O3``      pure half: the model's parameters *are* half, the optimizer updates them directly.
``layered`` the paper's policy above; float32 masters. The default.
=========== ==================================================================================

For ``O2`` and ``layered``, parameters stay float32 (they are the masters; optimizer state is
float32 too) and a module computing in half casts its inputs and its own weights as it runs (see
:mod:`.policy`); ``policy=`` adds or overrides rules by role or module name.

Dynamic loss scaling (fp16 by default, bf16 on request): on every optimizer step the plugin
divides the gradients by the scale and looks for infs/NaNs *before* the strategy exchanges
anything. The ranks then agree (one one-element all-reduce of the overflow flag, tag
``"precision"``), so they all skip an overflowing step together: no optimizer update, no
gradient exchange, no residual, block-momentum or global-model update, and the strategy's step
counters do not advance. The scale backs off; after ``growth_interval`` clean steps it grows.

Trade-offs (``benchmarks/results/precision``, bf16 on a CPU with AVX-512 BF16): ``layered``
trains within 0.2% of fp32's perplexity at 1.23x its tokens/s; ``O2`` is 1.33x and as good in
bf16 (fp16's narrow range is what hurts it on GPUs); ``O3`` is fastest (1.46x) but 30% worse, and
in fp16 it breaks at its first Adam step. Gradients of float32 masters are float32, so gradient
schemes send as many bytes as without the plugin (``O3`` sends half); MoE tokens to half experts
travel in half.

Example::

    trainer = L.Trainer(strategy="bmuf", devices=4,
                        plugins=[LayeredMixedPrecision("layered", dtype="bf16")])
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_commstrats._logging import log_rank_zero
from lightning_commstrats.precision.policy import (
    DTYPES,
    HALF,
    PRESETS,
    apply_policy,
    cast_floats,
    dtype_name,
    preset_rules,
    remove_policy,
    resolve,
)
from lightning_commstrats.precision.scaler import LossScalerState, unscale_
from lightning_commstrats.strategies.base import CommStrategy

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")


class LayeredMixedPrecision(Precision):
    """Mixed precision with a per-module dtype policy, float32 master weights and dynamic loss scaling.

    Args:
        preset: ``"layered"`` (default), ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (table above).
        dtype: the half dtype: ``"bf16"`` (default) or ``"fp16"``.
        policy: extra rules ``{role or module-name pattern: "fp32" | "bf16" | "fp16"}`` applied over
            the preset's (``layered`` and ``O2`` only), e.g. ``{"recurrent": "bf16"}`` to run an
            LSTM's recurrent layers in half, or ``{"blocks.0.*": "fp32"}``. A pattern that matches
            no module is an error when the model is set up.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available). Checked at construction:
            the device must run ``dtype``.
        loss_scaling: dynamic loss scaling on or off; default on for fp16, off for bf16 (its range
            is float32's). Ignored by ``O0``.
        init_scale, growth_factor, backoff_factor, growth_interval: the scaler's settings
            (:class:`~lightning_commstrats.precision.scaler.LossScalerState`).
    """

    def __init__(
        self,
        preset: str = "layered",
        dtype: str = "bf16",
        policy: Mapping[str, str] | None = None,
        device: str = "auto",
        loss_scaling: bool | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if preset not in PRESETS:
            raise ValueError(f"preset={preset!r} is not supported; choose one of {PRESETS}")
        half = dtype_name(dtype)
        if half not in HALF:
            raise ValueError(f"dtype={dtype!r} must be a half dtype, one of {HALF} (preset='O0' is float32)")
        if device not in DEVICES:
            raise ValueError(f"device={device!r} is not supported; choose one of {DEVICES}")
        if policy and preset not in ("layered", "O2"):
            raise ValueError(f"policy= applies to the per-module presets 'layered' and 'O2', not preset={preset!r}")
        self.rules: dict[str, str] = {}
        self.default = "fp32"
        if preset in ("layered", "O2"):
            self.default, self.rules = preset_rules(preset, half)
            for key, value in (policy or {}).items():
                if not isinstance(key, str) or not key:
                    raise ValueError(f"policy keys are roles or module-name patterns, got {key!r}")
                self.rules[key] = dtype_name(value, f"policy[{key!r}]")
        self.preset = preset
        self.half = half
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        _check_device_runs(self.device, DTYPES[half])
        if loss_scaling is None:
            loss_scaling = half == "fp16"
        self.scaler = (
            LossScalerState(init_scale, growth_factor, backoff_factor, growth_interval)
            if loss_scaling and preset != "O0"
            else None
        )
        self.precision = _LIGHTNING_NAMES[preset][half]  # type: ignore[assignment]
        self._converted: nn.Module | None = None
        self.module_dtypes: dict[str, str] | None = None  # module name -> dtype name, once a model is converted
        self._checked: bool | None = None  # this step's verdict once taken: True = the step runs
        self._backward_scale: float | None = None  # the scale the current gradients were made with

    def __repr__(self) -> str:
        scaling = f", loss_scale={self.scaler.scale:g}" if self.scaler else ""
        return f"{type(self).__name__}(preset={self.preset!r}, dtype={self.half!r}, device={self.device!r}{scaling})"

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.half]

    # ------------------------------------------------------------------ the model

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            device = trainer.strategy.root_device.type
            if device != self.device:
                raise ValueError(
                    f"{type(self).__name__}(device={self.device!r}) but the Trainer runs on {device!r};"
                    f" pass device={device!r} (or 'auto')"
                )
        if self._converted is module:  # a second fit/validate on the same model
            return module
        dtypes = resolve(module, self.default, self.rules) if self.preset in ("layered", "O2") else None
        # read by the package's strategies: with shard="fsdp" each unit is gathered in its dtype
        self.module_dtypes = dtypes
        remove_policy(module)  # another plugin's, from an earlier Trainer
        if self.preset == "O3":
            module.to(self.compute_dtype)
        if dtypes is not None:
            apply_policy(module, dtypes)
            log_rank_zero(log, logging.INFO, "%s: %s", self, describe_dtypes(module, dtypes))
            if self.device == "cpu" and any(d != "fp32" for d in dtypes.values()):
                log_rank_zero(
                    log,
                    logging.WARNING,
                    "%s on CPU: the half modules compute on %s copies of their float32 weights and inputs, which"
                    " can raise the peak memory (469 to 662 MiB measured on a small MoE), and CPU matmuls in half"
                    " are not faster; it is meant for GPUs (on CPU: to test a configuration)",
                    self,
                    self.half,
                )
        self._converted = module
        return module

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.preset == "O1":
            with torch.autocast(self.device, dtype=self.compute_dtype):
                yield
        else:
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        return cast_floats(data, self.compute_dtype) if self.preset == "O3" else data

    # ------------------------------------------------------------------ loss scaling and the step

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        tensor = super().pre_backward(tensor, module)
        if self.scaler is None:
            return tensor
        # the gradients are unscaled by the scale they were made with, even if a second optimizer's
        # step (manual optimization) changes the scale in between
        self._backward_scale = self.scaler.scale
        return tensor * self._backward_scale

    def unscale_and_check(self, optimizer: Optimizer, strategy: Any) -> bool:
        """Unscale this step's gradients and decide, with every rank, whether the step runs.

        Called by the package's strategies between backward and their gradient exchange, or by
        :meth:`optimizer_step` otherwise; the second call in a step returns the first's verdict.
        Returns False when some rank found an inf or a NaN: the step is skipped everywhere.
        """
        if self.scaler is None:
            return True
        if self._checked is not None:
            return self._checked
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        overflow = _any_rank(unscale_(grads, self._backward_scale or self.scaler.scale), strategy)
        self.scaler.update(overflow)
        if overflow:
            log_rank_zero(
                log,
                logging.INFO,
                "overflow in the gradients: step skipped on every rank, loss scale now %g",
                self.scaler.scale,
            )
        self._checked = not overflow
        return self._checked

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule | nn.Module,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError("loss scaling needs one closure call per step; LBFGS calls it many times")
        self._checked = None
        try:
            closure_result = closure()
            assert isinstance(model, pl.LightningModule)
            runs = self.unscale_and_check(optimizer, model.trainer.strategy)
        finally:
            self._checked = None
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: Lightning skips the step
        if not runs:
            return closure_result
        self._after_closure(model, optimizer)
        return optimizer.step(**kwargs)

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        return {"preset": self.preset, "dtype": self.half, "scaler": self.scaler.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is None or "scaler" not in state_dict:
            return
        self.scaler.load_state_dict(state_dict["scaler"])


_LIGHTNING_NAMES = {
    "O0": {"bf16": "32-true", "fp16": "32-true"},
    "O1": {"bf16": "bf16-mixed", "fp16": "16-mixed"},
    "O2": {"bf16": "bf16-mixed", "fp16": "16-mixed"},
    "O3": {"bf16": "bf16-true", "fp16": "16-true"},
    "layered": {"bf16": "bf16-mixed", "fp16": "16-mixed"},
}


def _check_device_runs(device: str, dtype: torch.dtype) -> None:
    """Raise when ``device`` cannot compute in ``dtype`` (checked by running one small matmul)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available here; pass device='cpu' or 'auto'")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ValueError(f"dtype='bf16' is not supported by {torch.cuda.get_device_name()}; use dtype='fp16'")
    try:
        x = torch.ones(2, 2, dtype=dtype, device=device)
        (x @ x).sum().item()
        with torch.autocast(device, dtype=dtype):
            torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
    except RuntimeError as err:
        name = {v: k for k, v in DTYPES.items()}[dtype]
        raise ValueError(f"device={device!r} cannot compute in dtype={name!r}: {err}") from err


def describe_dtypes(module: nn.Module, dtypes: dict[str, str]) -> str:
    """Which modules compute in which dtype, by kind: ``"bf16: Linear x8, Experts x2; fp32:
    Embedding x2, LayerNorm x5, Linear x2 (router, output)"``: the kinds a policy put in half, and
    those it kept in float32 (the modules holding weights of their own), with up to three names
    where a kind is split."""
    by_name = dict(module.named_modules())
    groups: dict[str, dict[str, list[str]]] = {}
    for name, dtype in dtypes.items():
        held = by_name.get(name)
        if held is None or next(held.parameters(recurse=False), None) is None:
            continue  # containers and modules without weights of their own: nothing to say
        groups.setdefault(dtype, {}).setdefault(type(held).__name__, []).append(name)
    split = {k for d in groups.values() for k in d if sum(k in other for other in groups.values()) > 1}
    parts = []
    for dtype in sorted(groups, key=lambda d: d == "fp32"):
        kinds = []
        for kind, names in sorted(groups[dtype].items()):
            shown = f"{kind} x{len(names)}"
            if kind in split and dtype == "fp32":
                leaves = [n.rsplit(".", 1)[-1] or n for n in names]
                shown += f" ({', '.join(sorted(set(leaves))[:3])}{', ...' if len(set(leaves)) > 3 else ''})"
            kinds.append(shown)
        parts.append(f"{dtype}: {', '.join(kinds)}")
    return "; ".join(parts)


def _any_rank(flag: bool, strategy: Any) -> bool:
    """True when ``flag`` is True on any rank (every rank calls this; tag ``"precision"``)."""
    world = getattr(strategy, "world_size", 1)
    if world <= 1:
        return flag
    value = torch.tensor([float(flag)], device=strategy.root_device)
    if isinstance(strategy, CommStrategy):
        value = strategy.comm.all_reduce(value, "max", tag="precision")
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())
