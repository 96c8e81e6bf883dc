"""The layout of a run's ranks, in one place: groups on fast links, what happens inside a group, and
what crosses between groups.

A run of ``N`` ranks is cut into ``G = N / g`` groups of ``g`` consecutive ranks (a node, a
supernode). Inside a group the ranks either each hold the whole model (``inside="replicate"``; with
``g > 1`` a gradient all-reduce goes in two levels, reduce-scatter inside and all-gather inside) or
shard it with FSDP2 (``inside="shard"``). Between groups, rank ``i`` of every group exchanges with rank
``i`` of the others: the *across* channels, whose ranks hold the same tensors. An expert dimension
(experts spread over the ranks of a group) is the next dimension this object is to carry.

:class:`Topology` validates the dimensions and answers every question about them (which group a rank
is in, which ranks hold the same tensors, how many models the scheme averages, how to name the
layout), so that the strategy, the slow hop, the sharding and the replicas read one answer; it
builds no channel itself (the communicators do). As torchtitan's ``ParallelDims``. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REPLICATE = "replicate"
SHARD = "shard"
INSIDE = (REPLICATE, SHARD)


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks in groups of ``group_size`` consecutive ranks, ``inside`` each group
    :data:`REPLICATE` (whole models) or :data:`SHARD` (FSDP2).

    Raises ``ValueError`` naming the setting when the sizes do not fit.
    """

    world_size: int
    group_size: int = 1
    inside: str = REPLICATE

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"the number of ranks must be a positive int, got {self.world_size!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")
        if self.world_size % self.group_size:
            raise ValueError(f"group_size={self.group_size} must divide the number of ranks, {self.world_size}")
        if self.inside not in INSIDE:
            raise ValueError(f"inside={self.inside!r} is not one of {INSIDE}")

    @classmethod
    def of(cls, world_size: int, devices_per_node: int, group_size: int | str | None, shard: Any) -> Topology:
        """The topology of a strategy's settings: ``group_size`` an int, ``"node"`` (the devices per
        node) or ``None`` (no groups: one group of one rank each unsharded, one group of the node
        when sharded, as ``shard="fsdp"`` defaults to ``"node"``)."""
        if group_size is None:
            group_size = "node" if shard is not None else 1
        size = devices_per_node if group_size == "node" else group_size
        return cls(world_size, size, SHARD if shard is not None else REPLICATE)

    # ------------------------------------------------------------------ dimensions

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    @property
    def sharded(self) -> bool:
        return self.inside == SHARD

    @property
    def num_models(self) -> int:
        """The models a scheme averages: every rank's, or every group's when sharded."""
        return self.num_groups if self.sharded else self.world_size

    @property
    def two_level(self) -> bool:
        """Whether a replicated run's gradients go in two levels (groups of more than one rank, more
        than one rank in all)."""
        return not self.sharded and self.group_size > 1 and self.world_size > 1

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    def index_of(self, rank: int) -> int:
        """``rank``'s place in its group: the across channel it belongs to."""
        return rank % self.group_size

    def groups(self) -> list[list[int]]:
        """The groups, consecutive ranks each."""
        g = self.group_size
        return [list(range(s, s + g)) for s in range(0, self.world_size, g)]

    def across(self) -> list[list[int]]:
        """The across channels: rank ``i`` of every group, for every ``i``."""
        return [list(range(i, self.world_size, self.group_size)) for i in range(self.group_size)]

    def holders(self, rank: int) -> list[int]:
        """The ranks that hold the same tensors as ``rank`` and exchange them: every rank when the
        model is whole on each, the same rank of every group when sharded."""
        return self.across()[self.index_of(rank)] if self.sharded else list(range(self.world_size))

    def describe(self) -> str:
        """The layout in words (refusals that compare two layouts name both this way)."""
        if self.sharded:
            return f"{self.world_size} ranks, shard='fsdp' in {self.num_groups} group(s) of {self.group_size}"
        if self.two_level:
            return f"{self.world_size} ranks, unsharded, gradients in two levels over groups of {self.group_size}"
        return f"{self.world_size} ranks, unsharded"
