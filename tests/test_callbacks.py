"""CommStatsMonitor: its end-of-fit figures, and a strategy that does not count its communication."""

import csv
import json
import logging
import time
import warnings

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from lightning_commstrats import AllReduceStrategy, CommStatsMonitor


def _trainer(**kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


class SendsAtTheEnd(AllReduceStrategy):
    """One rank, so nothing really travels: its end of fit charges one collective of 1234 bytes, as a
    periodic scheme's final sync would, after the callbacks' ``on_train_end``."""

    def on_train_end(self) -> None:
        self.comm_stats.record("weights", 1234, 0.0)
        super().on_train_end()


def test_summary_and_saved_figures_hold_what_the_strategy_sends_when_fit_ends(tmp_path, caplog):
    monitor = CommStatsMonitor(save_dir=str(tmp_path))
    trainer = _trainer(strategy=SendsAtTheEnd(), callbacks=[monitor])
    with caplog.at_level(logging.INFO):
        trainer.fit(BoringModel())
    stats = trainer.strategy.comm_stats
    assert (stats.bytes_sent, stats.calls, stats.steps) == (1234, 1, 3)
    assert "[comm] steps 3: sent 0.001 MB (0.0004 MB/step) in 1 calls; waited 0.00s for communication" in caplog.text
    assert "by kind: weights 0.001 MB" in caplog.text
    saved = json.loads((tmp_path / "comm_stats.rank0.json").read_text())
    assert (saved["bytes_sent"], saved["calls"], saved["weights/bytes_sent"]) == (1234, 1, 1234)


def test_a_strategy_that_counts_nothing_gets_steps_and_wall_time_and_one_warning(tmp_path, caplog):
    monitor = CommStatsMonitor(summary_every_n_steps=2, save_dir=str(tmp_path / "stats"))
    trainer = _trainer(strategy="auto", logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[monitor])
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        start = time.perf_counter()
        trainer.fit(BoringModel())
        wall = time.perf_counter() - start
        saved = json.loads((tmp_path / "stats" / "comm_stats.rank0.json").read_text())
        trainer.validate(BoringModel(), verbose=False)
        _trainer(strategy="auto", callbacks=[monitor]).fit(BoringModel())  # the same monitor: it has said it
    messages = [str(w.message) for w in caught if "does not count its communication" in str(w.message)]
    assert messages == [
        "CommStatsMonitor: SingleDeviceStrategy does not count its communication, so bytes and seconds in"
        " collectives are not known; logging optimizer steps and wall time only. The strategies of"
        " lightning_commstrats count them ('allreduce' is the counterpart of 'ddp')."
    ]
    assert "[comm] steps 2: wall " in caplog.text

    # what it measured itself: the steps, the wall time of the fit and of each batch
    assert saved["strategy"] == "SingleDeviceStrategy" and saved["steps"] == 3 and "bytes_sent" not in saved
    assert 0 < saved["wall_seconds"] <= wall
    rows = list(csv.DictReader(open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")))
    per_batch = [float(r["comm/wall_seconds"]) for r in rows if r.get("comm/wall_seconds")]
    assert len(per_batch) == 3 and all(s > 0 for s in per_batch) and sum(per_batch) <= saved["wall_seconds"]
    summary = next(line for line in caplog.text.splitlines() if "[comm] steps 3: " in line)
    assert summary.endswith("; bytes not known (SingleDeviceStrategy does not count them)")
    seconds = float(summary.split(" wall ")[1].split("s ")[0])
    assert seconds == pytest.approx(saved["wall_seconds"], abs=0.01)


class PrintsBesideTheBar(L.pytorch.callbacks.TQDMProgressBar):
    """The tqdm bar, keeping what was printed through it (``tqdm.write`` clears and redraws the bar)."""

    def __init__(self) -> None:
        super().__init__()
        self.printed: list[str] = []

    def print(self, *args, **kwargs) -> None:
        self.printed.append(" ".join(map(str, args)))
        super().print(*args, **kwargs)


def test_the_summary_during_training_goes_through_a_drawing_progress_bar_not_into_its_line(caplog):
    bar = PrintsBesideTheBar()
    monitor = CommStatsMonitor(summary_every_n_steps=2, summary_at_end=False)
    trainer = _trainer(strategy=AllReduceStrategy(), callbacks=[monitor, bar], enable_progress_bar=True, max_steps=4)
    with caplog.at_level(logging.INFO):
        trainer.fit(BoringModel())
    assert [line.split(":")[0] for line in bar.printed] == ["[comm] steps 2", "[comm] steps 4"]
    assert "[comm] steps 2" not in caplog.text  # not also logged under the bar
    # without a bar that draws, the summary goes to the log
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _trainer(strategy=AllReduceStrategy(), callbacks=[CommStatsMonitor(summary_every_n_steps=2)]).fit(BoringModel())
    assert "[comm] steps 2" in caplog.text


def test_the_summary_says_how_much_of_the_traffic_fsdp2_sent_inside_the_groups():
    from lightning_commstrats.callbacks import format_summary
    from lightning_commstrats.comm import CommStats

    stats = CommStats()
    stats.record("fsdp_gather", 3_000_000, 0.0)
    stats.record("fsdp_reduce", 1_000_000, 0.0)
    stats.record("pseudo_grad", 500_000, 0.0)
    stats.mark_step()
    line = format_summary(stats.snapshot())
    assert "sent 4.500 MB (4.5000 MB/step, 4.000 MB of it FSDP2's inside the groups)" in line, line
    plain = CommStats()
    plain.record("grad", 500_000, 0.0)
    assert "inside the groups" not in format_summary(plain.snapshot())


def test_the_summary_leads_with_what_crossed_between_the_groups():
    from lightning_commstrats.callbacks import format_summary
    from lightning_commstrats.comm import CommStats

    stats = CommStats()
    stats.set_groups(2)  # sites of ranks 0-1 and 2-3
    assert stats.spans_groups((0, 2)) and stats.spans_groups((0, 1, 2, 3)) and not stats.spans_groups((2, 3))
    stats.record("setup", 1_000_000, 0.0, across=True)
    stats.record("fsdp_gather", 3_000_000, 0.0)
    stats.record("pseudo_grad", 500_000, 0.0, across=True)
    stats.mark_step()
    stats.record("pseudo_grad", 300_000, 0.0, across=True)
    stats.mark_step()
    line = format_summary(stats.snapshot())
    assert line.startswith(
        "[comm] steps 2: between groups 1.800 MB (0.4000 MB/step + 1.000 MB once at setup); in all sent 4.800 MB"
    ), line
    assert stats.snapshot().as_dict()["across/pseudo_grad/bytes_sent"] == 800_000
    alone = CommStats()  # no groups: no such figure
    alone.record("grad", 500_000, 0.0)
    assert "between groups" not in format_summary(alone.snapshot())
