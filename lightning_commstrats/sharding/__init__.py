"""Sharded replicas: FSDP2 inside groups of ranks, a scheme across groups, and what goes with it.

- :mod:`~lightning_commstrats.sharding.layout`: :class:`Sharding`, the component a strategy holds
  with ``shard="fsdp"`` (the ``(replicate, shard)`` mesh, the cross-group channel, local shards);
- :mod:`~lightning_commstrats.sharding.policy`: :class:`ShardPolicy`, which modules are units;
- :mod:`~lightning_commstrats.sharding.memory`: bytes per rank by kind and device, from storages;
- :mod:`~lightning_commstrats.sharding.process_memory`: what the process holds at its peak, as the
  operating system and the device count it (over the run, in training, in the sync);
- :mod:`~lightning_commstrats.sharding.checkpoint`: sharded checkpoints with
  ``torch.distributed.checkpoint`` (resume bit for bit, or onto another layout).
"""

from lightning_commstrats.sharding.layout import (
    SHARD_MODES,
    Sharding,
    check_shard,
    fsdp_available,
    is_dtensor,
    local,
)
from lightning_commstrats.sharding.memory import KINDS, format_memory, memory_by_kind, tensors_in, total_bytes
from lightning_commstrats.sharding.policy import ShardPolicy, apply_fsdp
from lightning_commstrats.sharding.process_memory import (
    ProcessMemory,
    fix_mmap_threshold,
    format_bytes,
    format_process_memory,
    format_ranks_peaks,
    host_allocator,
)

__all__ = [
    "KINDS",
    "SHARD_MODES",
    "ProcessMemory",
    "ShardPolicy",
    "Sharding",
    "apply_fsdp",
    "check_shard",
    "fix_mmap_threshold",
    "format_bytes",
    "format_memory",
    "format_process_memory",
    "format_ranks_peaks",
    "fsdp_available",
    "host_allocator",
    "is_dtensor",
    "local",
    "memory_by_kind",
    "tensors_in",
    "total_bytes",
]
