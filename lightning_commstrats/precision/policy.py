"""Per-module compute dtypes: presets, rules by role or name, and the casts at module boundaries.

Pure PyTorch, no Lightning. A *policy* gives every submodule of a model a compute dtype:

- a rule is ``key -> dtype`` where ``key`` is a role the model declares
  (:data:`lightning_commstrats.roles.ROLES`: ``"attention"``, ``"ffn"``, ``"expert"``...) or a
  module-name pattern (``fnmatch``, matched against the full name and against any dotted suffix, so
  ``"blocks.0.attn"`` matches ``model.blocks.0.attn``);
- a module takes the dtype of the first name pattern that matches it, else the rule of its role,
  else its parent's dtype; the root takes the preset's default.

:func:`apply_policy` makes the model compute that way while its parameters stay float32 (they are
the master weights the optimizer updates): a module whose dtype is half casts its floating inputs
and its own parameters to half for the length of its forward (a differentiable cast, so gradients
reach the float32 parameters in float32), and a float32 module casts half inputs back up. This is
numerically what a half model copy refreshed from float32 masters after every step computes (APEX
``O2``), without keeping that copy. An MoE layer whose experts compute in half also sends its tokens
to them in half (``MoELayer.dispatch_dtype``): the all-to-all carries half the bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_commstrats.moe.layer import MoELayer
from lightning_commstrats.roles import ROLES

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {"float32": "fp32", "32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "16": "fp16"}
HALF = ("bf16", "fp16")
PRESETS = ("O0", "O1", "O2", "O3", "layered")


def dtype_name(value: str | torch.dtype, argument: str = "dtype") -> str:
    """Canonical name (``"fp32"``, ``"bf16"`` or ``"fp16"``) of a dtype given by name or as a torch dtype."""
    if isinstance(value, torch.dtype):
        for name, dtype in DTYPES.items():
            if dtype == value:
                return name
    elif isinstance(value, str):
        key = value.lower()
        key = _ALIASES.get(key, key)
        if key in DTYPES:
            return key
    raise ValueError(f"{argument}={value!r} is not supported; choose one of {tuple(DTYPES)}")


def preset_rules(preset: str, half: str) -> tuple[str, dict[str, str]]:
    """The default dtype and the role rules of a per-module preset (``"layered"`` or ``"O2"``).

    ``layered``: attention, FFNs and experts compute in ``half``; embeddings, recurrent layers,
    norms, the router and the output softmax layer in float32 (the layered policy of the 2022 paper
    on 174-trillion-parameter MoE training). ``O2``: everything in ``half`` except norms (APEX
    keeps normalisation in float32) and the router (the MoE layer routes in float32 regardless).
    """
    if preset == "layered":
        rules = {role: "fp32" for role in ROLES}
        rules.update(attention=half, ffn=half, expert=half)
        return "fp32", rules
    if preset == "O2":
        return half, {"norm": "fp32", "router": "fp32"}
    raise ValueError(f"preset {preset!r} has no per-module rules; per-module presets are 'layered' and 'O2'")


def resolve(model: nn.Module, default: str, rules: Mapping[str, str]) -> dict[str, str]:
    """Module name -> dtype name for every module of ``model`` (the root is ``""``).

    Raises:
        ValueError: a rule's key is neither a role nor a pattern matching some module's name.
    """
    patterns = [(key, value) for key, value in rules.items() if key not in ROLES]
    used: set[str] = set()
    dtypes: dict[str, str] = {}
    for name, module in model.named_modules():
        parent = dtypes[name.rpartition(".")[0]] if name else default
        chosen = next((value for key, value in patterns if _matches(name, key)), None)
        if chosen is not None:
            used.update(key for key, _ in patterns if _matches(name, key))
        else:
            chosen = rules.get(getattr(module, "_commstrats_role", None) or "", parent)
        dtypes[name] = chosen
    unused = [key for key, _ in patterns if key not in used]
    if unused:
        names = [name for name, _ in model.named_modules() if name][:8]
        raise ValueError(
            f"policy names {unused}, which match no module of {type(model).__name__} and are not roles."
            f" Roles are {ROLES}; module names look like {names}"
        )
    return dtypes


def _matches(name: str, pattern: str) -> bool:
    return bool(name) and (fnmatch(name, pattern) or fnmatch(name, "*." + pattern))


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor inside (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple):
        cast = tuple(cast_floats(v, dtype) for v in value)
        return type(value)(*cast) if hasattr(value, "_fields") else cast
    if isinstance(value, list):
        return [cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


class _ModuleCast:
    """The two hooks of one module: cast inputs and own parameters before forward, restore after."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.names = [
            n for n, p in module.named_parameters(recurse=False) if p.is_floating_point() and p.dtype != dtype
        ]
        self.saved: list[dict[str, nn.Parameter]] = []  # a stack: a module may be re-entered

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.names:
            params = module._parameters
            self.saved.append({n: params[n] for n in self.names})
            for n in self.names:
                # a plain tensor in _parameters for the length of forward: module code reading
                # self.weight gets the cast, and autograd carries gradients to the float32 Parameter
                params[n] = params[n].to(self.dtype)  # type: ignore[assignment]
            if isinstance(module, nn.RNNBase):
                module._init_flat_weights()
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.names and self.saved:
            module._parameters.update(self.saved.pop())
            if isinstance(module, nn.RNNBase):
                module._init_flat_weights()


def apply_policy(model: nn.Module, dtypes: Mapping[str, str]) -> list[RemovableHandle]:
    """Make every module of ``model`` compute in ``dtypes[name]`` (from :func:`resolve`).

    Hooks go on modules that own parameters and on modules whose dtype differs from their parent's
    (the boundaries where activations change dtype). A policy applied before is removed first.
    Returns the hook handles.
    """
    remove_policy(model)
    handles: list[RemovableHandle] = []
    for name, module in model.named_modules():
        dtype = dtypes[name]
        parent = dtypes[name.rpartition(".")[0]] if name else dtype
        owns = any(True for _ in module.parameters(recurse=False))
        if not owns and dtype == parent:
            continue
        cast = _ModuleCast(module, DTYPES[dtype])
        handles.append(module.register_forward_pre_hook(cast.before, with_kwargs=True))
        handles.append(module.register_forward_hook(cast.after, with_kwargs=True, always_call=True))
    model._commstrats_casts = handles  # type: ignore[assignment]
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):  # tokens travel to the experts in the dtype they compute in
            module.dispatch_dtype = DTYPES[dtypes[f"{name}.experts" if name else "experts"]]
    return handles


def remove_policy(model: nn.Module) -> None:
    """Undo :func:`apply_policy`: every module computes in its parameters' dtype again."""
    for handle in getattr(model, "_commstrats_casts", ()):
        handle.remove()
    model._commstrats_casts = []  # type: ignore[assignment]
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.dispatch_dtype = None
