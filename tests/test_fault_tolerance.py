"""Fault-tolerance settings and bad input: refused when built, naming the setting; an unreachable
Lighthouse and a quorum that can never reach ``min_replicas`` fail in bounded time, saying so.
The real multi-replica runs are in tests/multiprocess/test_fault_tolerance_ranks.py."""

from __future__ import annotations

import itertools
import socket
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_commstrats import (
    AllReduceStrategy,
    BMUFStrategy,
    DiLoCoStrategy,
    FabricStrategy,
    FaultTolerance,
    ModelAveragingStrategy,
    OneBitSGDStrategy,
    PeriodicSyncStrategy,
    StreamingDiLoCoStrategy,
)
from lightning_commstrats.comm import MPI4PY_AVAILABLE, CollectiveError
from lightning_commstrats.fault_tolerance import LIGHTHOUSE_ENV, lighthouse_main

LH = "http://127.0.0.1:29510"
FT = {"lighthouse": LH, "replica_id": "r0"}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"replica_id": "r0"}, "fault_tolerance.lighthouse is not set and TORCHFT_LIGHTHOUSE is empty"),
        ({**FT, "lighthouse": "ftp://host:1"}, r"fault_tolerance.lighthouse='ftp://host:1' is not an address"),
        ({**FT, "lighthouse": "http://host"}, r"fault_tolerance.lighthouse='http://host' is not an address"),
        ({**FT, "replica_id": ""}, "fault_tolerance.replica_id must be a non-empty name"),
        ({**FT, "replica_id": "a:b"}, "fault_tolerance.replica_id must be a non-empty name without ':'"),
        ({**FT, "min_replicas": 0}, "fault_tolerance.min_replicas must be an int >= 1, got 0"),
        ({**FT, "timeout": 0}, "fault_tolerance.timeout must be a number of seconds > 0"),
        ({**FT, "timeout": 60, "quorum_timeout": 30}, "fault_tolerance.timeout=60 must be < quorum_timeout=30"),
        ({**FT, "max_sync_attempts": 0}, "fault_tolerance.max_sync_attempts must be an int >= 1"),
        ({**FT, "lighthose": LH}, r"fault_tolerance got unknown setting\(s\) \['lighthose'\]"),
    ],
)
def test_bad_settings_name_the_setting(settings, match, monkeypatch):
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(ValueError, match=match):
        DiLoCoStrategy(fault_tolerance=settings)


def test_settings_from_the_environment_and_as_an_object(monkeypatch):
    monkeypatch.setenv(LIGHTHOUSE_ENV, "host:29510")
    config = FaultTolerance(replica_id="r1", min_replicas=2)
    assert config.lighthouse == "http://host:29510"
    strategy = StreamingDiLoCoStrategy(fault_tolerance=config)
    assert strategy.fault_tolerance is config
    # the data order is the replica's own, and the same after a restart
    assert (
        FaultTolerance(replica_id="r1").data_seed() == config.data_seed() != FaultTolerance(replica_id="r2").data_seed()
    )


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: AllReduceStrategy(fault_tolerance=FT), "AllReduceStrategy cannot honour fault_tolerance"),
        (lambda: OneBitSGDStrategy(fault_tolerance=FT), "OneBitSGDStrategy cannot honour fault_tolerance"),
        (lambda: BMUFStrategy(fault_tolerance=FT), "fault_tolerance needs sync_period_unit='steps', got 'samples'"),
        (
            lambda: PeriodicSyncStrategy(8, "steps", parallelization_start=4, fault_tolerance=FT),
            r"fault_tolerance does not take a warm start \(parallelization_start=4\)",
        ),
        (
            lambda: ModelAveragingStrategy(8, "steps", average_optimizer_state=True, fault_tolerance=FT),
            "average_optimizer_state=True cannot be honoured with fault_tolerance",
        ),
        (lambda: FabricStrategy("allreduce", fault_tolerance=FT), "AllReduceStrategy cannot honour fault_tolerance"),
    ],
)
def test_schemes_that_cannot_honour_it_say_so(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.skipif(not MPI4PY_AVAILABLE, reason="local_sgd needs the [mpi] extra")
def test_local_sgd_refuses_fault_tolerance():
    from lightning_commstrats import LocalSGDStrategy

    with pytest.raises(ValueError, match="local_sgd cannot honour fault_tolerance"):
        LocalSGDStrategy(fault_tolerance=FT)


def test_every_periodic_scheme_takes_the_same_setting():
    for make in (
        lambda: DiLoCoStrategy(fault_tolerance=FT),
        lambda: StreamingDiLoCoStrategy(fault_tolerance=FT),
        lambda: BMUFStrategy(sync_period=8, sync_period_unit="steps", fault_tolerance=FT),
        lambda: ModelAveragingStrategy(sync_period=8, sync_period_unit="steps", fault_tolerance=FT),
        lambda: FabricStrategy("diloco", fault_tolerance=FT),
    ):
        strategy = make()
        scheme = getattr(strategy, "scheme", strategy)
        assert scheme.fault_tolerance == FaultTolerance(**FT)


def fit(strategy) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())


def test_an_unreachable_lighthouse_fails_within_the_connect_timeout():
    port = closed_port()
    start = time.monotonic()
    settings = {"lighthouse": f"http://127.0.0.1:{port}", "replica_id": "r0", "connect_timeout": 2.0}
    with pytest.raises(
        ConnectionError, match=rf"fault_tolerance.lighthouse='http://127.0.0.1:{port}' cannot be reached"
    ):
        fit(DiLoCoStrategy(sync_period=2, fault_tolerance=settings))
    assert time.monotonic() - start < 30


def test_a_quorum_below_min_replicas_fails_after_the_quorum_timeout():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    try:
        port = int(server.address().rsplit(":", 1)[1])
        settings = {
            "lighthouse": f"http://127.0.0.1:{port}",
            "replica_id": "alone",
            "min_replicas": 2,  # no second replica will ever come
            "quorum_timeout": 4.0,
            "timeout": 2.0,
        }
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"fewer than fault_tolerance.min_replicas=2, for quorum_timeout=4.0 s"):
            fit(DiLoCoStrategy(sync_period=2, fault_tolerance=settings))
        assert time.monotonic() - start < 60
    finally:
        server.shutdown()


def test_lighthouse_command_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        lighthouse_main(["--min-replicas", "0"])
    assert "--min-replicas must be >= 1, got 0" in capsys.readouterr().err


def test_fingerprint_tells_models_apart_by_their_bits_whatever_the_chunking(monkeypatch):
    import torch

    from lightning_commstrats import replicas

    g = torch.Generator().manual_seed(0)
    model = [torch.randn(1000, generator=g), torch.randn(37, generator=g)]
    base = replicas.fingerprint(model)
    assert torch.equal(base, replicas.fingerprint([t.clone() for t in model]))
    # one value one ulp away, two values swapped, a zero's sign: all seen
    nudged = [model[0].clone(), model[1]]
    nudged[0][500] = torch.nextafter(nudged[0][500], torch.tensor(float("inf")))
    swapped = [model[0].clone(), model[1]]
    swapped[0][[3, 4]] = swapped[0][[4, 3]]
    for other in (nudged, swapped):
        assert not torch.equal(base, replicas.fingerprint(other))
    assert not torch.equal(replicas.fingerprint([torch.zeros(3)]), replicas.fingerprint([-torch.zeros(3)]))
    # the same bits cut into other chunks, or into other tensors, give the same fingerprint
    monkeypatch.setattr(replicas, "FINGERPRINT_CHUNK", 7)
    assert torch.equal(base, replicas.fingerprint(model))
    assert torch.equal(base, replicas.fingerprint([torch.cat(model)[:400], torch.cat(model)[400:]]))


def test_the_lighthouse_default_join_timeout_leaves_room_for_a_renewal():
    # a waiting replica renews its request every quorum_renew_interval; the Lighthouse's join timeout,
    # counted from the oldest pending request, must be longer, or the renewal cannot keep it fresh
    from lightning_commstrats.fault_tolerance import lighthouse_parser

    join_ms = lighthouse_parser().parse_args([]).join_timeout_ms
    assert FaultTolerance(**FT).quorum_renew_interval * 1000 < join_ms


def test_a_quorum_request_that_fails_at_once_is_not_retried_in_a_busy_loop():
    # the Manager shut down (or the Lighthouse gone) while a sync waits for a quorum: every request
    # fails at once; the wait renews at the renewal's pace until quorum_timeout, then says so
    from datetime import timedelta  # noqa: F401 (the fake takes torchft's arguments)

    from lightning_commstrats.comm.stats import CommStats
    from lightning_commstrats.fault_tolerance import ReplicaSync

    calls = []

    class Gone:
        _quorum_future = None

        def start_quorum(self, timeout):
            calls.append(timeout)
            raise RuntimeError("manager is shut down")

    sync = object.__new__(ReplicaSync)
    sync.config = FaultTolerance(**{**FT, "quorum_timeout": 1.5, "timeout": 1.0, "quorum_renew_interval": 0.5})
    sync.manager, sync.closed, sync.run_store, sync._received = Gone(), False, None, None
    sync.renew_interval, sync.stats = 0.5, CommStats()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within quorum_timeout=1\.5 s"):
        sync.quorum()
    assert 1.4 < time.monotonic() - start < 5
    assert len(calls) <= 5, len(calls)


def test_a_quorum_timeout_above_the_collective_timeout_is_refused():
    settings = {**FT, "quorum_timeout": 120.0}
    with pytest.raises(ValueError, match=r"quorum_timeout=120.0 s must be below timeout=60 s"):
        DiLoCoStrategy(fault_tolerance=settings, timeout=60)
    DiLoCoStrategy(fault_tolerance=settings, timeout=600)


def test_sparseloco_takes_fault_tolerance_and_the_refusals_name_it():
    from lightning_commstrats import SparseLoCoStrategy

    assert SparseLoCoStrategy(fault_tolerance=FT).fault_tolerance == FaultTolerance(**FT)
    with pytest.raises(ValueError, match="sparseloco"):
        OneBitSGDStrategy(fault_tolerance=FT)


def test_slices_cut_whole_tensors_into_runs_of_about_equal_size():
    from lightning_commstrats.replicas import slice_bounds

    sizes = [100, 5, 5, 90, 200, 1]
    for parts in (1, 2, 3, 4, 8):
        bounds = slice_bounds(sizes, parts)
        assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
        assert all(b[1] == c[0] for b, c in itertools.pairwise(bounds))  # contiguous, every tensor once
    assert slice_bounds(sizes, 2) == [(0, 4), (4, 6)]  # 200 | 201
    one = slice_bounds([7], 3)  # fewer tensors than parts: the others' runs are empty
    assert sorted(e - b for b, e in one) == [0, 0, 1]


def test_renewals_are_paced_by_the_lighthouse_join_timeout_from_the_run_store():
    # a renewal that falls when the join timeout elapses cancels the quorum it waited for (a run
    # stalled two minutes with both at 2 s): the replica renews at most every 0.4 join timeouts
    from torch.distributed import TCPStore

    from lightning_commstrats.fault_tolerance import RunStore, paced_renewal

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    master.set(RunStore.JOIN_TIMEOUT_KEY, "2000")
    store = RunStore.connect(FaultTolerance(**{**FT, "run_store": f"127.0.0.1:{master.port}"}))
    assert store is not None and store.join_timeout_ms() == 2000 and store.ended() is None
    assert paced_renewal(2.0, store.join_timeout_ms()) == pytest.approx(0.8)
    assert paced_renewal(0.5, 2000) == 0.5 and paced_renewal(2.0, None) == 2.0
    store.mark_ended("replica 'x' finished it at optimizer step 7")
    assert "step 7" in store.ended()


def _waiting_sync(stats, quorum_seconds: float, commit_seconds: float):
    """A ReplicaSync over a stand-in Manager whose quorum and commit take known times."""
    from lightning_commstrats.fault_tolerance import ReplicaSync

    class Slow:
        _quorum_future = None

        def start_quorum(self, timeout):
            time.sleep(quorum_seconds)

        def num_participants(self):
            return 2

        def errored(self):
            return None

        def participating_rank(self):
            return 0

        def current_step(self):
            return 3

        def should_commit(self, timeout):
            time.sleep(commit_seconds)
            return True

    sync = object.__new__(ReplicaSync)
    sync.config = FaultTolerance(**FT)
    sync.manager, sync.closed, sync.run_store, sync._received = Slow(), False, None, None
    sync.renew_interval, sync.pg, sync.stats, sync.host = 2.0, None, stats, True
    sync.device = torch.device("cpu")
    return sync


def test_the_waits_for_a_quorum_and_a_commit_are_the_loops_waiting_or_background_work():
    import threading

    from lightning_commstrats.comm.stats import CommStats

    stats = CommStats()  # made here: this thread is the training loop's
    sync = _waiting_sync(stats, 0.3, 0.2)
    sync.quorum()
    assert sync.commit(True)
    # a blocking sync waits in the loop's thread: waiting, not compute
    assert 0.5 <= stats.comm_seconds < 2.0, stats.comm_seconds
    assert stats.by_tag["quorum"].comm_seconds == stats.comm_seconds and stats.calls == 0
    assert stats.background_seconds == 0.0
    # a delayed sync waits in the exchange's thread: background work (the loop's own wait for that
    # thread is charged where it joins it), not counted twice
    before = stats.comm_seconds
    worker = threading.Thread(target=lambda: (sync.quorum(), sync.commit(True)))
    worker.start()
    worker.join()
    assert stats.comm_seconds == before
    assert 0.5 <= stats.background_seconds < 2.0, stats.background_seconds


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening at ``port`` (Linux's /proc/net/tcp, tcp6)."""
    import ipaddress

    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hexport = local.partition(":")
            if state != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # the kernel writes each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(str(ipaddress.ip_address(raw)))
    return found


@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
@pytest.mark.parametrize(
    ("settings", "expected"),
    [({"hostname": "127.0.0.1"}, {"127.0.0.1"}), ({"hostname": "127.0.0.1", "store_bind": "0.0.0.0"}, {"0.0.0.0"})],
    ids=["advertised", "every-interface"],
)
def test_the_replicas_store_listens_at_the_address_it_advertises(settings, expected):
    # the Lighthouse listens on loopback by default because whoever reaches it joins the run; the
    # replica's store (which the quorum's replicas rendezvous through) listened on every interface
    from lightning_commstrats.replicas import replica_store

    store, address = replica_store(FaultTolerance(**FT, **settings))
    port = store.port
    assert address == ("127.0.0.1", port)
    assert listening_addresses(port) == expected
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
    assert not listening_addresses(port)  # the store closes the socket it was handed


def test_a_store_bind_that_is_not_an_address_is_refused():
    with pytest.raises(ValueError, match=r"fault_tolerance\.store_bind='host:1': give the address without a port"):
        FaultTolerance(**FT, store_bind="host:1")


def test_a_replica_joining_an_ended_run_is_told_that_a_fresh_lighthouse_starts_another():
    # the run store lives as long as the Lighthouse: a run restarted (or extended past its end, from
    # its checkpoints) against the same Lighthouse is refused until a fresh one is started
    from lightning_commstrats.fault_tolerance import ReplicaSync, RunEnded

    class Ended:
        def ended(self) -> str:
            return "replica 'a' finished it at optimizer step 16"

    sync = ReplicaSync.__new__(ReplicaSync)
    sync.config, sync.run_store = FaultTolerance(**FT), Ended()
    with pytest.raises(RunEnded) as info:
        sync.check_ended()
    message = str(info.value)
    assert "the run has ended (replica 'a' finished it at optimizer step 16)" in message
    assert "start a fresh Lighthouse" in message and "from their checkpoints" in message, message


def test_a_rank_whose_process_holds_the_gil_for_seconds_does_not_take_its_replica_out(monkeypatch):
    # The replica's ranks beat a counter from a Python thread; a rank whose process holds the GIL
    # (a long call into an extension) beats nothing meanwhile. Its replica left the run after 4 s.
    from lightning_commstrats import replicas as rp
    from lightning_commstrats.comm.stats import CommStats

    class Beats:  # rank 1's counter stands still while `frozen`
        interval, rank, world_size, frozen, n = 0.05, 0, 2, False, 0

        def counts(self):
            self.n += 1
            return [self.n, 7 if self.frozen else self.n]

    class Comm:
        rank, world_size, heartbeat = 0, 2, Beats()

        def broadcast_object(self, obj, src):
            return obj

        def all_gather_object(self, obj):
            return [obj, None]

    class Sync:
        def shutdown(self):
            pass

    monkeypatch.setattr(rp, "replica_store", lambda config: (None, ("127.0.0.1", 1)))
    monkeypatch.setattr(rp, "ReplicaSync", lambda *args, **kwargs: Sync())
    comm = Comm()
    group = rp.ReplicaGroup(FaultTolerance(**FT))
    group.join(comm, comm, comm, torch.device("cpu"), CommStats(), host=True)
    try:
        comm.heartbeat.frozen = True
        time.sleep(5.0)
        comm.heartbeat.frozen = False
        group.check_alive()  # raised 'rank(s) [1] of the replica stopped' after 4 s
    finally:
        group.leave()
    # the setting says how long: a rank silent for longer is taken for stopped
    quick = rp.ReplicaGroup(FaultTolerance(**FT, peer_timeout=2.0))
    comm.heartbeat.frozen = True
    quick.join(comm, comm, comm, torch.device("cpu"), CommStats(), host=True)
    try:
        time.sleep(3.0)
        with pytest.raises(CollectiveError, match=r"rank\(s\) \[1\] of the replica stopped"):
            quick.check_alive()
    finally:
        quick.leave()


def test_a_peer_timeout_below_a_few_heartbeats_is_refused():
    with pytest.raises(ValueError, match=r"fault_tolerance\.peer_timeout must be >= 2\.0 s"):
        FaultTolerance(**FT, peer_timeout=0.5)


def test_the_replica_summary_counts_waits_heals_failures_and_the_replicas_seen_leaving_and_joining():
    from lightning_commstrats.fault_tolerance import ReplicaSummary

    s = ReplicaSummary()
    s.on_quorum(0.5, 3, None)
    s.on_commit(0.1, True)
    s.on_quorum(7.0, 2, None)  # one replica gone
    s.on_commit(0.2, False)
    healed = {"outer": {"weights": [torch.zeros(250_000)]}, "buffers": [torch.zeros(10, dtype=torch.float64)]}
    s.on_quorum(1.5, 3, healed)  # it came back; this replica healed (1,000,080 bytes)
    assert (s.quorums, s.heals, s.heal_bytes, s.syncs_failed) == (3, 1, 1_000_080, 1)
    assert (s.replicas_left, s.replicas_joined, s.smallest_quorum, s.largest_quorum) == (1, 1, 2, 3)
    assert s.line("b") == (
        "[ft] replica 'b': 3 quorums (waited 9.0 s, longest 7.0 s; commits 0.3 s); healed 1 time (1.0 MB in"
        " 1.5 s); 1 sync failed; replicas seen leaving 1, joining 1 (quorums of 2-3)"
    )
    assert s.as_dict()["quorum_seconds"] == 9.0 and "_last_size" not in s.as_dict()
