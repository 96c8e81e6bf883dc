"""The race's clock and stop decision in ``benchmarks/probe.py``, on a fake trainer and a fake clock."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Broadcast:
    """A strategy whose broadcast returns what rank 0 sent (``from_rank0``), whatever this rank passes."""

    def __init__(self, from_rank0=None) -> None:
        self.from_rank0 = from_rank0
        self.calls = []

    def broadcast(self, obj, src=0):
        self.calls.append((obj, src))
        return obj if self.from_rank0 is None else self.from_rank0


def _trainer(rank=0, strategy=None):
    return SimpleNamespace(
        global_rank=rank,
        world_size=2,
        global_step=0,
        max_steps=100_000,
        sanity_checking=False,
        should_stop=False,
        callback_metrics={},
        strategy=strategy or Broadcast(),
    )


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(probe.time, "perf_counter", c)
    return c


def _batch(cb, trainer, clock, start, end):
    clock.now = start
    cb.on_train_batch_start(trainer)
    clock.now = end
    trainer.global_step += 1
    cb.on_train_batch_end(trainer)


def _validate(cb, trainer, clock, start, end, ppl):
    clock.now = start
    cb.on_validation_start(trainer, None)
    trainer.callback_metrics = {"val/ppl": torch.tensor(ppl)}
    clock.now = end
    cb.on_validation_end(trainer, None)


def test_validation_time_is_not_training_time_and_the_target_stops_the_run(clock, tmp_path):
    cb = probe.BenchProbe(str(tmp_path), samples_per_step=16, target_ppl=250, budget_seconds=10)
    trainer = _trainer()
    cb.on_train_start(trainer, None)
    _batch(cb, trainer, clock, 0.0, 1.0)
    _batch(cb, trainer, clock, 1.2, 2.0)  # the 0.2 s between batches (data loading) is training
    _validate(cb, trainer, clock, 2.1, 5.0, 300.0)  # from the last batch's end to here: validation
    assert not trainer.should_stop and cb.train_seconds == 2.0 and cb.val_seconds == 3.0
    _batch(cb, trainer, clock, 5.0, 6.0)
    _validate(cb, trainer, clock, 6.0, 7.0, 240.0)
    assert trainer.should_stop and cb.stop_reason == "target"
    assert cb.curve[-1] == {"step": 3, "samples": 48, "train_seconds": 3.0, "wall_seconds": 7.0, "val_ppl": 240.0}
    assert cb.train_seconds == 3.0 and cb.val_seconds == 4.0
    assert trainer.strategy.calls == [(None, 0), ("target", 0)]  # every validation, decided on rank 0

    cb.on_train_end(trainer, torch.nn.Linear(2, 3))
    record = json.loads((tmp_path / "probe.rank0.json").read_text())
    assert record["stop_reason"] == "target" and record["train_seconds"] == 3.0 and record["val_seconds"] == 4.0
    assert record["param_shapes"] == [[3, 2], [3]]


def test_the_budget_stops_the_run_at_the_first_validation_past_it(clock, tmp_path):
    cb = probe.BenchProbe(str(tmp_path), target_ppl=1.0, budget_seconds=2.5)
    trainer = _trainer()
    cb.on_train_start(trainer, None)
    _batch(cb, trainer, clock, 0.0, 2.0)
    _validate(cb, trainer, clock, 2.0, 3.0, 300.0)  # 3 s of wall time but 2 s of training: on
    assert not trainer.should_stop
    _batch(cb, trainer, clock, 3.0, 4.0)
    _validate(cb, trainer, clock, 4.0, 5.0, 200.0)
    assert trainer.should_stop and cb.stop_reason == "budget" and cb.train_seconds == 3.0


def test_every_rank_follows_rank_0s_decision(clock, tmp_path):
    # rank 1 would not stop on its own (its clock is under the budget): rank 0's broadcast decides
    cb = probe.BenchProbe(str(tmp_path), target_ppl=1.0, budget_seconds=100)
    trainer = _trainer(rank=1, strategy=Broadcast(from_rank0="budget"))
    cb.on_train_start(trainer, None)
    _batch(cb, trainer, clock, 0.0, 1.0)
    _validate(cb, trainer, clock, 1.0, 2.0, 300.0)
    assert trainer.strategy.calls == [(None, 0)]  # rank 1 sends nothing of its own
    assert trainer.should_stop and cb.stop_reason == "budget"


def test_without_target_or_budget_nothing_is_broadcast(clock, tmp_path):
    cb = probe.BenchProbe(str(tmp_path))
    trainer = _trainer()
    cb.on_train_start(trainer, None)
    _batch(cb, trainer, clock, 0.0, 1.0)
    _validate(cb, trainer, clock, 1.0, 2.0, 1.0)
    assert trainer.strategy.calls == [] and not trainer.should_stop


def test_bad_target_or_budget_fails_at_construction():
    with pytest.raises(ValueError, match="target_ppl must be > 0"):
        probe.BenchProbe("x", target_ppl=0)
    with pytest.raises(ValueError, match="budget_seconds must be > 0"):
        probe.BenchProbe("x", budget_seconds=-1)


class Exchange(Broadcast):
    """A strategy with a background exchange in flight whose end the clock sees:
    ``wait_for_exchange()`` advances it."""

    def __init__(self, clock, lands_at) -> None:
        super().__init__()
        self.clock, self.lands_at, self.waited = clock, lands_at, False

    def wait_for_exchange(self):
        self.waited = True
        self.clock.now = max(self.clock.now, self.lands_at)


def test_an_exchange_in_flight_is_waited_for_before_a_validation_and_counts_as_training(clock, tmp_path):
    cb = probe.BenchProbe(str(tmp_path))
    strategy = Exchange(clock, lands_at=1.5)
    trainer = _trainer(strategy=strategy)
    trainer.val_check_batch = 2
    cb.on_train_start(trainer, None)
    _batch(cb, trainer, clock, 0.0, 1.0)  # step 1: no validation follows, the exchange keeps running
    assert not strategy.waited and cb.train_seconds == pytest.approx(1.0)
    _batch(cb, trainer, clock, 1.0, 1.2)  # step 2: validation follows, so the batch ends when it lands
    assert strategy.waited
    assert cb.train_seconds == pytest.approx(1.5) and cb.step_seconds[-1] == pytest.approx(0.5)
