"""Warnings every rank would print alike come from rank 0 alone; a rank's own stay on that rank."""

import logging

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_commstrats import BMUFStrategy
from lightning_commstrats._logging import log_rank_zero


class _Trainer:
    """What BMUF's check reads of a Trainer: the training set behind the loader."""

    def __init__(self, samples: int) -> None:
        self.train_dataloader = type("Loader", (), {"dataset": range(samples)})()


@pytest.mark.parametrize("rank", [0, 1])
def test_log_rank_zero_logs_on_rank_zero_only(rank, caplog, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    with caplog.at_level(logging.INFO):
        log_rank_zero(logging.getLogger("lightning_commstrats.test"), logging.WARNING, "every rank: %d", 7)
    assert [r.getMessage() for r in caplog.records] == (["every rank: 7"] if rank == 0 else [])
    if rank == 0:
        assert caplog.records[0].levelno == logging.WARNING and caplog.records[0].filename == "test_logging.py"


@pytest.mark.parametrize("rank", [0, 1])
def test_bmuf_s_short_training_set_warning_comes_from_rank_zero(rank, caplog, monkeypatch):
    strategy = BMUFStrategy(sync_period=64, block_momentum=0.9)  # time constant about 607 samples
    monkeypatch.setattr(BMUFStrategy, "trainer", property(lambda self: _Trainer(samples=100)))
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    with caplog.at_level(logging.WARNING, logger="lightning_commstrats"):
        strategy._warn_short_training_set()
    warned = [r.getMessage() for r in caplog.records if "rule of thumb" in r.getMessage()]
    assert len(warned) == (1 if rank == 0 else 0)
