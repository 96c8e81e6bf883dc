"""The fused reductions a strategy makes, each by the route its kind of tensor fixes.

A strategy averages three kinds of tensors over ranks outside its scheme's own exchange, and each
kind has one route, a constant, never a flag a call site picks:

- :data:`GRADIENTS`: over the replicas (every rank, or with ``shard="fsdp"`` the same shard of every
  group), through the two-level all-reduce or the slow hop between groups where the strategy has
  one, which may quantize (``slow_hop_bits < 32``). Every bucket is named by a
  :class:`~lightning_commstrats.buckets.BucketKey` made from its tensors' names, which keys its
  error-feedback residual; the residuals of a step are held until the step's vote
  (:meth:`Reducer.commit` when it runs, :meth:`Reducer.discard` when every rank skips it).
- :data:`STATE`: optimizer state over the replicas, exactly (a flat all-reduce in its own type).
- :data:`BUFFERS`: module buffers, whole on every rank sharded or not, over every rank, exactly.

:class:`Reducer` is the component a :class:`~lightning_commstrats.strategies.base.CommStrategy`
holds for them, with the hop's residuals as its rank-local state. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_commstrats.buckets import BucketKey, check_residuals, residual_home
from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.exchange import BucketedAllReduce, TensorExchange
from lightning_commstrats.compression.hierarchical import SlowHop, TwoLevelAllReduce

GRADIENTS = "gradients"
STATE = "state"
BUFFERS = "buffers"
ROUTES = (GRADIENTS, STATE, BUFFERS)

Hop = TwoLevelAllReduce | SlowHop


class Reducer:
    """Averages a strategy's gradients, optimizer state and buffers in fused buckets, by route.

    Args:
        bucket_cap_mb: largest fused buffer per collective, MiB.
        residuals: where the hop's error-feedback residuals wait between steps: ``"device"`` (default)
            or ``"host"`` (pinned host memory on CUDA; see :attr:`SlowHop.residuals
            <lightning_commstrats.compression.hierarchical.SlowHop.residuals>`).
    """

    def __init__(self, bucket_cap_mb: float, residuals: str = "device") -> None:
        self.cap_bytes = int(bucket_cap_mb * 2**20)
        self.hop: Hop | None = None  # the gradients' two levels or slow hop, once connected
        self.residuals = residuals
        self._world: Communicator | None = None
        self._replicas: Communicator | None = None
        self._fused: dict[str, BucketedAllReduce] = {}
        self._held: list[TensorExchange] = []  # exchanges whose residuals wait for the step's vote

    def __repr__(self) -> str:
        return f"Reducer(gradients by {self.hop!r})" if self.hop is not None else "Reducer(flat)"

    @property
    def residuals(self) -> str:
        """Where the hop's residuals wait between steps (``"device"`` or ``"host"``); set on the hop now
        and at every :meth:`connect`."""
        return self._residuals

    @residuals.setter
    def residuals(self, residuals: str) -> None:
        check_residuals(residuals)
        self._residuals = residuals
        if self.hop is not None:
            self.hop.residuals = residuals

    @property
    def home(self) -> torch.device | None:
        """Where the hop's residuals are kept: the host, or ``None`` (the training device)."""
        return residual_home(self._residuals)

    def connect(self, world: Communicator, replicas: Communicator, hop: Hop | None) -> None:
        """Reduce over ``world`` (every rank) and ``replicas`` (the ranks that hold the same tensors),
        gradients through ``hop`` when given (its residuals kept where :attr:`residuals` says); its
        state starts empty."""
        self._world, self._replicas, self.hop = world, replicas, hop
        if hop is not None:
            hop.residuals = self._residuals
        self._fused.clear()

    def reduce(
        self,
        tensors: Sequence[Tensor],
        *,
        tag: str,
        names: Sequence[str],
        route: str,
        exchange: Callable[[Tensor, list[int]], Tensor] | None = None,
    ) -> list[str]:
        """Average ``tensors`` (named ``names``, one each) in place by ``route``; returns the names of
        the gradients whose average holds an inf or a NaN (empty for the exact routes, which are
        not checked). The check reads each bucket's average once (every rank holds the same, so
        every rank decides the same) and synchronises with the host once per call.

        ``exchange(flat, indices)`` replaces the plain all-reduce of one gradient bucket (``indices``
        into ``tensors``); it must return the same tensor on every rank."""
        if route not in ROUTES:
            raise ValueError(f"route={route!r} is not one of {ROUTES}")
        if exchange is not None and route != GRADIENTS:
            raise ValueError(f"an exchange of its own is for gradients, not route={route!r}")
        if self._world is None or self._replicas is None:
            raise RuntimeError("Reducer.connect() first")
        fused = self._fused.get(route)
        if fused is None:
            comm = self._world if route == BUFFERS else self._replicas
            average = self.hop if route == GRADIENTS else None
            fused = self._fused[route] = BucketedAllReduce(comm, self.cap_bytes, average=average)
        flags: list[Tensor] | None = [] if route == GRADIENTS else None
        fused(tensors, tag=tag, names=names, exchange=exchange, finite_flags=flags)
        if not flags or bool(torch.stack(flags).all()):
            return []
        return [n for n, t in zip(names, tensors, strict=True) if not bool(torch.isfinite(t).all())]

    def average_flat(self, flat: Tensor, tag: str, key: BucketKey) -> Tensor:
        """The average over the replicas of one flat gradient bucket named by ``key``: through the
        hop where there is one, else one ring."""
        if self.hop is not None:
            return self.hop(flat, tag, key)
        assert self._replicas is not None, "Reducer.connect() first"
        return self._replicas.all_reduce(flat, "avg", tag=tag)

    # ------------------------------------------------------------------ the step's vote

    def hold(self, exchange: TensorExchange) -> None:
        """``exchange`` (a scheme's compressed gradient exchange) made residuals with ``commit=False``:
        they move with the step's vote, as the hop's do."""
        if not any(exchange is e for e in self._held):
            self._held.append(exchange)

    def commit(self) -> None:
        """The step runs: keep the residuals held since the last decision (the hop's and those of the
        exchanges given to :meth:`hold`)."""
        if self.hop is not None:
            self.hop.commit()
        for exchange in self._held:
            exchange.commit()
        self._held.clear()

    def discard(self) -> None:
        """Every rank skips the step (or it raised): drop them, the old ones stay."""
        if self.hop is not None:
            self.hop.discard()
        for exchange in self._held:
            exchange.discard()
        self._held.clear()

    # ------------------------------------------------------------------ buffers kept between calls

    def release(self, tag: str) -> None:
        """Drop the fused buffers kept for traffic ``tag`` on every route (traffic that has ended)."""
        for fused in self._fused.values():
            fused.release(tag)

    def holds(self, tag: str) -> bool:
        """Whether fused buffers are kept for gradient traffic ``tag``."""
        fused = self._fused.get(GRADIENTS)
        return fused is not None and fused.buffers(tag) is not None

    def held(self) -> list[Any]:
        """What it holds between calls, for memory accounting: the fused buffers, the residuals."""
        return [*self._fused.values(), self.state_dict()]

    # ------------------------------------------------------------------ rank-local state

    def state_dict(self) -> dict[str, Any]:
        """The hop's error-feedback residuals per bucket (empty without a quantized hop)."""
        return {} if self.hop is None else self.hop.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.hop is not None:
            self.hop.load_state_dict(state)

    def reset(self) -> None:
        """The residuals restart at zero."""
        if self.hop is not None:
            self.hop.reset()
