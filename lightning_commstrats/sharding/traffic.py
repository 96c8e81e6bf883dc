"""FSDP2's own collectives inside a group, counted in the run's communication statistics.

FSDP2 all-gathers a unit's parameters before the unit runs (in forward, and again in backward when
the unit freed them) and reduce-scatters its gradients after backward, over the ranks of one group.
Those bytes never pass through the package's communicator, so nothing counted them. Through FSDP2's
public hooks for its collectives (``FSDPModule.set_custom_all_gather`` and
``set_custom_reduce_scatter``) every unit's collectives run as FSDP2's default ones do
(``all_gather_into_tensor``, ``reduce_scatter_tensor`` on the group FSDP2 hands over) and are charged
to :data:`GATHER_TAG` and :data:`REDUCE_TAG` as ring collectives: an all-gather in which each rank
contributes ``n`` elements sends ``(g - 1) n`` of them from each rank, a reduce-scatter of ``g c``
elements ``(g - 1) c`` (:mod:`lightning_commstrats.comm.wire`), in the dtype they travel in (a unit
gathered in half sends half the bytes).

Seconds are not charged: FSDP2 overlaps these collectives with computation (prefetching the next
unit, reducing in backward) and waits for them inside the step, so the step's computation time
holds them. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_commstrats.comm import CommStats
from lightning_commstrats.comm.wire import all_gather_bytes, reduce_scatter_bytes

GATHER_TAG = "fsdp_gather"
REDUCE_TAG = "fsdp_reduce"
FSDP_TAGS = (GATHER_TAG, REDUCE_TAG)


class _Allocate:
    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


# torch 2.13 names these collectives *_single and warns (FutureWarning, once per rank) at the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CountedAllGather(_Allocate):
    """FSDP2's all-gather of a unit's flat shards, charged to ``stats`` under :data:`GATHER_TAG`."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False) -> Any:
        work = _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        self.stats.record(GATHER_TAG, all_gather_bytes(input_tensor.numel(), input_tensor.element_size(), world), 0.0)
        return work


class CountedReduceScatter(_Allocate):
    """FSDP2's reduce-scatter of a unit's flat gradients, charged under :data:`REDUCE_TAG`."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        nbytes = reduce_scatter_bytes(input_tensor.numel(), input_tensor.element_size(), world)
        self.stats.record(REDUCE_TAG, nbytes, 0.0)
        return work


def count_fsdp_traffic(root: nn.Module, stats: CommStats) -> int:
    """Route the collectives of every FSDP2 module under ``root`` (itself included) through the
    counted ones above; returns how many modules were routed."""
    from torch.distributed.fsdp import FSDPModule

    gather, reduce = CountedAllGather(stats), CountedReduceScatter(stats)
    routed = 0
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)  # type: ignore[arg-type]
            module.set_custom_reduce_scatter(reduce)  # type: ignore[arg-type]
            routed += 1
    return routed
