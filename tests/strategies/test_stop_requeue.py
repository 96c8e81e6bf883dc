"""SLURM's requeue signal under :class:`~lightning_commstrats.strategies.stop.StopAgreement`.

Lightning's requeue handler saves an HPC checkpoint (collectives) from inside the signal handler;
the agreement replaces it with one that only notes the signal, and every rank runs Lightning's
handler at the same batch boundary, outside any handler. ``scontrol`` is never run: the unit tests
replace Lightning's ``call``, the two-rank test puts a fake ``scontrol`` first on ``PATH``.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from harness import run_ranks
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.trainer.connectors import signal_connector
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_commstrats.comm.base import FlagChannel
from lightning_commstrats.comm.stats import CommStats
from lightning_commstrats.strategies.stop import StopAgreement

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")

JOB_ID = "4242"
WORKER = Path(__file__).parents[1] / "multiprocess" / "requeue_worker.py"


class ScriptedChannel(FlagChannel):
    """One rank's flag channel; ``peers[i]`` is the flag the other ranks send in round ``i``."""

    def __init__(self, peers: list[int] | None = None) -> None:
        super().__init__(CommStats())
        self.peers = list(peers or [])
        self.sent: list[int] = []  # this rank's flag, round by round
        self.closed = False

    def _start(self, flag: int) -> None:
        self.sent.append(flag)

    def _wait(self) -> int:
        i = len(self.sent) - 1
        return max(self.sent[i], self.peers[i] if i < len(self.peers) else 0)

    def _close(self) -> None:
        self.closed = True


class TwoRanks:
    """What ``StopAgreement.attach`` uses of a communicator: a world of two and a flag channel."""

    world_size = 2

    def __init__(self, channel: ScriptedChannel) -> None:
        self.channel = channel

    def flag_channel(self) -> ScriptedChannel:
        return self.channel


class Recorder:
    """Stands in for the HPC save and for ``subprocess.call``: notes each call and the stack it ran on."""

    def __init__(self) -> None:
        self.saves: list[dict[str, Any]] = []
        self.commands: list[list[str]] = []

    def save_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> None:
        stack = traceback.extract_stack()
        in_handler = any(
            f.name == "notify_requeue" or (f.name == "__call__" and f.filename.endswith("signal_connector.py"))
            for f in stack
        )  # _HandlersCompose.__call__: a signal handler of Lightning's, or the agreement's own
        self.saves.append({"path": str(path), "frames": [f.name for f in stack], "in_handler": in_handler})

    def call(self, cmd: Any, *args: Any, **kwargs: Any) -> int:
        self.commands.append(list(cmd))
        return 0


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """One SLURM task of a job (the environment ``srun`` gives it)."""
    for key, value in {
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NAME": "requeue-test",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)


@pytest.fixture
def connectors() -> Any:
    """Tears down the signal connectors a test registered: the process's handlers come back."""
    registered: list[_SignalConnector] = []
    yield registered
    for connector in registered:
        connector.teardown()


def make_trainer(tmp_path: Path, environment: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[environment],
        default_root_dir=str(tmp_path),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def install(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    connectors: list,
    peers: list[int] | None = None,
    environment: Any = None,
    together: bool = True,
) -> tuple[StopAgreement, L.Trainer, ScriptedChannel, Recorder]:
    """A Trainer whose fit is about to start: the agreement attached (as the strategy's setup does),
    then Lightning's signal handlers registered (as the Trainer does next)."""
    trainer = make_trainer(tmp_path, SLURMEnvironment() if environment is None else environment)
    recorder = Recorder()
    monkeypatch.setattr(trainer, "save_checkpoint", recorder.save_checkpoint)
    monkeypatch.setattr(signal_connector, "call", recorder.call)
    channel = ScriptedChannel(peers)
    agreement = StopAgreement(together=together)
    agreement.attach(trainer, TwoRanks(channel))
    connectors.append(trainer._signal_connector)
    trainer._signal_connector.register_signal_handlers()
    return agreement, trainer, channel, recorder


def deliver(signum: int, agreement: StopAgreement) -> None:
    """Send ``signum`` to this process; return once its Python handler has run."""
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 5.0
    while not (agreement.requeue_requested or agreement.requested):
        assert time.monotonic() < deadline, "the handler never ran"
        time.sleep(0.001)


def poll_until_stop(agreement: StopAgreement, batches: int = 5) -> int:
    """Poll batch after batch, as the strategy does at each batch start; the batch it stopped at."""
    for batch in range(1, batches + 1):
        try:
            agreement.poll()
        except SIGTERMException:
            return batch
    raise AssertionError(f"no stop within {batches} batches")


def test_the_requeue_signal_handler_only_notes_the_signal(slurm, tmp_path, monkeypatch, connectors):
    agreement, _, _, recorder = install(tmp_path, monkeypatch, connectors)
    handler = signal.getsignal(signal.SIGUSR1)
    assert isinstance(handler, _HandlersCompose)
    assert handler.signal_handlers == [agreement.notify_requeue]  # Lightning's own is not among them
    assert "_slurm_sigusr_handler_fn" not in repr(handler.signal_handlers)
    deliver(signal.SIGUSR1, agreement)
    assert agreement.requeue_requested and not agreement.requested
    assert recorder.saves == [] and recorder.commands == []


def test_a_requeue_inside_a_collective_saves_at_the_next_round_outside_the_handler(
    slurm, tmp_path, monkeypatch, connectors
):
    agreement, trainer, channel, recorder = install(tmp_path, monkeypatch, connectors)
    seen_inside: list[tuple[bool, int]] = []

    def collective() -> None:  # a scheme's exchange: the signal comes while the rank is inside it
        deliver(signal.SIGUSR1, agreement)
        seen_inside.append((agreement.requeue_requested, len(recorder.saves)))

    agreement.poll()  # batch 1: starts round 1 with no flag
    collective()
    assert seen_inside == [(True, 0)]  # noted inside the collective, nothing saved there
    assert recorder.saves == []
    agreement.poll()  # batch 2: round 1 (before the signal) is clear; round 2 carries the flag
    assert recorder.saves == []
    with pytest.raises(SIGTERMException):
        agreement.poll()  # batch 3: round 2 says stop, the requeue round says requeue
    assert agreement.requeued_at_batch == agreement.stopped_at_batch == 3
    assert channel.sent == [0, 1, 1]  # the two stop rounds, then the requeue round, once
    assert len(recorder.saves) == 1
    save = recorder.saves[0]
    assert save["path"] == os.path.join(str(tmp_path), "hpc_ckpt_1.ckpt")
    assert "poll" in save["frames"]
    assert not save["in_handler"]
    assert recorder.commands == [["scontrol", "requeue", JOB_ID]]
    assert trainer.received_sigterm


def test_a_requeue_noted_on_a_peer_makes_this_rank_save_too(slurm, tmp_path, monkeypatch, connectors):
    # this rank never gets the signal; the other rank's flag is set from round 2 on
    agreement, _, channel, recorder = install(tmp_path, monkeypatch, connectors, peers=[0, 1, 1])
    assert poll_until_stop(agreement) == 3
    assert channel.sent == [0, 0, 0]
    assert len(recorder.saves) == 1 and recorder.commands == [["scontrol", "requeue", JOB_ID]]


def test_only_rank_zero_requeues_the_job(slurm, tmp_path, monkeypatch, connectors):
    monkeypatch.setattr(L.Trainer, "is_global_zero", property(lambda self: False))
    agreement, _, _, recorder = install(tmp_path, monkeypatch, connectors, peers=[0, 1, 1])
    assert poll_until_stop(agreement) == 3
    assert len(recorder.saves) == 1  # every rank saves (the save is collective)
    assert recorder.commands == []


def test_a_sigterm_alone_stops_without_saving_or_requeueing(slurm, tmp_path, monkeypatch, connectors):
    # a peer's SIGTERM: the stop round is set, the requeue round is not
    agreement, trainer, channel, recorder = install(tmp_path, monkeypatch, connectors, peers=[0, 1, 0])
    assert poll_until_stop(agreement) == 3
    assert channel.sent == [0, 0, 0]
    assert recorder.saves == [] and recorder.commands == []
    assert agreement.requeued_at_batch is None and trainer.received_sigterm


def test_without_slurm_requeue_the_sigterm_rounds_are_unchanged(tmp_path, monkeypatch, connectors):
    before = signal.getsignal(signal.SIGUSR1)
    agreement, _, channel, recorder = install(tmp_path, monkeypatch, connectors, environment=LightningEnvironment())
    assert signal.getsignal(signal.SIGUSR1) is before  # Lightning registered nothing, nor did the agreement
    agreement.poll()
    deliver(signal.SIGTERM, agreement)
    poll_until_stop(agreement)
    assert agreement.stopped_at_batch == 3  # the second round carries the flag
    assert channel.sent == [0, 1]  # no requeue round
    assert recorder.saves == []


def test_a_rank_that_stops_alone_saves_at_its_next_batch(slurm, tmp_path, monkeypatch, connectors):
    agreement, _, _, recorder = install(tmp_path, monkeypatch, connectors, together=False)
    agreement.poll()
    deliver(signal.SIGUSR1, agreement)
    assert recorder.saves == []
    poll_until_stop(agreement)
    assert agreement.stopped_at_batch == agreement.requeued_at_batch == 2
    assert len(recorder.saves) == 1 and not recorder.saves[0]["in_handler"]
    assert recorder.commands == [["scontrol", "requeue", JOB_ID]]


def test_detach_gives_lightning_its_requeue_handler_back(slurm, tmp_path, monkeypatch, connectors):
    agreement, trainer, channel, _ = install(tmp_path, monkeypatch, connectors)
    connector = trainer._signal_connector
    agreement.detach()
    assert "_slurm_sigusr_handler_fn" not in vars(connector)
    assert connector._slurm_sigusr_handler_fn.__func__ is _SignalConnector._slurm_sigusr_handler_fn
    assert channel.closed
    # a second fit takes Lightning's handler over again, not the stand-in of the first, even when
    # the first was never detached
    for _ in range(2):
        agreement.attach(trainer, TwoRanks(ScriptedChannel()))
        assert agreement._requeue is not None
        assert agreement._requeue.__func__ is _SignalConnector._slurm_sigusr_handler_fn
        assert connector._slurm_sigusr_handler_fn == agreement.notify_requeue
    agreement.detach()


@pytest.mark.multiprocess
def test_a_requeue_inside_a_collective_saves_on_every_rank_at_the_same_batch():
    """Two real ranks under a simulated SLURM job with auto-requeue: rank 0 sends the requeue signal
    to rank 1 while rank 1 is blocked in a gradient collective. Every rank runs the save at the same
    batch, outside the handler and outside any collective, rank 0 (which never got the signal) runs
    the fake ``scontrol requeue`` once, and every rank ends on ``SIGTERMException`` at that batch."""
    spec = {"strategy": "allreduce", "max_steps": 200, "signal": {"rank": 0, "target": 1, "nth": 4}}
    results = run_ranks(spec, 2, script=WORKER, timeout=60)
    assert all(r["exception"] == "SIGTERMException" for r in results), results
    assert results[1]["requeue_noted_in_collective"], results  # the signal did come inside the collective
    saves = [r["saves"] for r in results]
    assert all(len(s) == 1 for s in saves), saves
    assert len({s[0]["step"] for s in saves}) == 1, saves  # the same batch on every rank
    for s in saves:
        assert s[0]["collective_depth"] == 0 and not s[0]["in_handler"] and s[0]["in_poll"], s
    assert results[0]["scontrol"] == [["requeue", JOB_ID]] and results[1]["scontrol"] == [], results
    assert results[0]["hpc_step"] == saves[0][0]["step"] == results[0]["step"], results
    assert results[0]["step"] == results[1]["step"] < 200
