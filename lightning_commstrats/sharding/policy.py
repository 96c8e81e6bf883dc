"""Which modules FSDP2 shards as units, and applying ``fully_shard`` by that choice.

FSDP2 (``torch.distributed.fsdp.fully_shard``) gathers a unit's parameters just before the unit
runs and frees them after: the peak of gathered parameters is one unit, not the model. Units are
modules; the root module takes whatever parameters no unit holds. The policy says which modules
are units:

- ``units=None`` (default): by size. Every module that is an element of a ``ModuleList`` or
  ``Sequential`` (the blocks of a Transformer, the layers of a stacked RNN) or an ``Embedding``, and
  that holds at least ``min_unit_numel`` parameter values, is a unit.
- ``units=[...]``: module classes (``nn.TransformerEncoderLayer``, or a class name such as
  ``"Block"``) and ``fnmatch`` patterns of module names (``"model.layers.*"``).

A module that shares a parameter with a module outside it (tied input and output embeddings, as
GPT-2 and the recipe's LSTM have) is never a unit: the tied tensor stays with the root, one
parameter sharded once, and the tie is kept. No Lightning here.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SETTINGS = ("units", "min_unit_numel", "reshard_after_forward", "activation_checkpointing")
GATHER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


@dataclass
class ShardPolicy:
    """Which modules are units of sharding (see the module docstring).

    Args:
        units: ``None`` (by size) or a list of module classes, class names and ``fnmatch`` patterns of
            module names (as ``named_modules`` gives them).
        min_unit_numel: with ``units=None``, the fewest parameter values a unit holds (default 65,536:
            smaller modules stay with their parent, each unit is one all-gather and one reduce-scatter).
        reshard_after_forward: ``None`` (default, FSDP2's own default): every unit frees its gathered
            parameters after its forward and gathers them again in backward, while the root keeps its
            own gathered until backward (it is needed first there: one all-gather a step fewer).
            ``True``: every module frees them, the root too (least memory). ``False``: every module
            keeps them until backward (no all-gather in backward, most memory). A periodic scheme
            that swaps in the global model for validation reshards the model first.
        activation_checkpointing: ``False`` (default) or ``True``: every unit keeps only its inputs
            from forward and computes its activations again in backward (``torch.utils.checkpoint``,
            non-reentrant), after FSDP2 has gathered its parameters for backward. The activations
            held between forward and backward fall from every unit's to one unit's at a time, for
            one more forward of each unit (about a third more computation). The root is not
            checkpointed.
    """

    units: Sequence[Any] | None = None
    min_unit_numel: int = 1 << 16
    reshard_after_forward: bool | None = None
    activation_checkpointing: bool = False
    _classes: tuple[type, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.min_unit_numel, bool) or not isinstance(self.min_unit_numel, int) or self.min_unit_numel < 1:
            raise ValueError(f"shard_policy.min_unit_numel must be an int >= 1, got {self.min_unit_numel!r}")
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"shard_policy.reshard_after_forward must be None, True or False, got {self.reshard_after_forward!r}"
            )
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(
                f"shard_policy.activation_checkpointing must be True or False, got {self.activation_checkpointing!r}"
            )
        if self.units is not None:
            if isinstance(self.units, (str, type)) or not isinstance(self.units, Sequence):
                self.units = [self.units]
            for unit in self.units:
                if not isinstance(unit, str) and not (isinstance(unit, type) and issubclass(unit, nn.Module)):
                    raise ValueError(
                        f"shard_policy.units holds {unit!r}: give module classes, class names or name patterns"
                    )

    @classmethod
    def of(cls, policy: ShardPolicy | dict[str, Any] | None) -> ShardPolicy:
        """A policy from ``None`` (the default), a dict of its fields (a config file) or itself."""
        if policy is None:
            return cls()
        if isinstance(policy, ShardPolicy):
            return policy
        if isinstance(policy, dict):
            unknown = sorted(set(policy) - set(SETTINGS))
            if unknown:
                raise ValueError(f"shard_policy got unknown setting(s) {unknown}; it takes {', '.join(SETTINGS)}")
            return cls(**policy)
        raise ValueError(f"shard_policy must be a ShardPolicy, a dict or None, got {type(policy).__name__}")

    def is_unit(self, name: str, module: nn.Module, parent: nn.Module | None) -> bool:
        """Whether ``module`` (named ``name`` in the root, child of ``parent``) is a unit by this policy."""
        if self.units is None:
            listed = isinstance(parent, (nn.ModuleList, nn.Sequential)) or isinstance(module, nn.Embedding)
            return listed and sum(p.numel() for p in module.parameters()) >= self.min_unit_numel
        for unit in self.units:
            if isinstance(unit, type):
                if isinstance(module, unit):
                    return True
            elif type(module).__name__ == unit or fnmatch.fnmatchcase(name, unit):
                return True
        return False

    def select(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        """The units of ``root``, innermost first (the order ``fully_shard`` wants), leaving out any
        module whose parameters are also reachable from outside it (tied weights)."""
        parents: dict[str, nn.Module] = {}
        for name, module in root.named_modules():
            for child_name, _ in module.named_children():
                parents[f"{name}.{child_name}" if name else child_name] = module
        tied = _tied_outside(root)
        chosen = []
        for name, module in root.named_modules():
            if not name or not self.is_unit(name, module, parents.get(name)):
                continue
            if name in tied:
                continue  # tied to a module outside: the root keeps it
            chosen.append((name, module))
        return list(reversed(chosen))


def apply_fsdp(
    module: nn.Module,
    mesh: Any,
    policy: ShardPolicy,
    dtypes: Mapping[str, str] | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> list[str]:
    """``fully_shard`` every unit of ``module`` by ``policy`` (innermost first), then ``module`` itself
    as the root, over the 1-D ``mesh`` (the ranks of one group); the LightningModule's step methods
    become forward methods of the root, so FSDP2 gathers and frees around them. With ``dtypes`` (a
    per-module precision policy, module name -> ``"fp32"``/``"bf16"``/``"fp16"``), every unit gets an
    FSDP2 ``MixedPrecisionPolicy`` (see :func:`plan_units`). ``ignored`` parameters stay whole and
    unmanaged (FSDP2's ``ignored_params``). Returns the units' names.
    Raises ``ValueError`` when the model has no parameter to shard."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not any(True for _ in module.parameters()):
        raise ValueError(f"shard='fsdp' needs a model with parameters; {type(module).__name__} has none to shard")
    plan = plan_units(module, policy, dtypes, ignored)
    if policy.activation_checkpointing:
        for _, unit in policy.select(module):
            checkpoint_activations(unit)
    for _, unit, dtype in plan:
        mp = MixedPrecisionPolicy() if dtype is None else _mixed(dtype)
        mine = {p for p in unit.parameters() if p in ignored} if ignored else None
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=policy.reshard_after_forward,
            mp_policy=mp,
            ignored_params=mine or None,
        )
    register_step_methods(module)
    return [name for name, _, _ in plan if name]


def checkpoint_activations(module: nn.Module) -> None:
    """Make ``module`` recompute its activations in backward instead of keeping them
    (``torch.utils.checkpoint``, non-reentrant). Its ``forward`` is wrapped on the instance: names,
    hooks and FSDP2's gathers around the call stay as they are, and in backward the recomputation
    runs once FSDP2 has gathered the parameters again (its hook on the unit's outputs fires first)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    if getattr(module, "_commstrats_checkpointed", False):
        return
    forward = module.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed  # type: ignore[method-assign]
    module._commstrats_checkpointed = True  # type: ignore[assignment]


def _mixed(dtype: str) -> Any:
    """A unit gathered in ``dtype``, its gradients reduced in float32 (the masters stay float32); the
    inputs are left to the precision policy's own casts at module boundaries."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=GATHER_DTYPES[dtype], reduce_dtype=torch.float32, cast_forward_inputs=False)


def plan_units(
    root: nn.Module,
    policy: ShardPolicy,
    dtypes: Mapping[str, str] | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> list[tuple[str, nn.Module, str | None]]:
    """``(name, module, gather dtype)`` for every unit of ``root``, innermost first, the root last.

    Without ``dtypes`` the units are the policy's and the dtype is ``None`` (FSDP2's default: as the
    parameters are). With them, a unit is gathered in the dtype its modules compute in, so that a
    half unit's all-gather carries half the bytes and its gathered parameters take half the memory
    (FSDP2's ``MixedPrecisionPolicy``); its gradients are reduced in float32. A unit whose modules
    compute in different dtypes (a block whose norm stays float32 while its attention and FFN run
    in half) takes the dtype that holds most of its parameters, and each module of another dtype
    becomes a unit of its own, gathered in its dtype. A module that cannot be a unit (it shares a
    tied weight with a module outside it) keeps its unit in float32: its weights are then gathered
    whole and cast as the module runs, never rounded for it.

    A module made a unit of its own is gathered by its own forward hook: its parent must call it
    (``self.norm(x)``), not read its parameters (``F.layer_norm(x, ..., self.norm.weight)``), as
    FSDP2 requires of every unit. The package's models do so (the MoE layer calls its router)."""
    units: list[tuple[str, nn.Module]] = [*policy.select(root), ("", root)]
    if dtypes is None:
        return [(name, unit, None) for name, unit in units]
    names = {name for name, _ in units}

    def unit_of(name: str) -> str:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name

    managed: dict[str, list[tuple[str, nn.Module]]] = {name: [] for name in names}
    for name, module in root.named_modules():
        if any(p not in (ignored or ()) for p in module.parameters(recurse=False)):  # FSDP2 gathers it
            managed[unit_of(name)].append((name, module))
    outside = _tied_outside(root)
    plan: list[tuple[str, nn.Module, str | None]] = []
    for name, unit in units:
        mine = managed[name]
        share: dict[str, int] = {}
        for m_name, m in mine:
            held = sum(p.numel() for p in m.parameters(recurse=False) if p not in (ignored or ()))
            share[dtypes[m_name]] = share.get(dtypes[m_name], 0) + held
        dtype = max(share, key=share.__getitem__) if share else "fp32"
        rest = set()
        split: list[str] = []
        for m_name, m in mine:
            if dtypes[m_name] == dtype or any(m_name.startswith(done + ".") for done in split):
                continue  # in the unit's dtype, or inside a module already made a unit of its own
            inner = [n for n, _ in mine if n == m_name or n.startswith(m_name + ".")]
            if m_name and m_name not in outside and all(dtypes[n] == dtypes[m_name] for n in inner):
                plan.append((m_name, m, dtypes[m_name]))
                split.append(m_name)
                continue
            rest.add(dtypes[m_name])
        plan.append((name, unit, "fp32" if rest else dtype))
    return _innermost_first(plan)


def _innermost_first(plan: list[tuple[str, nn.Module, str | None]]) -> list[tuple[str, nn.Module, str | None]]:
    """``plan`` ordered so that a module comes before every module that holds it (what ``fully_shard``
    needs); the root last."""
    return sorted(plan, key=lambda item: -item[0].count(".") - (1 if item[0] else 0))


def _tied_outside(root: nn.Module) -> set[str]:
    """Names of the modules that hold a parameter some module outside them holds too (tied weights)."""
    holders: dict[int, set[str]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(name)
    tied = set()
    for name, module in root.named_modules():
        inside = {n for n, _ in module.named_modules(prefix=name, remove_duplicate=False)}
        if any(not holders[id(p)] <= inside for p in module.parameters()):
            tied.add(name)
    return tied


def register_step_methods(module: nn.Module) -> None:
    """Make the LightningModule's step methods forward methods of the FSDP2 root ``module``: its own
    parameters are gathered around a step, whichever inner module the step calls (``self.model(x)``
    in LitGPT's and most wrapped models' steps, which never runs the root's ``forward``). A root
    that ``configure_model`` did not shard is left alone."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(module, FSDPModule):
        return
    for method in STEP_METHODS:
        if callable(getattr(module, method, None)):
            register_fsdp_forward_method(module, method)
