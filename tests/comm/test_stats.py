import time

import pytest

from lightning_commstrats.comm import CommStats, LocalCommunicator, delta
from lightning_commstrats.comm.base import FlagChannel


def test_record_accumulates_totals_and_tags():
    s = CommStats()
    s.record("grad", 100, 0.5)
    s.record("grad", 50, 0.25)
    s.record("control", 0, 0.1)
    assert (s.bytes_sent, s.calls) == (150, 3)
    assert s.comm_seconds == pytest.approx(0.85)
    assert s.by_tag["grad"].bytes_sent == 150 and s.by_tag["grad"].calls == 2
    assert s.by_tag["control"].calls == 1


def test_mark_step_closes_a_delta():
    s = CommStats()
    s.record("grad", 100, 0.0)
    first = s.mark_step()
    s.record("grad", 30, 0.0)
    s.record("weights", 7, 0.0)
    second = s.mark_step()
    assert (first.bytes_sent, first.steps) == (100, 1)
    assert (second.bytes_sent, second.calls, second.steps) == (37, 2, 1)
    assert second.by_tag["grad"].bytes_sent == 30 and second.by_tag["weights"].bytes_sent == 7
    assert s.last_step is second and s.steps == 2


def test_snapshot_delta_and_flat_dict():
    s = CommStats()
    a = s.snapshot()
    time.sleep(0.01)
    s.record("grad", 8, 0.001)
    d = delta(s.snapshot(), a)
    assert d.bytes_sent == 8 and d.wall_seconds >= 0.01
    assert d.compute_seconds == pytest.approx(d.wall_seconds - d.comm_seconds)
    flat = d.as_dict()
    assert flat["grad/bytes_sent"] == 8 and flat["bytes_sent"] == 8 and "compute_seconds" in flat


def test_local_communicator_is_a_free_no_op():
    import torch

    comm = LocalCommunicator()
    t = torch.arange(6.0)
    assert comm.all_reduce(t, "avg") is t
    assert torch.equal(comm.all_gather(t), t.unsqueeze(0))
    assert torch.equal(comm.all_to_all(t, [6]), t)
    assert torch.equal(comm.reduce_scatter(t), t)
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    assert comm.all_gather_object(3) == [3]
    comm.barrier()
    assert comm.stats.calls == 0 and comm.stats.bytes_sent == 0


def test_bad_collective_arguments_fail_before_sending():
    import torch

    comm = LocalCommunicator()
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="op must be one of"):
        comm.all_reduce(t, "prod")
    with pytest.raises(ValueError, match="send_splits sum to 3"):
        comm.all_to_all(t, [3])
    with pytest.raises(ValueError, match="send_splits must be 1"):
        comm.all_to_all(t, [2, 2])
    with pytest.raises(ValueError, match="src must be"):
        comm.broadcast(t, src=1)
    with pytest.raises(ValueError, match="1-D"):
        comm.reduce_scatter(torch.zeros(2, 2))


class Pending:
    """Stands in for a collective still running on a device (what a CudaInterval is)."""

    def __init__(self, seconds: float) -> None:
        self.finished = False
        self.reads = 0
        self._seconds = seconds

    def done(self) -> bool:
        return self.finished

    def seconds(self) -> float:
        self.reads += 1
        self.finished = True  # reading waits for the device
        return self._seconds


def test_device_seconds_are_booked_late_bytes_at_once():
    s = CommStats()
    p = Pending(0.25)
    s.record("grad", 100, p)
    step = s.mark_step()  # the strategies' per-step mark never waits for the device
    assert (step.bytes_sent, step.calls, step.comm_seconds) == (100, 1, 0.0)
    assert s.snapshot(wait=False).comm_seconds == 0.0 and p.reads == 0
    p.finished = True  # completed on the device: the next mark books it without waiting
    later = s.mark_step()
    assert (later.bytes_sent, later.calls, later.comm_seconds) == (0, 0, 0.25)
    assert later.by_tag["grad"].comm_seconds == 0.25 and p.reads == 1


def test_reading_the_totals_waits_for_pending_seconds():
    s = CommStats()
    first, second = Pending(0.5), Pending(0.125)
    s.record("grad", 8, first)
    s.record("weights", 4, 1.0)  # a CPU collective: wall seconds at once
    s.record("weights", 4, second)
    assert s.comm_seconds == 1.625 and first.reads == second.reads == 1
    assert s.by_tag["weights"].comm_seconds == 1.125 and s.by_tag["weights"].calls == 2
    assert s.comm_seconds == 1.625 and first.reads == 1  # booked once


def test_many_unread_timings_are_settled_as_they_complete():
    s = CommStats()
    done = []
    for _ in range(300):
        p = Pending(0.001)
        p.finished = True
        done.append(p)
        s.record("grad", 1, p)
    assert len(s._pending) < 256 and s.calls == 300  # record() booked the completed ones itself
    assert s.comm_seconds == pytest.approx(0.3)


def test_background_thread_bookings_reach_the_shared_totals():
    import threading

    s = CommStats()
    pending = [Pending(0.01) for _ in range(50)]

    def background() -> None:
        for p in pending:
            s.record("weights", 2, p)

    thread = threading.Thread(target=background)
    thread.start()
    for _ in range(50):
        s.record("grad", 1, 0.001)
        s.mark_step()
    thread.join()
    # the other thread's collectives ran beside the loop: background seconds, not the loop's waiting
    weights = s.by_tag["weights"]
    assert weights.calls == 50 and weights.background_seconds == pytest.approx(0.5) and weights.comm_seconds == 0
    assert s.comm_seconds == pytest.approx(0.05) and s.background_seconds == pytest.approx(0.5)
    assert s.bytes_sent == 150


def test_the_loop_thread_follows_start_clock_and_waits_for_the_background_are_its_own():
    import threading

    s = CommStats()
    done = threading.Event()

    def loop() -> None:  # a training loop on another thread than the one that made the stats
        s.start_clock()
        s.record("grad", 4, 0.25)
        s.record_wait("weights", 0.5)  # joined a background exchange: waiting, no call, no bytes
        done.set()

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    assert done.is_set()
    s.record("weights", 8, 2.0)  # this thread is not the loop's any more
    s.record("control", 0, 0.125, background=False)  # said explicitly
    snap = s.snapshot()
    assert (snap.comm_seconds, snap.background_seconds, snap.calls, snap.bytes_sent) == (0.875, 2.0, 3, 12)
    w = snap.by_tag["weights"]
    assert (w.comm_seconds, w.background_seconds, w.calls) == (0.5, 2.0, 1)
    assert snap.compute_seconds == pytest.approx(max(snap.wall_seconds - 0.875, 0.0))


def test_setup_traffic_is_apart_from_the_bytes_per_step():
    s = CommStats()
    s.record("setup", 1000, 0.0)
    s.record("bandwidth_probe", 500, 0.0)
    for _ in range(4):
        s.record("grad", 25, 0.0)
        s.mark_step()
    snap = s.snapshot()
    assert (snap.setup_bytes, snap.steady_bytes_per_step, snap.bytes_per_step) == (1500, 25.0, 400.0)
    flat = snap.as_dict()
    assert (flat["setup_bytes"], flat["steady_bytes_per_step"]) == (1500, 25.0)


class SlowFlags(FlagChannel):
    """A flag channel whose round is in flight ``wire`` seconds after it starts."""

    def __init__(self, stats: CommStats, wire: float) -> None:
        super().__init__(stats)
        self.wire = wire
        self.flag = 0
        self.started = 0.0

    def _start(self, flag: int) -> None:
        self.flag, self.started = flag, time.perf_counter()

    def _wait(self) -> int:
        time.sleep(max(self.started + self.wire - time.perf_counter(), 0.0))
        return self.flag

    def _close(self) -> None:
        pass


def test_a_flag_round_charges_only_the_wait_in_result_not_the_work_it_overlapped():
    s = CommStats()
    flags = SlowFlags(s, wire=0.2)
    flags.start(True)
    time.sleep(0.3)  # a batch's compute while the round travels: done before the result is read
    assert flags.result() is True
    assert s.by_tag["control"].calls == 1 and s.comm_seconds < 0.05
    flags.start(False)
    assert flags.result() is False  # read at once: the loop waits for the round
    assert 0.15 < s.comm_seconds < 0.3 and s.by_tag["control"].bytes_sent == 8
