"""``parameter_server``: a sharded parameter server over ``torch.distributed.rpc``, synchronous or asynchronous.

The fourth of CNTK's parallel algorithms and the baseline of the 2018 multi-GPU NLM paper. The flat
vector of the trainable parameters is cut into ``num_servers`` contiguous shards of (nearly) equal
length; shard ``s`` is served by rank ``s``. The servers live inside the training ranks, as MXNet's
and Multiverso's servers can: Lightning (and ``mpiexec``, torchrun, SLURM) start one process per
device and nothing else, so extra server processes would need a launcher of their own; hosted on
the training ranks they need none, and ``num_servers = N`` spreads the server traffic over every
link (then each rank sends ``2 (N-1)/N`` of the model per exchange, as a ring all-reduce does),
while ``num_servers = 1`` is the paper's single server whose link carries every worker's traffic.
The messages are TensorPipe RPCs (``torch.distributed.rpc``); a rank's push to the shard it serves
itself is a local call and sends nothing.

Two modes:

- ``mode="sync"``: after every backward each worker pushes each shard of its gradients to that
  shard's server, which waits for every worker, averages (summing in rank order, so the result does
  not depend on arrival order) and sends the average back; every rank then runs its own optimizer
  on identical gradients. The bytes are the paper's (the gradient up, ``K`` values back), and any
  optimizer, clipping and learning-rate schedule behave as with ``allreduce``. (A server that
  ran the optimizer itself and sent the weights back would move the same bytes; running it on every
  worker keeps the user's optimizer, whatever it is, as the one that steps.)
- ``mode="async"`` (CNTK's ``DataParallelASGD``): every ``sync_period`` samples or steps a worker
  pushes ``delta = w_local - w_base`` (its progress since the model it continued from), the server
  adds it to the global model at once, without waiting for anyone, and replies with the global
  model, which the worker continues from. A slow worker slows only itself; its deltas arrive stale.
  CNTK's staleness control scales the pushed delta by a coefficient that grows over the first syncs:
  at a worker's ``k``-th push (``k = 1, 2, ...``, as CNTK counts) the factor is
  ``min(1, c + (1 - c) k / n)`` (``adjust_learning_rate="linear"``) or ``min(1, c (floor(k / n) + 1))``
  (``"staircase"``), ``c = adjust_coefficient``, ``n = adjust_nb_minibatch``. The global model is
  the initial one plus the sum of every push, each scaled by its factor. With ``pipeline=True`` the
  reply is not waited for: the worker keeps training and applies the reply at its next sync, so the
  round trip hides behind a period of compute at the price of one more period of staleness. Where
  it then continues from (``pipeline_start``): ``"rebase"`` (default) the received model plus the
  progress made since the push, ``w_local <- w_pulled + (w_local - w_base)``; ``"pulled"`` the
  received model alone, CNTK's ``usePipeline`` (its double buffer: the model swapped in at a sync
  is the one pulled at the previous sync, and the progress just pushed comes back with the next
  reply). ``"rebase"`` keeps a worker's own progress in its weights a period earlier.

In async mode every rank meets the others only where Lightning makes them meet: validation during
fit, a checkpoint, and the end of fit. There each worker pushes what it has left, all wait for each
other, and all pull the global model, so validation, checkpoints and the final weights are the
global model on every rank. A checkpoint holds that model, the per-rank optimizer states and
counters; the servers restart from the model's weights on resume.

A rank that dies is reported, not waited for: a reply from a server whose process has gone fails
the RPC at once, and a wait for a server that is alive but waits for a dead worker polls the ranks'
heartbeats and raises :class:`~lightning_commstrats.comm.CollectiveError` naming the stopped ranks
within about five seconds.

Tensors travel through host memory (the servers hold their shards on the CPU, in float32), so the
strategy runs on CUDA too, with a device-to-host copy of the pushed and received values.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.rendezvous import register_rendezvous_handler
from torch.futures import Future
from torch.optim import Optimizer
from typing_extensions import override

from lightning_commstrats.buckets import flatten, unflatten_into
from lightning_commstrats.comm import CollectiveError, LivenessWatch
from lightning_commstrats.comm.stats import CommStats
from lightning_commstrats.comm.torch_dist import describe_stopped
from lightning_commstrats.strategies.allreduce import dense_grad, trainable_params
from lightning_commstrats.strategies.base import CommStrategy
from lightning_commstrats.strategies.periodic_settings import check_period

log = logging.getLogger(__name__)

PS_MODES = ("sync", "async")
ADJUST_MODES = ("none", "linear", "staircase")
PIPELINE_STARTS = ("rebase", "pulled")
RPC_NAME = "commstrats-ps-{}"


class ServerShard:
    """One shard of the global model on its server: ``[lo, hi)`` of the flat parameter vector.

    Thread-safe: RPC handler threads and the hosting rank's training thread call it at once.
    Sync mode keeps one round of pushed gradients and the futures of the workers waiting for their
    average; async mode keeps the shard's weights.

    Args:
        index: the shard's number.
        lo, hi: its range in the flat vector.
        world_size: workers per synchronous round.
    """

    def __init__(self, index: int, lo: int, hi: int, world_size: int) -> None:
        self.index, self.lo, self.hi, self.world_size = index, lo, hi, world_size
        self.weights: Tensor | None = None
        self.version = 0  # updates applied (rounds in sync mode, pushes in async mode)
        self._lock = threading.Lock()
        self._round: dict[int, Tensor] = {}
        self._waiting: list[Future] = []

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def _check(self, rank: int, values: Tensor) -> None:
        if values.shape != (self.numel,):
            raise ValueError(
                f"shard {self.index} holds {self.numel} values; rank {rank} sent shape {tuple(values.shape)}"
            )

    def push_gradients(self, rank: int, grad: Tensor) -> Future:
        """Add ``rank``'s gradient shard to the round; the future completes with the average once
        every worker's is in."""
        self._check(rank, grad)
        done: Future = Future()
        with self._lock:
            if rank in self._round:
                raise RuntimeError(f"rank {rank} pushed twice to shard {self.index} in one synchronous round")
            self._round[rank] = grad
            self._waiting.append(done)
            if len(self._round) < self.world_size:
                return done
            total = self._round[0].float().clone()
            for r in range(1, self.world_size):  # rank order: the same sum whatever the arrival order
                total.add_(self._round[r])
            total.div_(self.world_size)
            waiting, self._waiting, self._round = self._waiting, [], {}
            self.version += 1
        for future in waiting:
            future.set_result(total)
        return done

    def seed(self, weights: Tensor) -> None:
        """Start the shard's global weights (async mode) from ``weights``."""
        self._check(-1, weights)
        with self._lock:
            self.weights = weights.detach().float().cpu().clone()

    def push_delta(self, rank: int, delta: Tensor) -> Tensor:
        """Add a worker's (scaled) progress to the global weights at once; returns them."""
        self._check(rank, delta)
        with self._lock:
            if self.weights is None:
                raise RuntimeError(f"shard {self.index} has no weights yet (async mode seeds them at train start)")
            self.weights.add_(delta)
            self.version += 1
            return self.weights.clone()

    def pull(self) -> Tensor:
        with self._lock:
            if self.weights is None:
                raise RuntimeError(f"shard {self.index} has no weights yet")
            return self.weights.clone()

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index, "lo": self.lo, "hi": self.hi, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["lo"], state["hi"]) != (self.lo, self.hi):
            raise ValueError(
                f"shard {self.index} was [{state['lo']}, {state['hi']}) and is [{self.lo}, {self.hi}) in this run"
            )
        self.version = int(state["version"])


def shard_bounds(numel: int, num_servers: int) -> list[tuple[int, int]]:
    """``num_servers`` contiguous ranges of ``[0, numel)`` whose lengths differ by at most one."""
    if not 1 <= num_servers <= numel:
        raise ValueError(f"cannot cut {numel} parameter values into {num_servers} non-empty shards")
    edges = [numel * s // num_servers for s in range(num_servers + 1)]
    return list(itertools.pairwise(edges))


def adjust_factor(kind: str, coefficient: float, period: int, syncs: int) -> float:
    """CNTK's ``AdjustLearningRateAtBeginning`` factor (its ``DecayCoefficient``) at a worker's
    ``syncs``-th push, counted from 1 as CNTK counts (its counter is incremented before the factor
    is read)."""
    if kind == "linear":
        return min(1.0, max(0.0, coefficient + (1 - coefficient) / period * syncs))
    if kind == "staircase":
        return min(1.0, max(0.0, coefficient * (syncs // period + 1)))
    return 1.0


# ---------------------------------------------------------------------- the RPC side of a server

# This process's server shards, by shard number, with the run they belong to and the statistics
# their replies are charged to. RPC handlers find them here (RPC calls name module-level functions).
_SERVED: dict[int, tuple[str, ServerShard, CommStats]] = {}


def _served(run: str, index: int) -> tuple[ServerShard, CommStats]:
    entry = _SERVED.get(index)
    if entry is None or entry[0] != run:
        raise RuntimeError(f"this rank serves no shard {index} of run {run} (it has {sorted(_SERVED)})")
    return entry[1], entry[2]


def _reply(stats: CommStats, tag: str, values: Tensor) -> Tensor:
    stats.record(tag, values.numel() * values.element_size(), 0.0)  # the server's link carries the reply
    return values


@rpc.functions.async_execution
def _serve_gradients(run: str, index: int, rank: int, grad: Tensor) -> Future:
    shard, stats = _served(run, index)
    return shard.push_gradients(rank, grad).then(lambda done: _reply(stats, "grad", done.wait()))


def _serve_delta(run: str, index: int, rank: int, delta: Tensor) -> Tensor:
    shard, stats = _served(run, index)
    return _reply(stats, "weights", shard.push_delta(rank, delta))


def _serve_pull(run: str, index: int) -> Tensor:
    shard, stats = _served(run, index)
    return _reply(stats, "weights", shard.pull())


_RENDEZVOUS_SCHEME = "commstrats-ps"
_STORES: dict[str, dist.Store] = {}  # run id -> the store of that run's RPC rendezvous (kept until exit)
_HANDLER_REGISTERED = False


def _rendezvous_handler(url: str, **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """The RPC rendezvous of one run: the store this process already holds for it (named by the
    url's host part), so no port is picked in advance and then bound later, a gap in which another
    process can take it."""
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    yield _STORES[parsed.netloc], int(query["rank"]), int(query["world_size"])


def _rendezvous_store(rank: int, world_size: int, comm: Any, timeout: datetime.timedelta) -> dist.Store:
    """Collective. Rank 0 listens on a port the system picks and holds from then on (port 0) and
    tells the others which; they connect to it at ``MASTER_ADDR``."""
    global _HANDLER_REGISTERED
    if not _HANDLER_REGISTERED:
        register_rendezvous_handler(_RENDEZVOUS_SCHEME, _rendezvous_handler)
        _HANDLER_REGISTERED = True
    host = os.environ["MASTER_ADDR"]
    store = None
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, True, timeout, wait_for_workers=False)
    port = comm.broadcast_object(store.port if store is not None else None, 0)
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, timeout)
    return store


_REMOTE = {"gradients": _serve_gradients, "delta": _serve_delta, "pull": _serve_pull}


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


# ---------------------------------------------------------------------- the strategy


class ParameterServerStrategy(CommStrategy):
    """Data parallelism through parameter servers hosted on the training ranks (``torch.distributed.rpc``).

    Args:
        mode: ``"sync"`` (gradients averaged by the servers every optimizer step: synchronous SGD
            with the paper's point-to-point traffic) or ``"async"`` (CNTK's DataParallelASGD:
            workers push their progress and pull the global model every ``sync_period`` without
            waiting for each other).
        num_servers: how many ranks serve a shard of the model (ranks ``0 .. num_servers - 1``):
            an int >= 1, at most the number of ranks and of parameter values, or ``"all"``.
        sync_period: async mode: the length of a period between pushes, in ``sync_period_unit``
            (sync mode exchanges every step and takes only 1).
        sync_period_unit: ``"samples"`` (per worker, CNTK's unit; each worker counts its own: async
            workers never agree on anything) or ``"steps"`` (optimizer steps).
        pipeline: async mode: do not wait for the reply; apply it at the next sync.
        pipeline_start: with ``pipeline=True``, where a worker continues from at a sync:
            ``"rebase"`` (default: the model received for its previous push plus the progress it
            made since) or ``"pulled"`` (that model alone: CNTK's ``usePipeline``).
        adjust_learning_rate: async mode: ``"none"``, ``"linear"`` or ``"staircase"`` (CNTK's
            ``AdjustLearningRateAtBeginning``): the pushed progress is scaled by a factor that
            grows from about ``adjust_coefficient`` to 1 over the first syncs (the formulas above).
        adjust_coefficient: the starting factor (and the staircase's step), in (0, 1].
        adjust_nb_minibatch: syncs over which the factor grows (linear) or per stair (staircase), >= 1.
        rpc_transports: TensorPipe transports to use (e.g. ``["uv"]``: TCP only, also between
            processes of one host); ``None``: TensorPipe's choice. Set ``TP_SOCKET_IFNAME`` to pick
            the network interface.
        **kwargs: passed to :class:`~lightning_commstrats.strategies.base.CommStrategy` (``backend``
            must be gloo or NCCL: the servers' messages go over RPC, Lightning's own over the group).

    Example::

        trainer = L.Trainer(devices=4, strategy=ParameterServerStrategy(mode="async", sync_period=4,
                            sync_period_unit="steps", num_servers=2))
    """

    strategy_name = "parameter_server"

    def __init__(
        self,
        mode: str = "sync",
        num_servers: int | str = 1,
        sync_period: int = 1,
        sync_period_unit: str = "steps",
        pipeline: bool = False,
        pipeline_start: str = "rebase",
        adjust_learning_rate: str = "none",
        adjust_coefficient: float = 0.2,
        adjust_nb_minibatch: int = 600,
        rpc_transports: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if mode not in PS_MODES:
            raise ValueError(f"mode={mode!r} is not supported; choose one of {PS_MODES}")
        if num_servers != "all" and (
            isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1
        ):
            raise ValueError(f"num_servers must be a positive int or 'all', got {num_servers!r}")
        check_period(sync_period, sync_period_unit)
        if not isinstance(pipeline, bool):
            raise ValueError(f"pipeline must be True or False, got {pipeline!r}")
        if pipeline_start not in PIPELINE_STARTS:
            raise ValueError(f"pipeline_start={pipeline_start!r} is not supported; choose one of {PIPELINE_STARTS}")
        if pipeline_start != "rebase" and not pipeline:
            raise ValueError(f"pipeline_start={pipeline_start!r} applies to pipeline=True")
        if adjust_learning_rate not in ADJUST_MODES:
            raise ValueError(
                f"adjust_learning_rate={adjust_learning_rate!r} is not supported; choose one of {ADJUST_MODES}"
            )
        if isinstance(adjust_coefficient, bool) or not isinstance(adjust_coefficient, (int, float)):
            raise ValueError(f"adjust_coefficient must be a number in (0, 1], got {adjust_coefficient!r}")
        if not 0 < adjust_coefficient <= 1:
            raise ValueError(f"adjust_coefficient must be in (0, 1], got {adjust_coefficient!r}")
        if isinstance(adjust_nb_minibatch, bool) or not isinstance(adjust_nb_minibatch, int) or adjust_nb_minibatch < 1:
            raise ValueError(f"adjust_nb_minibatch must be an int >= 1, got {adjust_nb_minibatch!r}")
        if mode == "sync":
            extras = {
                "sync_period": sync_period != 1,
                "pipeline": pipeline,
                "adjust_learning_rate": adjust_learning_rate != "none",
            }
            given = [name for name, set_ in extras.items() if set_]
            if given:
                raise ValueError(
                    f"mode='sync' averages gradients at every optimizer step; {', '.join(given)} apply to mode='async'"
                )
        if rpc_transports is not None and (
            isinstance(rpc_transports, str) or not all(isinstance(t, str) for t in rpc_transports)
        ):
            raise ValueError(
                f"rpc_transports must be a list of TensorPipe transport names or None, got {rpc_transports!r}"
            )
        if kwargs.get("backend", kwargs.get("process_group_backend")) == "mpi":
            raise ValueError(
                "parameter_server sends its messages over torch.distributed.rpc; use backend 'gloo' or 'nccl'"
            )
        # with shard= the base's refusal names it; a slow hop alone would be told to add group_size first
        hop = kwargs.get("group_size") is not None or kwargs.get("slow_hop_bits", 32) != 32
        if hop and kwargs.get("shard") is None:
            raise ValueError(
                "parameter_server has no group exchange: group_size does not apply, nor slow_hop_bits (got"
                f" group_size={kwargs.get('group_size')!r}, slow_hop_bits={kwargs.get('slow_hop_bits', 32)!r})"
            )
        super().__init__(**kwargs)
        self.mode = mode
        # async workers never wait for each other: a worker that gets SIGTERM stops at its next batch
        # alone, and the others name it at their next push, as they do any worker that stops
        self.stop_agreement.together = mode != "async"
        self.num_servers = num_servers
        self.sync_period = sync_period
        self.sync_period_unit = sync_period_unit
        self.pipeline = pipeline
        self.pipeline_start = pipeline_start
        self.adjust_learning_rate = adjust_learning_rate
        self.adjust_coefficient = float(adjust_coefficient)
        self.adjust_nb_minibatch = adjust_nb_minibatch
        self.rpc_transports = None if rpc_transports is None else list(rpc_transports)
        self.bounds: list[tuple[int, int]] = []
        self.shards: dict[int, ServerShard] = {}  # the shards this rank serves
        self.syncs = 0  # this worker's pushes (async) or exchanges (sync)
        self._run = ""
        self._rpc_up = False
        self._failed = False
        self._last_sync = 0  # progress at this worker's last push (async)
        self._base: Tensor | None = None  # the flat weights the progress since the last push is measured from
        self._inflight: list[Future] | None = None  # a pipelined reply not yet applied
        self._watch: LivenessWatch | None = None
        self._watched_at = 0.0

    # ------------------------------------------------------------------ set-up

    @override
    def setup_scheme(self) -> None:
        super().setup_scheme()
        trainer = self.trainer
        if self.world_size == 1 or (trainer is not None and trainer.state.fn != TrainerFn.FITTING):
            return
        numel = sum(p.numel() for p in self.params)
        servers = self.world_size if self.num_servers == "all" else int(self.num_servers)
        if servers > self.world_size:
            raise ValueError(
                f"num_servers={servers} but there are {self.world_size} ranks: the servers are hosted on"
                " training ranks, at most one shard per rank"
            )
        if servers > numel:
            raise ValueError(f"num_servers={servers} is more than the model's {numel} parameter values")
        self.bounds = shard_bounds(numel, servers)
        self._run = self.comm.broadcast_object(uuid.uuid4().hex if self.global_rank == 0 else None, 0)
        self.shards = {}
        if self.global_rank < servers:
            lo, hi = self.bounds[self.global_rank]
            shard = ServerShard(self.global_rank, lo, hi, self.world_size)
            self.shards[self.global_rank] = shard
            _SERVED[self.global_rank] = (self._run, shard, self.comm_stats)
        self._init_rpc()

    def _init_rpc(self) -> None:
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError("parameter_server needs MASTER_ADDR (set when the ranks connect)")
        # A rendezvous of its own for every agent: TensorPipe makes a gloo group through the store,
        # and in a store already used by an earlier agent of this process (a second fit) a rank
        # could read the earlier group's keys and call an address that is gone.
        _STORES[self._run] = _rendezvous_store(self.global_rank, self.world_size, self.comm, self._timeout)
        options: dict[str, Any] = {
            "num_worker_threads": max(16, 2 * self.world_size),
            "rpc_timeout": self._timeout.total_seconds(),
            "init_method": f"{_RENDEZVOUS_SCHEME}://{self._run}",
        }
        if self.rpc_transports is not None:
            options["_transports"] = self.rpc_transports
            options["_channels"] = ["basic"]
        rpc.init_rpc(
            RPC_NAME.format(self.global_rank),
            rank=self.global_rank,
            world_size=self.world_size,
            rpc_backend_options=rpc.TensorPipeRpcBackendOptions(**options),
        )
        self._rpc_up = True
        log.info(
            "parameter_server: rank %d serves %s of %d shards", self.global_rank, list(self.shards), len(self.bounds)
        )

    @property
    def params(self) -> list[torch.nn.Parameter]:
        assert self.lightning_module is not None
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    def flat_weights(self) -> Tensor:
        return flatten([p.detach().float() for p in self.params])

    def load_flat(self, flat: Tensor) -> None:
        with torch.no_grad():
            unflatten_into(flat.to(self.root_device), [p.data for p in self.params])

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # restores a checkpoint's state first
        if not self._rpc_up:
            return
        if self.mode == "async":
            # every rank holds the same weights here (rank 0's, or the checkpoint's global model)
            flat = self.flat_weights()
            for shard in self.shards.values():
                shard.seed(flat[shard.lo : shard.hi])
            self._base = flat
            self._last_sync = self._progress()
        self.comm.barrier()  # no worker pushes before every server is ready

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    @override
    def release_resources(self) -> None:
        if self._rpc_up:
            self._rpc_up = False
            try:
                rpc.shutdown(graceful=not self._failed)
            except Exception as err:  # a peer is gone: nothing left to wait for
                log.warning("parameter_server: RPC shutdown: %s", err)
            for index in list(self.shards):
                _SERVED.pop(index, None)
        # the run's rendezvous store is kept (one listening socket and thread on rank 0 per fit) until
        # the process ends: destroyed here, right after the agent, it went while the process was
        # already on its next run, and once in a full-suite run (1 of 4) the next run's first
        # collective on rank 0 hung with its peer's connection reset
        super().release_resources()

    # ------------------------------------------------------------------ talking to the servers

    def _call(self, index: int, op: str, *args: Any, tag: str) -> Future:
        """``op`` (``"gradients"``, ``"delta"`` or ``"pull"``) on shard ``index``'s server: a local
        call when this rank serves it (nothing sent), else an RPC, charging the tensors sent."""
        shard = self.shards.get(index)
        if shard is not None:
            if op == "gradients":
                return shard.push_gradients(*args)
            return _done(shard.push_delta(*args) if op == "delta" else shard.pull())
        nbytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, Tensor))
        self.comm_stats.record(tag, nbytes, 0.0)
        return rpc.rpc_async(RPC_NAME.format(index), _REMOTE[op], args=(self._run, index, *args))

    def _wait(self, futures: Sequence[Future], tag: str) -> list[Tensor]:
        """The replies, in order; the wait is charged to ``tag``'s seconds. A dead peer raises
        :class:`CollectiveError` naming it instead of waiting forever."""
        start = time.perf_counter()
        arrived = threading.Event()
        torch.futures.collect_all(list(futures)).add_done_callback(lambda _: arrived.set())
        heartbeat = getattr(self.comm, "heartbeat", None)
        watch: LivenessWatch | None = None
        deadline = start + self._timeout.total_seconds()
        while not arrived.wait(0.25):
            if watch is None and heartbeat is not None:  # a wait this long: start watching the peers
                watch = LivenessWatch(heartbeat)
            if watch is not None:
                waited = time.perf_counter() - start
                self._raise_if_stopped(watch, f"waiting {waited:.1f} s for the parameter server ({tag})")
            if time.perf_counter() > deadline:
                raise CollectiveError(
                    f"rank {self.global_rank} of {self.world_size}: no reply from the parameter server ({tag})"
                    f" within the timeout of {self._timeout.total_seconds():.0f} s"
                )
        try:
            values = [future.wait() for future in futures]
        except Exception as err:
            raise CollectiveError(
                f"rank {self.global_rank} of {self.world_size}: a parameter-server call ({tag}) failed"
                f" after {time.perf_counter() - start:.1f} s: {err}"
            ) from err
        self.comm_stats.record(tag, 0, time.perf_counter() - start)
        return values

    def _raise_if_stopped(self, watch: LivenessWatch, doing: str) -> None:
        stopped = watch.stopped()
        if stopped is None or stopped:
            raise CollectiveError(f"rank {self.global_rank} of {self.world_size}: {doing}: {describe_stopped(stopped)}")

    def _check_peers(self) -> None:
        """Async mode: workers never wait for each other, so a dead one would be noticed only at the
        next meeting, after the others had trained on alone; the heartbeats say it at the next push."""
        heartbeat = getattr(self.comm, "heartbeat", None)
        if heartbeat is None:
            return
        if self._watch is None:
            self._watch = LivenessWatch(heartbeat)
        now = time.monotonic()
        if now - self._watched_at >= 1.0:  # a few store reads, at most once a second
            self._watched_at = now
            self._raise_if_stopped(self._watch, "pushing to the parameter server")

    def _push_pull(self, op: str, flat: Tensor, tag: str) -> list[Future]:
        """Send each shard of ``flat`` to its server; the futures of the replies."""
        host = flat.detach().float().cpu()
        # a slice is copied out (RPC would send the whole storage of a view); one shard is the buffer itself
        pieces = [host if hi - lo == host.numel() else host[lo:hi].clone() for lo, hi in self.bounds]
        return [self._call(s, op, self.global_rank, piece, tag=tag) for s, piece in enumerate(pieces)]

    def _assemble(self, replies: Sequence[Tensor]) -> Tensor:
        flat = replies[0] if len(replies) == 1 else torch.cat([r.reshape(-1) for r in replies])
        return flat.to(self.root_device)

    # ------------------------------------------------------------------ sync mode: gradients

    @override
    def after_backward(self, optimizer: Optimizer) -> None:
        if self.mode != "sync" or not self._rpc_up:
            return
        params = trainable_params(optimizer)
        grads = [dense_grad(p) for p in params]
        if sum(g.numel() for g in grads) != self.bounds[-1][1]:
            raise RuntimeError(
                "parameter_server: the stepping optimizer does not hold all trainable parameters; with several"
                " optimizers use allreduce"
            )
        averaged = self._assemble(self._wait(self._push_pull("gradients", flatten(grads), "grad"), "grad"))
        unflatten_into(averaged, grads)
        self.syncs += 1
        if not bool(torch.isfinite(averaged).all()):
            bad = [self.param_name(p) for p, g in zip(params, grads, strict=True) if not g.isfinite().all()]
            self.report_nonfinite(bad)

    # ------------------------------------------------------------------ async mode: deltas and models

    def _progress(self) -> int:
        return self.samples_per_worker if self.sync_period_unit == "samples" else self.optimizer_steps

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if self.mode != "async" or not self._rpc_up:
            return
        # the step counter moves after this hook: count this step already
        progress = self._progress() + (self.sync_period_unit == "steps")
        if progress - self._last_sync >= self.sync_period:
            self._last_sync = progress
            self._sync_async(pipelined=self.pipeline)

    def _sync_async(self, pipelined: bool) -> None:
        """Push this worker's progress since its base, and continue from the global model."""
        assert self._base is not None
        self._check_peers()
        local = self.flat_weights()
        progress = local - self._base
        if not bool(torch.isfinite(progress).all()):  # one host sync per push, not per step
            # async workers decide alone (no worker waits for another): raise on this worker (the
            # others name it at their next push), or push no progress and take the global model
            parts = progress.split([p.numel() for p in self.params])
            names = [self.param_name(p) for p, t in zip(self.params, parts, strict=True) if not t.isfinite().all()]
            self.handle_nonfinite(names, "progress", everywhere=False)
            progress.zero_()
            local = self._base.clone()
        if self._inflight is not None:  # the reply to the previous push: continue from it
            pulled = self._assemble(self._wait(self._inflight, "weights"))
            self._inflight = None
            local = pulled if self.pipeline_start == "pulled" else pulled + progress
        elif pipelined and self.pipeline_start == "pulled":
            local = self._base  # no push in flight: the last model received is the base
        # the factor of this push, the (syncs + 1)-th
        factor = adjust_factor(
            self.adjust_learning_rate, self.adjust_coefficient, self.adjust_nb_minibatch, self.syncs + 1
        )
        futures = self._push_pull("delta", progress.mul_(factor) if factor != 1 else progress, "weights")
        self.syncs += 1
        if pipelined:
            self._inflight = futures
            self._base = local
        else:
            local = self._assemble(self._wait(futures, "weights"))
            self._base = local
        self.load_flat(local)

    def meet(self) -> None:
        """Collective (async mode): every worker pushes what it has left, waits for the others, and
        takes the global model. Before validation during fit, checkpoints and the end of fit."""
        if self.mode != "async" or not self._rpc_up or self._base is None:
            return
        self._sync_async(pipelined=False)
        self.comm.barrier()  # every push is in
        pulls = [self._call(s, "pull", tag="weights") for s in range(len(self.bounds))]
        flat = self._assemble(self._wait(pulls, "weights"))
        self.load_flat(flat)
        self._base = flat
        self._last_sync = self._progress()

    @override
    def on_validation_start(self) -> None:
        trainer = self.trainer
        if trainer is None or trainer.state.fn == TrainerFn.FITTING:  # None: Fabric's global_model()
            self.meet()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self.meet()
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.meet()  # the checkpoint's model is the global one, the same on every rank
        return super().lightning_module_state_dict()

    # ------------------------------------------------------------------ checkpoints

    @override
    def replicated_tensors(self) -> dict[str, Tensor]:
        # async workers hold their own weights between meetings
        return super().replicated_tensors() if self.mode == "sync" else {}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mode": self.mode, "bounds": list(self.bounds)}

    @override
    def rank_state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"syncs": self.syncs, "last_sync": self._last_sync}
        state["shards"] = {i: s.state_dict() for i, s in self.shards.items()}
        if self.mode == "async":  # each worker's optimizer saw only its own gradients
            state["optimizers"] = [opt.state_dict() for opt in self.optimizers]
        return state

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise ValueError(f"it was saved in mode={state.get('mode')!r} and this run has mode={self.mode!r}")
        if self.bounds and [tuple(b) for b in state["bounds"]] != self.bounds:
            raise ValueError(f"its shards {state['bounds']} differ from this run's {self.bounds}")
        for i, saved in rank_state.get("shards", {}).items():
            if int(i) in self.shards:
                self.shards[int(i)].load_state_dict(saved)
        super().load_state_dict(state, rank_state)
        self.syncs = int(rank_state["syncs"])
        self._last_sync = int(rank_state["last_sync"])
        for optimizer, opt_state in zip(self.optimizers, rank_state.get("optimizers", []), strict=False):
            optimizer.load_state_dict(opt_state)

    @override
    def reset_state(self) -> None:
        self.syncs = 0
        self._last_sync = self._progress()
