"""torchft's DiLoCo and Streaming DiLoCo as a peer of the race (``benchmarks/compare.py``), written
against torchft's public API: ``torchft.Manager``, ``torchft.ProcessGroupGloo``,
``torchft.local_sgd.DiLoCo`` and ``torchft.coordination.LighthouseServer``.

:class:`TorchFTDiLoCo` is a Lightning strategy, so the race's recipe, ``probe.BenchProbe``,
validation, step timing and byte counting are the same as for every other entry. It is Lightning's
``DDPStrategy`` with the no-op communication hook of ``peers.py`` (every rank keeps its own
gradient): Lightning's process group only broadcasts the initial weights (DDP's constructor), the
probe's stop decision and the validation metrics. Everything DiLoCo communicates goes through
torchft: per rank a torchft ``Manager`` of a replica group of one (``rank=0, world_size=1``, its own
``TCPStore``, ``replica_id`` ``rank<global rank>``) on ``ProcessGroupGloo``, with the quorum from a
Lighthouse that the benchmark starts (``lighthouse_main`` below; ``compare.py`` passes its address
in ``TORCHFT_LIGHTHOUSE``, torchft's own variable, and each rank's cluster address in
``BENCH_HOST_ADDRESS``).

    python benchmarks/peers_torchft.py lighthouse --min-replicas 4   # what compare.py starts

``compare.py`` runs the rank under ``unshare --uts`` with the host name set to the rank's cluster
address (as ``goodput.py`` does): torchft's HTTP checkpoint transport advertises
``socket.gethostname()``, which inside a network namespace names nothing the other ranks can reach.
The race never heals, so this only keeps torchft's defaults working.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from peers import HookedDDPStrategy, local_gradient_hook
from torch import Tensor, nn
from typing_extensions import override

ADDRESS_ENV = "BENCH_HOST_ADDRESS"  # this rank's address, reachable from every other rank


def contiguous_cut(sizes: list[int], num_fragments: int) -> list[tuple[int, int]]:
    """Cut tensors of ``sizes`` (in order) into ``num_fragments`` contiguous non-empty runs of about
    equal total size; ``[begin, end)`` index pairs. Run ``k`` grows while the next tensor brings the
    running total closer to ``k + 1`` parts in ``num_fragments`` of the whole (the rule of this
    package's ``streaming_diloco``, written here again so that this peer imports nothing of it). A
    tensor is never split: one larger than a fragment's share makes that fragment larger."""
    if not 1 <= num_fragments <= len(sizes):
        raise ValueError(f"num_fragments must be in [1, {len(sizes)}] (the number of tensors), got {num_fragments}")
    total = sum(sizes)
    bounds, begin, acc = [], 0, 0
    for k in range(num_fragments - 1):
        target = total * (k + 1) / num_fragments
        end = begin + 1
        acc += sizes[begin]
        while end < len(sizes) - (num_fragments - 1 - k) and abs(acc + sizes[end] - target) <= abs(acc - target):
            acc += sizes[end]
            end += 1
        bounds.append((begin, end))
        begin = end
    bounds.append((begin, len(sizes)))
    return bounds


class Fragment(nn.Module):
    """Some of a model's parameters (the same tensors, not copies) as a module of their own, the form
    ``torchft.local_sgd.DiLoCo`` takes its fragments in."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


class TorchFTDiLoCo(HookedDDPStrategy):
    """torchft's DiLoCo (``num_fragments=1``) or Streaming DiLoCo (``num_fragments > 1``) around the
    model's own optimizer.

    ``setup`` creates the torchft ``Manager`` (``min_replica_size`` = the number of ranks,
    ``use_async_quorum=False`` as DiLoCo requires, ``init_sync=False``: DDP's constructor has just
    broadcast rank 0's weights), runs one quorum so that torchft's gloo group is connected before
    training (as Lightning's own group is), and enters ``DiLoCo(manager, fragments, inner, outers,
    sync_every=sync_period, fragment_sync_delay=..., fragment_update_alpha=...)`` with the model's
    optimizer as the inner one; ``teardown`` exits it and shuts the Manager down. torchft then does
    everything from the inner optimizer's step hooks: every ``sync_period / num_fragments`` inner
    steps one fragment (in turn) is synchronised: a quorum through the Lighthouse, the fragment's
    pseudo-gradients (global minus local) all-reduced in fp32 (torchft quantizes only with Triton on
    CUDA; ``should_quantize=False``), one tensor per all-reduce (torchft's default), and that
    fragment's outer optimizer steps its global copy (Nesterov SGD ``outer_lr``, ``outer_momentum``,
    one optimizer per fragment: a shared one would also step the other fragments with the inner
    gradients still on them). With ``fragment_sync_delay`` the all-reduce is started that many inner
    steps before it is waited for.

    Fragments: the model's parameters in registration order (tied ones once), cut by
    :func:`contiguous_cut` into ``num_fragments`` contiguous runs of about equal size, each wrapped
    in a :class:`Fragment`. Tensors are not split, so a tensor larger than a quarter of the model
    (the tied embedding of ``lstm_demo.yaml``: 2.56 M of 3.10 M values) is a fragment alone.

    Validation sees the global model: torchft keeps it per fragment in
    ``_StreamingDiLoCoFragment.original_parameters`` (parameter name to a CPU copy: the weights of
    the fragment's last committed outer step, the start before the first; what torchft restores
    before an outer step and on a failed commit). That attribute and ``DiLoCo._fragments``, the
    list that holds the fragments, are **not public API** of torchft 0.2.0; nothing else is used of
    torchft's internals. The local weights are put back after validation. There is no
    ``wait_for_exchange`` for the probe: with a ``fragment_sync_delay``, an all-reduce started less
    than ``delay`` steps before a validation would still be in flight during it, which never happens
    when validations fall on multiples of ``sync_period / num_fragments`` steps (the race: every 4
    steps, Streaming at H 16 with 4 fragments).

    ``comm_seconds`` (read by ``probe.BenchProbe``): seconds inside torchft's step post-hook (timed
    by two post-hooks of the inner optimizer registered around DiLoCo's): the quorum, the
    pseudo-gradients, waiting for the all-reduce, the commit vote and the outer step; with a
    ``fragment_sync_delay``, the all-reduce's transfer during the inner steps in between is not
    in it. ``syncs``: committed synchronisations (``Manager.current_step()``): outer steps of DiLoCo,
    fragment syncs of Streaming DiLoCo.

    Args:
        sync_period: inner steps between two synchronisations of the same fragment, ``H``.
        num_fragments: fragments; must divide ``sync_period``.
        fragment_sync_delay: inner steps between starting a fragment's all-reduce and applying it
            (0: blocking); less than ``sync_period / num_fragments``.
        fragment_update_alpha: torchft's mixing of local into the new global weights (0: global).
        outer_lr: outer learning rate (paper: 0.7).
        outer_momentum: outer Nesterov momentum (paper: 0.9).
        lighthouse_addr: the Lighthouse's ``http://host:port`` (default: ``$TORCHFT_LIGHTHOUSE``).
        host_address: this rank's address for its ``TCPStore`` and its Manager's advertised host name
            (default: ``$BENCH_HOST_ADDRESS``, else ``127.0.0.1``).
        timeout_seconds: torchft's collective, quorum and connect timeouts.
    """

    def __init__(
        self,
        sync_period: int = 16,
        num_fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        lighthouse_addr: str | None = None,
        host_address: str | None = None,
        timeout_seconds: float = 600.0,
    ) -> None:
        if sync_period < 1 or num_fragments < 1 or sync_period % num_fragments:
            raise ValueError(f"num_fragments ({num_fragments}) must divide sync_period ({sync_period})")
        if not 0 <= fragment_sync_delay < sync_period // num_fragments:
            raise ValueError(
                f"fragment_sync_delay must be in [0, {sync_period // num_fragments}), got {fragment_sync_delay}"
            )
        super().__init__(ddp_comm_hook=local_gradient_hook)
        self.sync_period = sync_period
        self.num_fragments = num_fragments
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = fragment_update_alpha
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.lighthouse_addr = lighthouse_addr
        self.host_address = host_address
        self.timeout_seconds = timeout_seconds
        self.comm_seconds = 0.0
        self.manager: Any = None
        self.diloco: Any = None
        self.fragments: list[Fragment] = []
        self._store: Any = None
        self._hooks: list[Any] = []
        self._t0 = 0.0
        self._stash: list[Tensor] | None = None

    # ------------------------------------------------------------------ lifecycle

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # wrapping in DDP broadcast rank 0's weights: every rank starts equal
        if trainer.state.fn != TrainerFn.FITTING:
            return
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        if len(self.optimizers) != 1:
            raise ValueError(f"TorchFTDiLoCo needs exactly one optimizer, got {len(self.optimizers)}")
        inner = self.optimizers[0]
        params = list(self.lightning_module.parameters())  # tied parameters once
        cut = contiguous_cut([p.numel() for p in params], self.num_fragments)
        self.fragments = [Fragment(params[a:b]) for a, b in cut]
        outers = [
            torch.optim.SGD(f.parameters(), lr=self.outer_lr, momentum=self.outer_momentum, nesterov=True)
            for f in self.fragments
        ]
        module = self.lightning_module

        def state_dict() -> dict[str, Any]:  # what a healing replica would receive (never in the race)
            return {"model": module.state_dict(), "inner_optimizer": inner.state_dict()}

        def load_state_dict(state: dict[str, Any]) -> None:
            module.load_state_dict(state["model"])
            inner.load_state_dict(state["inner_optimizer"])

        address = self.host_address or os.environ.get(ADDRESS_ENV, "127.0.0.1")
        timeout = timedelta(seconds=self.timeout_seconds)
        self._store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=self.world_size,
            use_async_quorum=False,
            init_sync=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr=address,
            store_port=self._store.port,
            lighthouse_addr=self.lighthouse_addr,  # None: torchft reads $TORCHFT_LIGHTHOUSE
            replica_id=f"rank{self.global_rank}",
            hostname=address,
        )
        self.manager.start_quorum()  # connects torchft's gloo group now, not inside the first timed step
        if self.manager.errored():
            raise RuntimeError(f"torchft's first quorum failed: {self.manager.errored()}")
        self._hooks.append(inner.register_step_post_hook(self._start_clock))
        self.diloco = DiLoCo(
            self.manager,
            self.fragments,
            inner,
            outers if self.num_fragments > 1 else outers[0],
            sync_every=self.sync_period,
            backup_device=torch.device("cpu"),
            pin_memory=False,
            should_quantize=False,
            fragment_sync_delay=self.fragment_sync_delay,
            fragment_update_alpha=self.fragment_update_alpha,
        )
        self.diloco.__enter__()  # registers DiLoCo's step hooks on the inner optimizer
        self._hooks.append(inner.register_step_post_hook(self._stop_clock))

    @override
    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
            self.diloco = None
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        super().teardown()

    def _start_clock(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def _stop_clock(self, *args: Any) -> None:
        self.comm_seconds += time.perf_counter() - self._t0

    @property
    def syncs(self) -> int:
        return 0 if self.manager is None else self.manager.current_step()

    # ------------------------------------------------------------------ validation on the global model

    def _global_pairs(self) -> Iterator[tuple[nn.Parameter, Tensor]]:
        """(parameter, torchft's global copy of it) for every parameter (non-public attributes)."""
        for fragment, state in zip(self.fragments, self.diloco._fragments, strict=True):
            for name, p in fragment.named_parameters():
                yield p, state.original_parameters[name]

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.diloco is not None:
            pairs = list(self._global_pairs())
            self._stash = [p.detach().clone() for p, _ in pairs]
            with torch.no_grad():
                for p, g in pairs:
                    p.copy_(g)

    @override
    def on_validation_end(self) -> None:
        if self._stash is not None:
            with torch.no_grad():
                for (p, _), local in zip(self._global_pairs(), self._stash, strict=True):
                    p.copy_(local)
            self._stash = None
        super().on_validation_end()


# ---------------------------------------------------------------- the Lighthouse


def lighthouse_main(argv: list[str] | None = None) -> None:
    """torchft's Lighthouse until SIGTERM or SIGINT; prints ``listening at <address>`` once it is up."""
    parser = argparse.ArgumentParser(prog="peers_torchft.py lighthouse")
    parser.add_argument("--bind", default="[::]:0")
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--join-timeout-ms", type=int, default=60_000)
    parser.add_argument("--quorum-tick-ms", type=int, default=20)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=10_000)
    args = parser.parse_args(argv)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    stop: Callable[..., None] = lambda *_: sys.exit(0)  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    print(f"torchft lighthouse on {socket.gethostname()}: listening at {server.address()}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "lighthouse":
        lighthouse_main(sys.argv[2:])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} lighthouse --min-replicas N [--bind [::]:PORT]")
