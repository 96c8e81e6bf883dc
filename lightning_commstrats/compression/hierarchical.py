"""A two-level all-reduce for clusters of groups: fast links inside a group, slow links between groups.

A flat ring over ``N = G x g`` ranks (``G`` groups of ``g``, ranks of a group adjacent) sends each
rank's ``2 (N - 1) / N`` of the buffer to its neighbour, and the ring's edge that leaves a group
carries all of it: each group's uplink moves ``2 (N - 1) / N K`` bytes for a buffer of ``K``.
:class:`TwoLevelAllReduce` averages in three steps instead:

1. a reduce-scatter inside the group: rank ``i`` of a group holds the group's sum of chunk ``i``
   (``K / g``), over fast links;
2. an all-reduce of that chunk across the groups, among the ranks with the same index ``i``: the
   slow hop, each rank sending ``2 (G - 1) / G`` of ``K / g``; optionally quantized to
   ``slow_bits`` per value (per-column scales, error feedback: what the quantization loses is
   added to the next call's chunk, as 1-bit SGD does);
3. an all-gather inside the group.

A group's uplink then carries ``g x 2 (G - 1) / G x K / g = 2 (G - 1) / G K`` (``K`` for two groups
against ``1.5 K`` for the flat ring of 4 ranks), divided by ``32 / slow_bits`` when quantized. In
fp32 the result equals the flat average up to the order of the float sums.

A quantized hop keys each residual by the :class:`~lightning_commstrats.buckets.BucketKey` of its
bucket (the tensors' names), never by a size, and refuses a key reused for other tensors. Built with
``hold=True`` (a strategy's gradient exchange), the new residuals of every call wait for the step's
decision: :meth:`SlowHop.commit` when the step runs, :meth:`SlowHop.discard` when every rank skips
it, so a skipped step advances no residual. No Lightning here.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor

from lightning_commstrats.buckets import BucketKey, check_residuals, residual_home
from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.aggregation import QuantizedAllReduce
from lightning_commstrats.compression.quantizers import ColumnCodec
from lightning_commstrats.topology import Topology

log = logging.getLogger(__name__)

SLOW_BITS = (1, 2, 4, 8, 16, 32)
COLUMN = 256  # values per quantized column on the slow hop (one scale pair each)


def check_slow_bits(slow_bits: int) -> None:
    """``slow_hop_bits`` must be one of :data:`SLOW_BITS`."""
    if isinstance(slow_bits, bool) or slow_bits not in SLOW_BITS:
        raise ValueError(f"slow_hop_bits={slow_bits!r} is not supported; choose one of {SLOW_BITS}")


def group_layout(world_size: int, group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The groups (consecutive ranks) and the cross-group rings (ranks with the same index), as the
    run's :class:`~lightning_commstrats.topology.Topology` has them."""
    topology = Topology(world_size, group_size)
    return topology.groups(), topology.across()


class TwoLevelAllReduce:
    """Average flat buffers over ranks in groups: reduce-scatter inside, all-reduce across, all-gather inside.

    Args:
        comm: the communicator of all ranks (every rank builds this object, in the same order).
        group_size: ranks per group (consecutive ranks: a node, a supernode).
        slow_bits: bits per value on the slow hop (32: fp32; 16, 8, 4, 2, 1: quantized with error
            feedback, the residuals kept per bucket, see :meth:`state_dict`).
        hold: keep each call's new residuals until :meth:`commit` (or drop them at :meth:`discard`);
            default False: they are kept at once.
        residuals: where the slow hop's residuals wait between calls: ``"device"`` (default) or
            ``"host"`` (see :attr:`SlowHop.residuals`).
    """

    def __init__(
        self, comm: Communicator, group_size: int, slow_bits: int = 32, *, hold: bool = False, residuals: str = "device"
    ) -> None:
        check_slow_bits(slow_bits)
        check_residuals(residuals)
        groups, across = group_layout(comm.world_size, group_size)
        self.comm = comm
        self.group_size = group_size
        self.num_groups = comm.world_size // group_size
        self.slow_bits = slow_bits
        self.inner = comm.new_subgroups(groups)
        self.outer = comm.new_subgroups(across)
        self.slow = SlowHop(self.outer, slow_bits, hold=hold, residuals=residuals)

    def __repr__(self) -> str:
        return (
            f"TwoLevelAllReduce({self.num_groups} groups of {self.group_size}, slow hop "
            f"{'fp32' if self.slow_bits == 32 else f'{self.slow_bits}-bit'})"
        )

    def __call__(self, flat: Tensor, tag: str, key: BucketKey) -> Tensor:
        """The average over all ranks of the 1-D ``flat`` (a new tensor, identical on every rank).
        ``key`` names the bucket (its tensors) whose quantization residual carries over."""
        n = flat.numel()
        g, world = self.group_size, self.comm.world_size
        if world == 1:
            return flat.clone()
        chunk = -(-n // g)
        if self.slow.quantized is not None:  # the slow hop's chunk is cut into columns of COLUMN values
            chunk = -(-chunk // COLUMN) * COLUMN
        if chunk * g == n:  # no copy of the buffer when the group divides it
            padded = flat
        else:
            padded = flat.new_zeros(chunk * g)
            padded[:n] = flat
        part = self.inner.reduce_scatter(padded, "sum", tag=tag)  # fast: this group's sum of chunk i
        part = self.slow.sum(part, tag, key)  # a residual per bucket
        full = self.inner.all_gather(part.contiguous(), tag=tag).reshape(-1)  # fast
        return full[:n].div_(world)

    @property
    def nonfinite(self) -> list[str]:
        """Buckets whose last quantized slow hop was not finite (their residuals were kept)."""
        return self.slow.nonfinite

    @property
    def residuals(self) -> str:
        """Where the slow hop's residuals wait between calls (see :attr:`SlowHop.residuals`)."""
        return self.slow.residuals

    @residuals.setter
    def residuals(self, residuals: str) -> None:
        self.slow.residuals = residuals

    def commit(self) -> None:
        """Keep the residuals held since the last decision (``hold=True``)."""
        self.slow.commit()

    def discard(self) -> None:
        """Drop the residuals held since the last decision: the old ones stay."""
        self.slow.discard()

    # ------------------------------------------------------------------ rank-local state

    def state_dict(self) -> dict[str, Any]:
        """The slow hop's error-feedback residuals per bucket (empty in fp32)."""
        return self.slow.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.slow.load_state_dict(state)

    def reset(self) -> None:
        self.slow.reset()


class SlowHop:
    """The sum of a flat buffer over the ranks of ``across`` (one rank of every group): fp32, or
    ``slow_bits`` per value with per-column scales and error feedback (a residual per bucket, keyed
    by its :class:`~lightning_commstrats.buckets.BucketKey`; with ``hold``, kept only at :meth:`commit`).

    The hop between groups of :class:`TwoLevelAllReduce` (after its reduce-scatter inside the
    group), and, called as an average, the whole gradient exchange of a sharded run
    (``shard="fsdp"``), where FSDP2 has reduce-scattered inside the group already.
    """

    def __init__(
        self, across: Communicator, slow_bits: int = 32, *, hold: bool = False, residuals: str = "device"
    ) -> None:
        check_slow_bits(slow_bits)
        check_residuals(residuals)
        self.across = across
        self.slow_bits = slow_bits
        self.hold = hold
        self._owners: dict[str, tuple[str, ...]] = {}  # residual key -> the tensors it belongs to
        self._held: list[tuple[dict[str, Tensor], dict[str, Tensor]]] = []
        self.quantized = (
            QuantizedAllReduce(ColumnCodec(slow_bits), across, tag="slow_quantized")
            if slow_bits < 32 and across.world_size > 1
            else None
        )
        self.residuals = residuals

    @property
    def residuals(self) -> str:
        """Where the error-feedback residuals wait between calls: ``"device"`` (where they are made) or
        ``"host"`` (pinned host memory on CUDA, each brought to the device for its bucket's call and
        parked again at :meth:`commit`; see :class:`~lightning_commstrats.buckets.Parking`). Set it
        before the first call: residuals already kept move at their next commit."""
        return self._residuals

    @residuals.setter
    def residuals(self, residuals: str) -> None:
        check_residuals(residuals)
        self._residuals = residuals
        if self.quantized is not None:
            self.quantized.home = residual_home(residuals)

    def __repr__(self) -> str:
        hop = "fp32" if self.slow_bits == 32 else f"{self.slow_bits}-bit"
        return f"SlowHop({self.across.world_size} groups, {hop})"

    def residual_key(self, key: BucketKey) -> str:
        """The residual's key for bucket ``key``; ``ValueError`` when it names other tensors than
        the first time (two buckets would share one error feedback)."""
        if not isinstance(key, BucketKey):
            raise TypeError(f"the slow hop keys residuals by a bucket's BucketKey (its tensors' names), got {key!r}")
        name = key.residual_key
        owners = self._owners.setdefault(name, key.names)
        if owners != key.names:
            raise ValueError(
                f"residual key {name!r} was made for tensors {list(owners)} and now for {list(key.names)}:"
                " two buckets must not share an error-feedback residual"
            )
        return name

    def sum(self, part: Tensor, tag: str, key: BucketKey) -> Tensor:
        """The sum of ``part`` over the groups (in place in fp32; a new tensor when quantized, whose
        length must then be a multiple of :data:`COLUMN`). ``key`` names the bucket: its residual."""
        name = self.residual_key(key)
        if self.across.world_size == 1:
            return part
        if self.quantized is None:
            return self.across.all_reduce(part, "sum", tag=tag)
        # the average over the groups, times their number: the sum
        matrix = part.float().view(COLUMN, -1)
        out = self.quantized({name: matrix}, commit=not self.hold)[name]
        if self.hold and (pending := self.quantized.take_pending()) is not None:
            self._held.append(pending)
        return out.reshape(-1).to(part.dtype) * self.across.world_size

    def commit(self) -> None:
        """Keep every residual held since the last decision (the step runs)."""
        if self.quantized is not None:
            for pending in self._held:
                self.quantized.keep(pending)
        self._held.clear()

    def discard(self) -> None:
        """Drop every residual held since the last decision (every rank skips the step)."""
        self._held.clear()

    def __call__(self, flat: Tensor, tag: str, key: BucketKey) -> Tensor:
        """The average of the 1-D ``flat`` over the groups (the ``average`` of a fused all-reduce)."""
        n = flat.numel()
        if self.across.world_size == 1:
            return flat
        if self.quantized is None:
            return self.across.all_reduce(flat, "avg", tag=tag)
        padded = flat.new_zeros(-(-n // COLUMN) * COLUMN)
        padded[:n] = flat
        return self.sum(padded, tag, key)[:n].div_(self.across.world_size)

    @property
    def nonfinite(self) -> list[str]:
        """Buckets whose last quantized hop was not finite (their residuals were kept)."""
        return [] if self.quantized is None else list(self.quantized.nonfinite)

    def state_dict(self) -> dict[str, Any]:
        """The error-feedback residuals per bucket (empty in fp32; only kept ones, never held ones)."""
        return {} if self.quantized is None else self.quantized.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore residuals. Those saved under a size alone (``grad/<numel>``, before buckets were
        keyed by their tensors) could belong to any bucket of that length: they restart at zero."""
        if self.quantized is None or not state:
            return
        by_name = {
            kind: {k: v for k, v in state.get(kind, {}).items() if ":" in k} for kind in ("residuals", "residuals2")
        }
        dropped = sorted(k for kind in ("residuals", "residuals2") for k in state.get(kind, {}) if ":" not in k)
        if dropped:
            log.warning("slow hop: residuals keyed by size only (%s) restart at zero", ", ".join(dropped[:4]))
        self.quantized.load_state_dict(by_name)
        self._held.clear()

    def reset(self) -> None:
        self._held.clear()
        if self.quantized is not None:
            self.quantized.reset()
