"""FSDP2 inside a group as the advisor counts it: the units, the bytes a rank sends inside its group per
step, and what it holds on top of the shards in each phase of a step (:func:`fsdp_traffic`,
:func:`fsdp_gathers`; :mod:`~lightning_commstrats.advisor.peak` adds them to a rank's peak).

The in-group traffic of ``shard="fsdp"`` over groups of ``g`` ranks, per optimizer step and rank (one
forward and one backward; FSDP2's ring collectives over the group):

- every FSDP module (each unit of the shard policy, and the root with the tensors no unit holds) is
  all-gathered before its forward, and again before its backward if it was resharded after forward
  (``reshard_after_forward=None``, FSDP2's default as the package applies it: every unit is, the root
  is not; ``True``: all are; ``False``: none is);
- every gradient is reduce-scattered once.

FSDP2 pads each tensor's first dimension to a multiple of ``g`` (``l_t = ceil(d0 / g) * rest`` values a
rank), so with ``G`` the values all-gathered a step (every module's ``sum l_t`` once, plus the
regathered ones again), and ``L`` every tensor's ``sum l_t``::

    all-gather bytes     = (g - 1) * G * gather_bytes
    reduce-scatter bytes = (g - 1) * L * reduce_bytes

that is ``(g - 1) / g`` of what is gathered or reduced whole (``gather_bytes``, ``reduce_bytes``: the
element sizes of FSDP2's ``MixedPrecisionPolicy`` ``param_dtype`` and ``reduce_dtype``, the parameters'
dtype without one). ``tests/test_advisor_sites.py`` checks it against what FSDP2 hands its collectives
on two gloo ranks. Not counted: gradient accumulation (FSDP2 reduce-scatters every micro-batch unless
told not to), and any overlap with compute (FSDP2 prefetches the next unit's gather while one computes:
the advisor's in-group seconds are an upper bound).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

RESHARD = (None, True, False)


@dataclass(frozen=True)
class FsdpUnits:
    """Which tensors each FSDP2 module gathers.

    Attributes:
        units: each unit's tensors, as indices into the model's parameter shapes (a tensor belongs to the
            innermost unit that holds it).
        root: the tensors no unit holds: the root module's (tied embeddings stay there).
        assumed: ``True`` when guessed from the shapes alone (:func:`units_by_size`).
    """

    units: tuple[tuple[int, ...], ...]
    root: tuple[int, ...]
    assumed: bool = False


@dataclass(frozen=True)
class FsdpTraffic:
    """Bytes one rank sends inside its group per optimizer step (see the module docstring)."""

    all_gather: int
    reduce_scatter: int

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter


def fsdp_units(module: nn.Module, policy: Any = None) -> FsdpUnits:
    """The units ``policy`` (a :class:`~lightning_commstrats.sharding.ShardPolicy`, a dict of its fields or
    ``None``: the default) makes of ``module``, as indices into its trainable parameters in registration
    order, tied ones once (the order of :class:`~lightning_commstrats.cost_model.ModelShape`). Works on a
    module built on the meta device."""
    from lightning_commstrats.sharding.policy import ShardPolicy

    policy = ShardPolicy.of(policy)
    params = [p for p in {id(p): p for p in module.parameters()}.values() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    taken: set[int] = set()
    units = []
    for _, unit in policy.select(module):  # innermost first: an outer unit gathers what is left to it
        own = tuple(index[id(p)] for p in unit.parameters() if id(p) in index and index[id(p)] not in taken)
        taken.update(own)
        if own:
            units.append(own)
    root = tuple(i for i in range(len(params)) if i not in taken)
    return FsdpUnits(tuple(units), root)


def units_by_size(shapes: Sequence[Sequence[int]], min_unit_numel: int = 1 << 16) -> FsdpUnits:
    """A guess from the shapes alone: every tensor of at least ``min_unit_numel`` values a unit of its
    own, the rest with the root. The traffic does not depend on the grouping (only on what the root
    keeps); the transient memory does, and this guess makes the largest unit one tensor, where a real
    policy's (a Transformer block) holds several: a low estimate. Give the units when known."""
    big = tuple((i,) for i, s in enumerate(shapes) if math.prod(s) >= min_unit_numel)
    taken = {u[0] for u in big}
    return FsdpUnits(big, tuple(i for i in range(len(shapes)) if i not in taken), assumed=True)


def check_units(units: FsdpUnits, tensors: int) -> None:
    seen = [i for u in units.units for i in u] + list(units.root)
    if sorted(seen) != list(range(tensors)):
        raise ValueError(
            f"units must name every one of the model's {tensors} parameter tensors once (in units or the root),"
            f" got units={units.units}, root={units.root}"
        )


def local_numel(shape: Sequence[int], group: int) -> int:
    """The values of one rank's FSDP2 shard of a tensor of ``shape`` over ``group`` ranks (its first
    dimension cut in ``group`` chunks, the last padded)."""
    if not shape:
        return 1
    return -(-int(shape[0]) // group) * math.prod(int(d) for d in shape[1:])


def fsdp_traffic(
    shapes: Sequence[Sequence[int]],
    units: FsdpUnits,
    group: int,
    *,
    gather_bytes: int = 4,
    reduce_bytes: int = 4,
    reshard_after_forward: bool | None = None,
) -> FsdpTraffic:
    """Bytes one rank sends inside a group of ``group`` ranks per optimizer step under FSDP2: the
    all-gathers and the reduce-scatter of the module docstring's formula."""
    if reshard_after_forward not in RESHARD:
        raise ValueError(f"reshard_after_forward must be None, True or False, got {reshard_after_forward!r}")
    check_units(units, len(shapes))
    local = [local_numel(s, group) for s in shapes]
    every = sum(local)
    if reshard_after_forward is None:
        again = sum(local[i] for u in units.units for i in u)
    else:
        again = every if reshard_after_forward else 0
    return FsdpTraffic((group - 1) * (every + again) * gather_bytes, (group - 1) * every * reduce_bytes)


@dataclass(frozen=True)
class FsdpGathers:
    """Bytes FSDP2 holds on top of a rank's shards in each phase of a step (:func:`fsdp_gathers`).

    Attributes:
        forward: at the end of forward: the root's gathered parameters (kept from forward under the
            default) and the unit computing; with ``reshard_after_forward=False`` every unit, the whole model.
        backward: while a unit is differentiated: the root gathered with its unsharded gradients (the tied
            embedding's come first in backward and are reduce-scattered last), the unit's gathered
            parameters and unsharded gradients, and the next unit's parameters prefetched (FSDP2 prefetches
            one unit ahead in backward); with ``reshard_after_forward=False`` the whole model gathered
            instead of the two units' parameters.
        backward_end: the root's reduce-scatter, the backward's last: its gathered parameters, its
            unsharded gradients and their copy into the reduce-scatter's input.
    """

    forward: int
    backward: int
    backward_end: int

    @property
    def most(self) -> int:
        return max(self.forward, self.backward, self.backward_end)


def fsdp_gathers(
    shapes: Sequence[Sequence[int]],
    units: FsdpUnits,
    group: int,
    *,
    gather_bytes: int = 4,
    reduce_bytes: int = 4,
    reshard_after_forward: bool | None = None,
) -> FsdpGathers:
    """What FSDP2 over groups of ``group`` ranks holds on top of the shards, phase by phase
    (:class:`FsdpGathers`), in ``gather_bytes`` per gathered value and ``reduce_bytes`` per unsharded
    gradient value; whole sizes are padded as FSDP2 pads them (``group * ceil(d0 / group)`` rows).
    Read from FSDP2's schedule; ``peak_phases`` adds them to the phases of a step."""
    if reshard_after_forward not in RESHARD:
        raise ValueError(f"reshard_after_forward must be None, True or False, got {reshard_after_forward!r}")
    check_units(units, len(shapes))
    whole = [group * local_numel(s, group) for s in shapes]
    root = sum(whole[i] for i in units.root)
    largest = max((sum(whole[i] for i in u) for u in units.units), default=0)
    g, r = gather_bytes, reduce_bytes
    end = root * (g + 2 * r)
    if reshard_after_forward is False:
        model = sum(whole) * g
        return FsdpGathers(model, model + (root + largest) * r, end)
    return FsdpGathers((root + largest) * g, root * (g + r) + largest * (2 * g + r), end)


def fsdp_transient(
    shapes: Sequence[Sequence[int]],
    units: FsdpUnits,
    group: int,
    *,
    gather_bytes: int = 4,
    reduce_bytes: int = 4,
    reshard_after_forward: bool | None = None,
) -> int:
    """The most FSDP2 holds on top of the shards in any phase of a step (:func:`fsdp_gathers`)."""
    return fsdp_gathers(
        shapes,
        units,
        group,
        gather_bytes=gather_bytes,
        reduce_bytes=reduce_bytes,
        reshard_after_forward=reshard_after_forward,
    ).most
