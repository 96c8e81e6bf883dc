"""Goodput under faults: fault-tolerant DiLoCo replicas that die and come back, against a fault-free run.

Four replicas (``--replicas``), each a job of its own in its own network namespace of the emulated
cluster (``benchmarks/cluster.py``: a star of rate-limited links, one folder per ``--rates`` value),
train the recipe's LSTM language model (``lstm_demo.yaml``: Brown, AdamW inside every replica) with
DiLoCo across replicas: 4-bit pseudo-gradients, an outer step every ``H`` inner steps (``--sync-period``),
quorums and healing by torchft through a Lighthouse that the benchmark starts on a host of its own.

Two contenders, each run without faults and then with the fault schedule, in the same invocation:

- ``package``: one Lightning ``Trainer`` per replica with :class:`lightning_commstrats.DiLoCoStrategy`
  (``pseudo_grad_bits=4``, ``fault_tolerance=``), the package's own quorum/commit/heal logic;
- ``torchft``: torchft's own DiLoCo (``torchft.local_sgd.DiLoCo`` on ``torchft.Manager`` and
  ``torchft.ProcessGroupGloo``) in a plain torch training loop: the same model, data, batch size,
  AdamW, gradient clipping, ``H`` and outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9, as
  ``compare.py``'s DiLoCo entries), with torchft's own Lighthouse. torchft quantizes its all-reduce
  only on CUDA (Triton kernels): on these CPUs its pseudo-gradients travel in fp32.

The fault schedule: every ``--kill-every`` committed outer rounds (K = 10 by default) one replica's
process group is sent SIGKILL (a machine failure: no clean-up, no goodbye), at a seeded random
point of the next round (``--kill-phase``), rotating through the replicas; it is started again
``--restart-after`` seconds later under the same replica id, from a fresh initialisation, and must
heal from a live peer. No kill is scheduled so late that the restarted replica could not rejoin.

Every run reports (``benchmarks/results/goodput/README.md`` defines each figure): useful samples per
second (goodput) and its ratio faulty / fault-free per contender, kills, restarts and heals observed,
failed sync attempts, the final validation perplexity of the global model at equal committed outer
rounds, and the bytes each replica's interface sent. ``results.md`` and ``results.json`` go to
``benchmarks/results/goodput/rate<R>/`` (``quick/`` for the smoke run).

    python benchmarks/goodput.py                          # the full run: 100 and 10 Mbit/s, seed 0 (hours)
    python benchmarks/goodput.py --rates 100 --seeds 0 1  # one rate, two seeds
    python benchmarks/goodput.py --quick                  # smoke run: tiny model, 3 replicas, one kill, minutes

Without root (or where ``ip netns`` is refused) it runs on loopback and says so in every output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from cluster import EmulatedCluster, cluster_or_loopback  # noqa: E402
from common import child_env, free_port, popen_on, quiet_trainer, stop, wait_for_line, write_results  # noqa: E402
from recorded import portable, portable_args  # noqa: E402

# ---------------------------------------------------------------- the setting
# DiLoCo as compare.py races it (its DILOCO_H and its DiLoCo entries' outer optimizer), inner
# AdamW as every compare.py entry (INNER_OPTIMIZER).
SYNC_PERIOD = 32
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
PSEUDO_GRAD_BITS = 4
INNER_OPTIMIZER = {"optimizer": "adamw", "weight_decay": 0.01}
KILL_EVERY = 10  # outer rounds between failures (the issue: "one failure every 10 outer rounds")
ROUNDS = 40  # committed outer rounds per run: failures at rounds 10, 20 and 30
RESTART_AFTER = 5.0  # seconds between a kill and the restart
GOODPUT_BAR = 0.90  # the bar for the package at 100 Mbit/s
CLUSTER_PREFIX = "cgood"  # its own namespace prefix: compare.py's (and tests') clusters are left alone
CONTENDERS = ("package", "torchft")
LABELS = {
    "package": f"package diloco ({PSEUDO_GRAD_BITS}-bit, fault_tolerance)",
    "torchft": "torchft DiLoCo (fp32 on CPU)",
}


# ================================================================ one replica (a process of its own)


class Events:
    """A replica's log of what happened, one JSON object per line (flushed at once: a replica
    that is killed keeps every line it wrote)."""

    def __init__(self, path: Path, rid: str, incarnation: int) -> None:
        self.file = open(path, "a", buffering=1)
        self.rid = rid
        self.incarnation = incarnation

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": time.time(), "rid": self.rid, "incarnation": self.incarnation, **fields}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def data_seed(replica_id: str) -> int:
    """Each replica's data order, from its name (the same rule as the package's FaultTolerance, so
    both contenders read the same batches in the same order)."""
    return zlib.crc32(replica_id.encode()) & 0x7FFFFFFF


def digest_state(state: dict[str, Any]) -> str:
    h = hashlib.sha1()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def batch_digest(x: Any) -> str:
    return hashlib.sha1(x.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]


def build(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The recipe's data module and language model (the package's own classes), seeded alike on
    every replica."""
    import torch

    from lightning_commstrats.data import LMDataModule
    from lightning_commstrats.models import LanguageModel

    dm = LMDataModule(**spec["data"])
    dm.prepare_data()
    torch.manual_seed(spec["seed"])
    model = LanguageModel(**spec["model"], vocab_size=dm.vocab_size)
    return dm, model


def wait_for_go(spec: dict[str, Any], log: Events) -> None:
    """Booted (imports, data, model): say so, then wait until the controller starts every replica at once."""
    run = Path(spec["run_dir"])
    (run / f"ready.{spec['rid']}.{spec['incarnation']}").touch()
    log("ready")
    while not (run / "go").exists():
        time.sleep(0.05)


def replica_package(spec: dict[str, Any], log: Events) -> None:
    """One replica as a Lightning job with the package's DiLoCoStrategy and fault_tolerance."""
    import lightning as L
    import torch

    from lightning_commstrats import DiLoCoStrategy
    from lightning_commstrats import fault_tolerance as ft

    dm, model = build(spec)
    h = spec["sync_period"]
    state: dict[str, Any] = {"contributes": None, "quorum": None, "local_steps": 0, "first": True}

    # What each sync was: the quorum's size and whether this replica's block counted (a replica
    # that has just healed sends zeros and is not counted). Wrappers only: the package is unchanged.
    original_quorum, original_commit = ft.ReplicaSync.quorum, ft.ReplicaSync.commit

    def quorum(self: Any) -> Any:
        q = original_quorum(self)
        state["quorum"] = q.comm.world_size
        if q.healed is not None:
            log("heal", step=self.step)
        return q

    def commit(self: Any, ok: bool, error: BaseException | None = None) -> bool:
        result = original_commit(self, ok, error)
        if not result:
            log("sync_failed", ok=ok, error=None if error is None else f"{type(error).__name__}: {error}")
        return result

    ft.ReplicaSync.quorum, ft.ReplicaSync.commit = quorum, commit

    config = {
        "lighthouse": spec["lighthouse"],
        "replica_id": spec["rid"],
        "min_replicas": spec["min_replicas"],
        "hostname": spec["address"],
        "timeout": spec["timeout"],
        "quorum_timeout": spec["quorum_timeout"],
        "connect_timeout": spec["connect_timeout"],
    }
    strategy = DiLoCoStrategy(
        sync_period=h,
        sync_period_unit="steps",
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        pseudo_grad_bits=spec["bits"],
        fault_tolerance=config,
    )

    from lightning_commstrats import replicas as rp

    original_average = rp.ReplicaGroup.average

    def replica_average(self: Any, pending: Any, host: Any, first: Any = None) -> Any:
        out = original_average(self, pending, host, first)
        state["contributes"] = bool(pending.contributes)
        return out

    rp.ReplicaGroup.average = replica_average
    original_after_sync = strategy.after_sync

    def after_sync(fragment: int) -> None:
        original_after_sync(fragment)
        log(
            "commit",
            round=strategy.optimizer_steps // h,
            optimizer_steps=strategy.optimizer_steps,
            ft_step=strategy.replicas.sync.step if strategy.replicas.sync is not None else None,
            contributes=state["contributes"],
            quorum=state["quorum"],
            local_steps=state["local_steps"],
            comm_bytes={tag: c.bytes_sent for tag, c in strategy.comm_stats.by_tag.items()},
            global_digest=digest_state(
                {str(f): strategy.outer.global_weights(f) for f in range(strategy.num_fragments)}
            ),
        )

    strategy.after_sync = after_sync

    class Recorder(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if state["first"]:  # after the first quorum: the run's state agreed or healed from a peer
                state["first"] = False
                sampler = getattr(trainer.train_dataloader, "sampler", None)
                log(
                    "train_start",
                    round=strategy.optimizer_steps // h,
                    optimizer_steps=strategy.optimizer_steps,
                    sampler=type(sampler).__name__,
                    sampler_seed=getattr(sampler, "seed", None),
                    first_batch=batch_digest(batch[0]),
                )

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            state["local_steps"] += 1
            if spec["step_sleep"]:
                time.sleep(spec["step_sleep"])

    trainer = quiet_trainer(
        validate=False,
        devices=spec.get("ranks", 1),
        strategy=strategy,
        max_steps=spec["rounds"] * h,
        max_epochs=-1,
        gradient_clip_val=spec["clip"],
        callbacks=[Recorder()],
        default_root_dir=str(Path(spec["run_dir"]) / f"lightning.{spec['rid']}.{spec['incarnation']}"),
    )
    wait_for_go(spec, log)
    trainer.fit(model, datamodule=dm)
    # on_train_end loaded the global model into the parameters
    final = {k: v.detach().clone() for k, v in model.net.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(final, Path(spec["run_dir"]) / f"final.{spec['rid']}.pt")
    log(
        "end",
        round=strategy.optimizer_steps // h,
        local_steps=state["local_steps"],
        digest=digest_state(final),
        comm_bytes={tag: c.bytes_sent for tag, c in strategy.comm_stats.by_tag.items()},
    )


def replica_torchft(spec: dict[str, Any], log: Events) -> None:
    """One replica of torchft's DiLoCo in a plain torch loop, written against torchft's public API
    (Manager, ProcessGroupGloo, local_sgd.DiLoCo) the way its DiLoCo example uses it: the user's
    state (model, inner optimizer) and DiLoCo's (global weights, outer optimizer) travel to a
    replica that heals."""
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torch.utils.data import DataLoader, DistributedSampler
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from lightning_commstrats.models import lm_loss

    dm, model = build(spec)
    net = model.net
    h, rid = spec["sync_period"], spec["rid"]
    inner = torch.optim.AdamW(net.parameters(), lr=spec["model"]["lr"], weight_decay=spec["model"]["weight_decay"])
    outer = torch.optim.SGD(net.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    healed = {"now": False}

    def load_state_dict(state: dict[str, Any]) -> None:
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optimizer"])
        healed["now"] = True

    def state_dict() -> dict[str, Any]:
        return {"model": net.state_dict(), "inner_optimizer": inner.state_dict()}

    rank, ranks = spec["rank"], spec.get("ranks", 1)
    data = dm.dataset("train")
    sampler = DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=True, seed=data_seed(rid))
    loader = DataLoader(data, batch_size=spec["data"]["batch_size"], sampler=sampler, drop_last=True)
    local_steps, epoch, first = 0, 0, True
    # the Manager (and its heartbeats) starts after the go, as the package's does in Trainer.fit
    wait_for_go(spec, log)
    timeout = timedelta(seconds=spec["timeout"])
    if rank == 0:  # the replica's stores: one for its own process group, one for torchft (as torchrun's)
        group_store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        spec["stores"] = [group_store.port, store.port]
        for r in range(1, ranks):  # the replica's other ranks, in its process group (a kill takes them all)
            cmd = [sys.executable, str(Path(__file__).resolve()), "_replica", json.dumps({**spec, "rank": r})]
            subprocess.Popen(cmd)
    else:
        group_store = TCPStore(spec["address"], spec["stores"][0], is_master=False, timeout=timeout)
    group = None
    if ranks > 1:  # gradients averaged inside the replica at every step, as the package's replica does
        torch.distributed.init_process_group("gloo", store=group_store, rank=rank, world_size=ranks, timeout=timeout)
        group = torch.distributed.group.WORLD
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=spec["min_replicas"],
        use_async_quorum=False,  # DiLoCo needs it in torchft 0.2.0
        init_sync=False,  # every replica starts from the same seeded initialisation
        timeout=timeout,
        quorum_timeout=timedelta(seconds=spec["quorum_timeout"]),
        connect_timeout=timedelta(seconds=spec["connect_timeout"]),
        rank=rank,
        world_size=ranks,
        store_addr=spec["address"],
        store_port=spec["stores"][1] if ranks > 1 else store.port,
        lighthouse_addr=spec["lighthouse"],
        replica_id=rid,
        hostname=spec["address"],
    )
    with DiLoCo(manager, [net], inner, outer, sync_every=h, backup_device=torch.device("cpu"), pin_memory=False):
        while manager.current_step() < spec["rounds"]:
            sampler.set_epoch(epoch)
            for x, y in loader:
                if first:
                    first = False
                    log(
                        "train_start",
                        round=manager.current_step(),
                        sampler="DistributedSampler",
                        sampler_seed=sampler.seed,
                        first_batch=batch_digest(x),
                    )
                inner.zero_grad()
                loss = lm_loss(net(x), y)
                loss.backward()
                if group is not None:
                    grads = [p.grad for p in net.parameters() if p.grad is not None]
                    flat = torch.cat([g.flatten() for g in grads])
                    torch.distributed.all_reduce(flat, group=group)
                    flat /= ranks
                    offset = 0
                    for g in grads:
                        g.copy_(flat[offset : offset + g.numel()].view_as(g))
                        offset += g.numel()
                torch.nn.utils.clip_grad_norm_(net.parameters(), spec["clip"])
                before = manager.current_step()
                inner.step()  # every H-th: quorum (healing first), fp32 all-reduce, commit, outer step
                local_steps += 1
                if spec["step_sleep"]:
                    time.sleep(spec["step_sleep"])
                if local_steps % h == 0:
                    committed = manager.current_step() > before
                    if healed["now"]:  # the step it healed to (the run's, before this round's commit)
                        log("heal", step=manager.current_step() - int(committed))
                    if committed:
                        log(
                            "commit",
                            round=manager.current_step(),
                            ft_step=manager.current_step(),
                            # a replica that healed in this round's quorum sends its source's
                            # pseudo-gradient (the source's model minus the global one): no new samples
                            contributes=not healed["now"],
                            quorum=manager.num_participants(),
                            local_steps=local_steps,
                            # after a committed outer step the parameters are the global model
                            global_digest=digest_state(dict(net.named_parameters())),
                        )
                    else:
                        log("sync_failed", round=before, local_steps=local_steps)
                    healed["now"] = False
                if manager.current_step() >= spec["rounds"]:
                    break
            epoch += 1
    final = {k: v.detach().clone() for k, v in net.state_dict().items()}
    if rank == 0:
        torch.save(final, Path(spec["run_dir"]) / f"final.{rid}.pt")
    log("end", round=manager.current_step(), local_steps=local_steps, digest=digest_state(final))
    manager.shutdown(wait=False)


def replica_main(spec_json: str) -> None:
    import logging

    spec = json.loads(spec_json)
    # rank r > 0 of a replica (Lightning's launcher re-runs this command with LOCAL_RANK set; the
    # torchft replica starts its ranks itself): its events go to a file the controller does not read
    rank = int(spec.get("rank", os.environ.get("LOCAL_RANK", 0)))
    spec["rank"] = rank
    name = f"events.{spec['rid']}.{spec['incarnation']}.jsonl"
    path = Path(spec["run_dir"]) / (name if rank == 0 else f"rank{rank}-{name}")
    log = Events(path, spec["rid"], spec["incarnation"])
    log("boot", pid=os.getpid(), hostname=socket.gethostname())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("torchft").setLevel(logging.INFO)
    import torch

    torch.set_num_threads(1)
    {"package": replica_package, "torchft": replica_torchft}[spec["contender"]](spec, log)


def lighthouse_torchft_main(argv: list[str]) -> None:
    """torchft's own Lighthouse for the torchft contender (nothing of the package)."""
    parser = argparse.ArgumentParser(prog="goodput.py _lighthouse")
    parser.add_argument("--bind", default="[::]:0")
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--join-timeout-ms", type=int, required=True)
    parser.add_argument("--heartbeat-timeout-ms", type=int, required=True)
    args = parser.parse_args(argv)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(f"torchft lighthouse: listening at {server.address()}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


# ================================================================ the controller


@dataclass
class Replica:
    rid: str
    host: int
    address: str
    proc: subprocess.Popen | None = None
    incarnation: int = 0
    killed: bool = False
    log: Any = None


@dataclass
class RunPlan:
    contender: str
    faults: bool
    seed: int
    run_dir: Path
    kills: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def recipe(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], float]:
    """The model and data arguments of the recipe's config, with compare.py's inner optimizer and batch size."""
    import yaml

    config = yaml.safe_load(Path(args.config).read_text())
    model = dict(config["model"])
    model.update(INNER_OPTIMIZER)
    data = dict(config.get("data", {}))
    data["batch_size"] = args.batch_size
    clip = float(config.get("trainer", {}).get("gradient_clip_val") or 0.0) or 1e9
    return model, data, clip


class Controller:
    """Runs one contender once (a Lighthouse and the replicas), with or without the fault schedule."""

    def __init__(self, args: argparse.Namespace, cluster: EmulatedCluster | None, settings: dict[str, Any]) -> None:
        self.args = args
        self.cluster = cluster
        self.settings = settings
        self.env = child_env(HERE, REPO)
        self.env["GLOO_SOCKET_IFNAME"] = "eth0" if cluster else "lo"
        self.port = 29510

    def address(self, host: int) -> str:
        return self.cluster.address(host) if self.cluster else "127.0.0.1"

    def _popen(self, host: int, cmd: list[str], log: Any, uts_hostname: str | None = None) -> subprocess.Popen:
        if uts_hostname is not None:
            # torchft's HTTP checkpoint transport advertises socket.gethostname(), which inside a
            # namespace (or a sandbox) names no address the other replicas can reach: a UTS
            # namespace whose host name *is* the replica's address makes torchft's default work.
            cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', uts_hostname, *cmd]
        kwargs = {"env": self.env, "stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
        return popen_on(self.cluster, host, cmd, **kwargs)

    def _start_lighthouse(self, plan: RunPlan) -> tuple[subprocess.Popen, Any, str]:
        a, n = self.args, self.args.replicas
        self.port += 2  # the package's Lighthouse serves its run store at the next port
        port = self.port if self.cluster else free_port()
        common = [
            "--min-replicas",
            str(a.min_replicas),
            "--join-timeout-ms",
            str(a.join_timeout_ms),
            "--heartbeat-timeout-ms",
            str(a.heartbeat_timeout_ms),
        ]
        if plan.contender == "package":
            cmd = [
                sys.executable,
                "-c",
                "from lightning_commstrats.fault_tolerance import lighthouse_main; lighthouse_main()",
                "--port",
                str(port),
                "--bind",
                "[::]",
                *common,
            ]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "_lighthouse", "--bind", f"[::]:{port}", *common]
        log = open(plan.run_dir / "lighthouse.log", "w")
        proc = self._popen(n, cmd, log)
        wait_for_line(plan.run_dir / "lighthouse.log", "listening at", proc, 60, "the Lighthouse")
        return proc, log, f"http://{self.address(n)}:{port}"

    def _spec(self, plan: RunPlan, replica: Replica, lighthouse: str) -> dict[str, Any]:
        return {
            "contender": plan.contender,
            "rid": replica.rid,
            "incarnation": replica.incarnation,
            "address": replica.address,
            "lighthouse": lighthouse,
            "run_dir": str(plan.run_dir),
            **self.settings["replica"],
            "seed": plan.seed,
        }

    def _start_replica(self, plan: RunPlan, replica: Replica, lighthouse: str) -> None:
        if replica.log is not None:  # the previous incarnation's log
            replica.log.close()
        replica.incarnation += 1
        replica.killed = False
        spec = self._spec(plan, replica, lighthouse)
        replica.log = open(plan.run_dir / f"{replica.rid}.{replica.incarnation}.log", "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "_replica", json.dumps(spec)]
        uts = replica.address if plan.contender == "torchft" else None
        replica.proc = self._popen(replica.host, cmd, replica.log, uts_hostname=uts)

    @staticmethod
    def _kill(proc: subprocess.Popen | None) -> None:
        stop([proc] if proc is not None else [])

    def run(self, plan: RunPlan) -> dict[str, Any]:
        a = self.args
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        for old in plan.run_dir.iterdir():
            if old.is_file():
                old.unlink()
        replicas = [Replica(f"r{i}", i, self.address(i)) for i in range(a.replicas)]
        lighthouse_proc, lighthouse_log, lighthouse = self._start_lighthouse(plan)
        tx0 = [self.cluster.tx_bytes(i) for i in range(a.replicas)] if self.cluster else None
        rng = random.Random(1000 + plan.seed)  # the same kill points for both contenders
        t_start = time.time()
        deadline = time.monotonic() + a.run_timeout
        failure, t_go = None, None
        try:
            for r in replicas:
                self._start_replica(plan, r, lighthouse)
            # every replica booted (imports, data, model) before any starts: a fair start for both contenders
            while len(list(plan.run_dir.glob("ready.*"))) < a.replicas:
                bad = [r.rid for r in replicas if r.proc.poll() is not None]
                if bad or time.monotonic() > deadline:
                    failure = f"replicas {bad or 'all'} did not boot"
                    print(f"   {failure}:\n{tails(plan.run_dir)}", flush=True)
                    break
                time.sleep(0.1)
            else:
                t_go = time.time()
                (plan.run_dir / "go").touch()
                print(f"   go after {t_go - t_start:.1f} s of boot", flush=True)
                failure = self._watch(plan, replicas, lighthouse, rng, deadline)
                if failure:
                    print(f"   FAILURE: {failure}\n{tails(plan.run_dir)}", flush=True)
        finally:
            for r in replicas:
                self._kill(r.proc)
                if r.log:
                    r.log.close()
            tx1 = [self.cluster.tx_bytes(i) for i in range(a.replicas)] if self.cluster else None
            self._kill(lighthouse_proc)
            lighthouse_log.close()
        row = summarize(plan, self.settings, t_go, tx0, tx1)
        row["failure"] = failure
        return row

    def _watch(
        self, plan: RunPlan, replicas: list[Replica], lighthouse: str, rng: random.Random, deadline: float
    ) -> str | None:
        """Drive the fault schedule until every replica has ended; returns what went wrong, if anything."""
        a = self.args
        reader = EventReader(plan.run_dir)
        next_kill_round = a.kill_every
        kill_at: tuple[float, Replica] | None = None
        restart_at: list[tuple[float, Replica]] = []
        first_end: float | None = None
        while True:
            now = time.time()
            reader.poll()
            top = reader.max_round()
            if time.monotonic() > deadline:
                return f"timed out after {a.run_timeout:.0f} s at round {top}"
            # the fault schedule
            if (
                plan.faults
                and kill_at is None
                and len(plan.kills) < a.max_kills
                and next_kill_round + a.min_rounds_after_kill <= a.rounds
                and top >= next_kill_round
            ):
                victim = replicas[len(plan.kills) % len(replicas)]
                phase = rng.random() if a.kill_phase is None else a.kill_phase
                kill_at = (now + phase * reader.round_seconds(), victim)
                plan.kills.append({"after_round": top, "phase": phase, "rid": victim.rid})
                next_kill_round += a.kill_every
            if kill_at is not None and now >= kill_at[0]:
                victim = kill_at[1]
                kill_at = None
                record = plan.kills[-1]
                if victim.proc is not None and victim.proc.poll() is None:
                    self._kill(victim.proc)
                    victim.killed = True
                    record.update(t=time.time(), round_at_kill=reader.max_round(), killed=True)
                    restart_at.append((time.time() + a.restart_after, victim))
                    print(f"   killed {victim.rid} at round {record['round_at_kill']}", flush=True)
                else:
                    record.update(t=time.time(), killed=False, why="the victim was not running")
            for when, r in list(restart_at):
                if now >= when and reader.ended():
                    restart_at.remove((when, r))
                    plan.notes.append(f"{r.rid} was not restarted: the run had ended")
                elif now >= when:
                    restart_at.remove((when, r))
                    self._start_replica(plan, r, lighthouse)
                    for k in reversed(plan.kills):
                        if k["rid"] == r.rid and "restarted" not in k:
                            k["restarted"] = time.time()
                            break
                    print(f"   restarted {r.rid} (incarnation {r.incarnation})", flush=True)
            # how the replicas are doing
            running = [r for r in replicas if r.proc is not None and r.proc.poll() is None]
            for r in replicas:
                if r.proc is not None and r.proc.poll() not in (None, 0) and not r.killed:
                    log = plan.run_dir / f"{r.rid}.{r.incarnation}.log"
                    if "has nothing to join: the run has ended" in log.read_text(errors="replace"):
                        # restarted too late: the run's store told it the run was over, and it exited saying so
                        r.killed = True
                        plan.notes.append(
                            f"{r.rid} (incarnation {r.incarnation}) came back after the run ended and exited, saying so"
                        )
                        continue
                    return f"replica {r.rid} (incarnation {r.incarnation}) exited with {r.proc.returncode}"
            if reader.ended() and first_end is None:
                first_end = now
            if not running and not restart_at and kill_at is None:
                return None
            if first_end is not None and now - first_end > a.end_grace:
                for r in running:
                    self._kill(r.proc)
                    r.killed = True
                    plan.notes.append(
                        f"{r.rid} (incarnation {r.incarnation}) was still running {a.end_grace:.0f} s after the"
                        " first replica ended: killed (it had not rejoined before the run ended)"
                    )
                return None
            time.sleep(0.2)


class EventReader:
    """The replicas' event logs of one run, read as they grow."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.offsets: dict[Path, int] = {}
        self.events: list[dict[str, Any]] = []

    def poll(self) -> None:
        for path in sorted(self.run_dir.glob("events.*.jsonl")):
            with open(path) as f:
                f.seek(self.offsets.get(path, 0))
                text = f.read()
            complete = text[: text.rfind("\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            self.events += [json.loads(line) for line in complete.splitlines() if line.strip()]

    def max_round(self) -> int:
        return max((e["round"] for e in self.events if e["event"] == "commit"), default=0)

    def round_seconds(self) -> float:
        """Mean seconds per committed round so far (first commit of each round)."""
        firsts: dict[int, float] = {}
        for e in self.events:
            if e["event"] == "commit":
                firsts[e["round"]] = min(firsts.get(e["round"], math.inf), e["t"])
        rounds = sorted(firsts)
        if len(rounds) < 2:
            return 1.0
        return (firsts[rounds[-1]] - firsts[rounds[0]]) / (rounds[-1] - rounds[0])

    def ended(self) -> bool:
        return any(e["event"] == "end" for e in self.events)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    reader = EventReader(run_dir)
    reader.poll()
    return reader.events


def tails(run_dir: Path, lines: int = 30) -> str:
    parts = []
    for path in sorted(run_dir.glob("*.log")):
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        parts.append(f"--- {path.name}\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)


# ================================================================ figures


def summarize(
    plan: RunPlan, settings: dict[str, Any], t_go: float | None, tx0: list[int] | None, tx1: list[int] | None
) -> dict[str, Any]:
    """One run's figures from its replicas' event logs (see the README for each definition)."""
    rep = settings["replica"]
    h, batch, n, rounds = rep["sync_period"], rep["data"]["batch_size"], settings["replicas"], rep["rounds"]
    events = read_events(plan.run_dir)
    commits: dict[tuple[str, int], dict[str, Any]] = {}
    for e in events:
        if e["event"] == "commit":
            commits.setdefault((e["rid"], e["round"]), e)  # one record per replica and round
    by_round: dict[int, list[dict[str, Any]]] = {}
    for (_, rnd), e in commits.items():
        by_round.setdefault(rnd, []).append(e)
    contributors = {rnd: sum(1 for e in es if e["contributes"]) for rnd, es in by_round.items()}
    # rounds after which the replicas that committed them hold different global models
    split_rounds = sorted(rnd for rnd, es in by_round.items() if len({e.get("global_digest") for e in es}) > 1)
    committed_rounds = max(by_round, default=0)
    final_round_t = max((e["t"] for e in by_round.get(committed_rounds, [])), default=None)
    wall = final_round_t - t_go if final_round_t and t_go else None
    contributor_rounds = sum(contributors.values())
    useful = contributor_rounds * h * batch * settings.get("ranks", 1)  # every rank of a replica reads a batch
    ends = [e for e in events if e["event"] == "end"]
    digests = sorted({e["digest"] for e in ends})
    starts = [e for e in events if e["event"] == "train_start"]
    heals = [e for e in events if e["event"] == "heal"]
    failed = [e for e in events if e["event"] == "sync_failed"]
    quorums = [e["quorum"] for e in commits.values() if e.get("quorum")]
    comm: dict[str, float] = {}
    last_by_incarnation: dict[tuple[str, int], dict[str, Any]] = {}
    for e in events:
        if e.get("comm_bytes") is not None:
            last_by_incarnation[(e["rid"], e["incarnation"])] = e["comm_bytes"]
    for bytes_by_tag in last_by_incarnation.values():
        for tag, b in bytes_by_tag.items():
            comm[tag] = comm.get(tag, 0.0) + b
    tx = [b - a for a, b in zip(tx0, tx1, strict=True)] if tx0 and tx1 else None
    # what the package logged as a warning (e.g. replicas found holding different global models)
    warnings = [
        line.strip()
        for path in sorted(plan.run_dir.glob("r*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if "lightning_commstrats" in line and "WARNING" in line
    ]
    return {
        "contender": plan.contender,
        "label": LABELS[plan.contender],
        "faults": plan.faults,
        "seed": plan.seed,
        "rounds_planned": rounds,
        "committed_rounds": committed_rounds,
        "contributors_per_round": {str(k): v for k, v in sorted(contributors.items())},
        "contributor_rounds": contributor_rounds,
        "contributor_rounds_possible": n * committed_rounds,
        "useful_samples": useful,
        "train_wall_seconds": wall,
        "goodput_samples_per_s": useful / wall if wall else None,
        "kills": [k for k in plan.kills if k.get("killed")],
        "kills_planned": plan.kills,
        "restarts": sum(1 for k in plan.kills if "restarted" in k),
        "incarnations_started": len({(e["rid"], e["incarnation"]) for e in events if e["event"] == "boot"}),
        "heals": len(heals),
        "heal_events": [{k: e.get(k) for k in ("rid", "incarnation", "step", "t")} for e in heals],
        "joined_healed": sum(1 for e in starts if e["round"] > 0),
        "failed_sync_attempts": len(failed),
        "failed_syncs": [{k: e.get(k) for k in ("rid", "incarnation", "round", "error", "t")} for e in failed],
        "min_quorum": min(quorums) if quorums else None,
        "mean_quorum": statistics.fmean(quorums) if quorums else None,
        "replicas_finished": len(ends),
        "final_digests": digests,
        "replicas_agree": len(digests) == 1,
        "rounds_with_different_global_models": split_rounds,
        "tx_bytes_per_replica": tx,
        "tx_mb_per_replica_mean": statistics.fmean(tx) / 1e6 if tx else None,
        "comm_stats_bytes_by_tag_all_replicas": comm or None,
        "comm_stats_mb_per_replica": sum(comm.values()) / n / 1e6 if comm else None,
        "data_order": sorted(
            {
                (e["rid"], e.get("sampler"), e.get("sampler_seed"), e.get("first_batch"))
                for e in starts
                if e["incarnation"] == 1
            }
        ),
        "package_warnings": len(warnings),
        "package_warning_examples": warnings[:5],
        "notes": plan.notes,
    }


def evaluate(args: argparse.Namespace, settings: dict[str, Any], run_dir: Path) -> float | None:
    """Validation perplexity of the run's final global model (one replica's: they agree or the row says not)."""
    finals = sorted(run_dir.glob("final.*.pt"))
    if not finals:
        return None
    import torch
    from torch.nn import functional as F

    from lightning_commstrats.data import LMDataModule
    from lightning_commstrats.data.corpus import IGNORE_INDEX
    from lightning_commstrats.models import LanguageModel

    rep = settings["replica"]
    dm = LMDataModule(**rep["data"])
    dm.prepare_data()
    model = LanguageModel(**rep["model"], vocab_size=dm.vocab_size)
    model.net.load_state_dict(torch.load(finals[0], weights_only=True))
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i, (x, y) in enumerate(dm.val_dataloader()):
            if args.val_batches and i >= args.val_batches:
                break
            logits = model(x).float()
            nll += float(
                F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            )
            count += int((y != IGNORE_INDEX).sum())
    return math.exp(nll / count) if count else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def table(rows: list[dict[str, Any]], settings: dict[str, Any], where: str) -> str:
    rep = settings["replica"]
    n = settings["replicas"]
    lines = [
        f"# Goodput under faults ({where})",
        "",
        f"{n} replicas ({settings.get('ranks', 1)} process(es) and one host each), {settings['config']}"
        f" (vocabulary {settings['vocab_size']},"
        f" {settings['params'] / 1e6:.2f} M parameters), batch {rep['data']['batch_size']} windows of"
        f" {rep['data']['seq_len']} tokens per rank and step, inner AdamW (lr {rep['model']['lr']}, weight decay"
        f" {rep['model']['weight_decay']}, clip {rep['clip']:g}); DiLoCo H = {rep['sync_period']} inner steps,"
        f" outer Nesterov SGD lr {OUTER_LR} momentum {OUTER_MOMENTUM}; {rep['rounds']} committed outer rounds per run."
        f" Faults: SIGKILL of one replica's process group every {settings['kill_every']} rounds (at most"
        f" {settings['max_kills']}, rotating, at a seeded random point of the round), restart"
        f" {settings['restart_after']:g} s later from a fresh initialisation. Lighthouse: min replicas"
        f" {rep['min_replicas']}, join timeout {settings['join_timeout_ms']} ms, heartbeat timeout"
        f" {settings['heartbeat_timeout_ms']} ms; collective timeout {rep['timeout']:.0f} s."
        + (f" Every inner step also sleeps {rep['step_sleep']:g} s (smoke run)." if rep["step_sleep"] else ""),
        "",
        "Goodput = useful samples / training wall seconds; useful samples = sum over committed outer rounds of"
        f" the replicas whose block entered the outer step x H x batch (README). Perplexity: the final global"
        f" model after {rep['rounds']} committed outer rounds (equal committed rounds, not equal samples),"
        f" on {'all' if not settings['val_batches'] else settings['val_batches']} validation batches.",
        "",
        "| contender | faults | seed | committed rounds | kills / restarts / heals | failed sync attempts"
        " | contributing replica-rounds | useful samples | training wall s | goodput samples/s"
        " | goodput vs fault-free | val ppl | MB sent per replica (interface) | MB per replica (comm_stats)"
        " | quorum min / mean | replicas agree (end; every round) | problems |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    free = {(r["contender"], r["seed"]): r for r in rows if not r["faults"]}
    for r in rows:
        base = free.get((r["contender"], r["seed"]))
        ratio = (
            r["goodput_samples_per_s"] / base["goodput_samples_per_s"]
            if r["faults"] and base and base["goodput_samples_per_s"] and r["goodput_samples_per_s"]
            else None
        )
        warned = (
            f"{r['package_warnings']} package warnings, first:"
            f" {r['package_warning_examples'][0].split(' WARNING ')[-1]}"
            if r.get("package_warnings")
            else None
        )
        problems = "; ".join(filter(None, [r.get("failure"), warned, *r.get("notes", [])])) or "-"
        cells = [
            r["label"],
            "yes" if r["faults"] else "no",
            str(r["seed"]),
            f"{r['committed_rounds']} of {r['rounds_planned']}",
            f"{len(r['kills'])} / {r['restarts']} / {r['heals']}",
            str(r["failed_sync_attempts"]),
            f"{r['contributor_rounds']} of {r['contributor_rounds_possible']}",
            str(r["useful_samples"]),
            _fmt(r["train_wall_seconds"], "{:.1f}"),
            _fmt(r["goodput_samples_per_s"], "{:.1f}"),
            _fmt(ratio * 100 if ratio is not None else None, "{:.1f}%"),
            _fmt(r.get("val_ppl"), "{:.1f}"),
            _fmt(r["tx_mb_per_replica_mean"], "{:.2f}"),
            _fmt(r["comm_stats_mb_per_replica"], "{:.2f}"),
            f"{r['min_quorum']} / {_fmt(r['mean_quorum'], '{:.2f}')}",
            ("yes" if r["replicas_agree"] else f"NO ({len(r['final_digests'])} models)")
            + (
                f"; {len(r['rounds_with_different_global_models'])} rounds with different global models"
                if r.get("rounds_with_different_global_models")
                else ""
            ),
            problems,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Goodput ratios (faulty / fault-free, same contender and seed; mean over seeds)", ""]
    for contender in CONTENDERS:
        ratios = []
        for r in rows:
            base = free.get((contender, r["seed"]))
            if (
                r["contender"] == contender
                and r["faults"]
                and base
                and base["goodput_samples_per_s"]
                and r["goodput_samples_per_s"]
            ):
                ratios.append(r["goodput_samples_per_s"] / base["goodput_samples_per_s"])
        if ratios:
            mean = statistics.fmean(ratios)
            bar = f" (the issue's bar: >= {GOODPUT_BAR:.0%}: {'met' if mean >= GOODPUT_BAR else 'NOT met'})"
            lines.append(
                f"- {LABELS[contender]}: {mean:.1%} ({', '.join(f'{x:.1%}' for x in ratios)})"
                + (bar if contender == "package" else "")
            )
    lines += ["", "## Package against torchft's DiLoCo (same faults, mean over seeds)", ""]
    for faults in (False, True):
        g = {
            c: [
                r["goodput_samples_per_s"]
                for r in rows
                if r["contender"] == c and r["faults"] == faults and r["goodput_samples_per_s"]
            ]
            for c in CONTENDERS
        }
        p = {
            c: [r["val_ppl"] for r in rows if r["contender"] == c and r["faults"] == faults and r.get("val_ppl")]
            for c in CONTENDERS
        }
        if all(g.values()):
            ours, theirs = statistics.fmean(g["package"]), statistics.fmean(g["torchft"])
            line = (
                f"- {'with' if faults else 'without'} faults: goodput {ours:.1f} vs {theirs:.1f} samples/s"
                f" ({ours / theirs:.2f}x)"
            )
            if all(p.values()):
                line += f"; val ppl {statistics.fmean(p['package']):.1f} vs {statistics.fmean(p['torchft']):.1f}"
            lines.append(line)
    return "\n".join(lines)


# ================================================================ main


def make_settings(args: argparse.Namespace, rate: float | None) -> dict[str, Any]:
    """Everything a replica needs, and what makes the rows of a table comparable."""
    from lightning_commstrats.data import LMDataModule
    from lightning_commstrats.models import LanguageModel

    model_kwargs, data_kwargs, clip = recipe(args)
    dm = LMDataModule(**data_kwargs)
    dm.prepare_data()  # trains and caches the tokenizer once, before the replicas read it
    params = sum(p.numel() for p in LanguageModel(**model_kwargs, vocab_size=dm.vocab_size).parameters())
    # Timeouts from the slowest transfer: torchft's heal carries about 5 model copies (model, the
    # inner AdamW's two moments, the global weights, the outer momentum), fp32.
    link = rate or 1000.0
    heal_seconds = 5 * params * 4 * 8 / (link * 1e6)
    timeout = args.timeout or max(60.0, 3 * heal_seconds + 30)
    return {
        "config": Path(args.config).name,
        "vocab_size": dm.vocab_size,
        "params": params,
        "replicas": args.replicas,
        "ranks": args.ranks,
        "kill_every": args.kill_every,
        "max_kills": args.max_kills,
        "restart_after": args.restart_after,
        "join_timeout_ms": args.join_timeout_ms,
        "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
        "val_batches": args.val_batches,
        "replica": {
            "model": model_kwargs,
            "data": data_kwargs,
            "clip": clip,
            "sync_period": args.sync_period,
            "rounds": args.rounds,
            "bits": PSEUDO_GRAD_BITS,
            "min_replicas": args.min_replicas,
            "timeout": timeout,
            "quorum_timeout": max(600.0, 3 * timeout),
            "connect_timeout": 30.0,
            "step_sleep": args.step_sleep,
            "ranks": args.ranks,
        },
    }


def run_rate(args: argparse.Namespace, rate: float, out: Path, logs: Path) -> str:
    # the replicas' hosts and one for the Lighthouse
    with cluster_or_loopback(args.loopback, args.replicas + 1, rate, prefix=CLUSTER_PREFIX) as (cluster, where):
        loopback = cluster is None
        settings = make_settings(args, None if loopback else rate)
        controller = Controller(args, cluster, settings)
        rows = []
        for seed in args.seeds:
            for contender in args.contenders:
                for faults in (False, True):
                    name = f"{contender}-{'faults' if faults else 'nofaults'}-seed{seed}"
                    plan = RunPlan(contender, faults, seed, logs / name)
                    print(
                        f"== {where}: {LABELS[contender]}, {'with' if faults else 'without'} faults, seed {seed}",
                        flush=True,
                    )
                    started = time.time()
                    row = controller.run(plan)
                    row["job_seconds"] = time.time() - started
                    row["val_ppl"] = evaluate(args, settings, plan.run_dir)
                    row["logs"] = portable(plan.run_dir)
                    rows.append(row)
                    print(
                        f"   {row['committed_rounds']} rounds, {len(row['kills'])} kills, {row['heals']} heals,"
                        f" goodput {_fmt(row['goodput_samples_per_s'], '{:.1f}')} samples/s,"
                        f" val ppl {_fmt(row['val_ppl'], '{:.1f}')}, {row['job_seconds']:.0f} s"
                        + (f"; FAILURE: {row['failure']}" if row["failure"] else ""),
                        flush=True,
                    )
    text = table(rows, settings, where)
    data = {
        "where": where,
        "rate_mbit": None if loopback else rate,
        "settings": settings,
        "args": portable_args(args),
        "rows": rows,
    }
    write_results(out, text, data, default=str)
    print(text, flush=True)
    return where


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_replica":
        replica_main(sys.argv[2])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_lighthouse":
        lighthouse_torchft_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 3 replicas, one kill, minutes")
    parser.add_argument("--loopback", action="store_true", help="do not build namespaces; use loopback")
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 10.0], help="link rates, Mbit/s")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1, help="processes per replica (gradients averaged inside)")
    parser.add_argument("--min-replicas", type=int, default=2, help="fewest replicas a sync may average over")
    parser.add_argument("--sync-period", type=int, default=SYNC_PERIOD, help="H, inner steps per outer round")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="committed outer rounds per run")
    parser.add_argument("--kill-every", type=int, default=KILL_EVERY, help="outer rounds between kills")
    parser.add_argument("--max-kills", type=int, default=1000, help="at most this many kills per run")
    parser.add_argument(
        "--min-rounds-after-kill",
        type=int,
        help="no kill later than this many rounds before the end (default kill_every / 2, at least 2)",
    )
    parser.add_argument("--kill-phase", type=float, help="point of the round to kill at, 0..1 (default: seeded random)")
    parser.add_argument("--restart-after", type=float, default=RESTART_AFTER, help="seconds from a kill to the restart")
    parser.add_argument("--join-timeout-ms", type=int, default=5000, help="Lighthouse: wait for live stragglers")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=3000, help="Lighthouse: silent this long = dead")
    parser.add_argument("--timeout", type=float, help="collective / heal timeout, s (default from the link rate)")
    parser.add_argument("--batch-size", type=int, default=32, help="windows per replica and step (compare.py's)")
    parser.add_argument("--val-batches", type=int, default=0, help="validation batches for the final ppl (0: all)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds slept after every inner step")
    parser.add_argument("--config", default=str(REPO / "lightning_commstrats" / "configs" / "lstm_demo.yaml"))
    parser.add_argument("--run-timeout", type=float, default=4 * 3600.0, help="seconds per run before giving up")
    parser.add_argument("--end-grace", type=float, help="seconds a replica may run on after the first ended")
    parser.add_argument("--out", default=str(HERE / "results" / "goodput"))
    parser.add_argument("--logs", help="folder for the runs' logs and event files (default: a new temp folder)")
    args = parser.parse_args()
    if args.quick:
        args.config = str(REPO / "lightning_commstrats" / "configs" / "lstm_tiny.yaml")
        args.replicas, args.batch_size, args.sync_period, args.rounds = 3, 8, 8, 30
        args.kill_every, args.max_kills, args.restart_after, args.rates = 8, 1, 1.0, [100.0]
        args.val_batches, args.step_sleep, args.join_timeout_ms = 10, 0.05, 2000
        args.run_timeout = 600.0
        out_root = Path(args.out) / "quick"
    else:
        out_root = Path(args.out)
    if args.min_rounds_after_kill is None:
        args.min_rounds_after_kill = max(2, args.kill_every // 2)
    if args.end_grace is None:
        args.end_grace = 120.0
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="goodput-"))
    print(f"logs and event files: {logs}", flush=True)
    for rate in args.rates:
        out = out_root if args.quick else out_root / f"rate{rate:g}"
        where = run_rate(args, rate, out, logs / f"rate{rate:g}")
        if where.startswith("loopback"):
            break  # every rate would be the same loopback run


if __name__ == "__main__":
    main()
