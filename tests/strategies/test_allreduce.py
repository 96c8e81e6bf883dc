"""`allreduce` in one process: devices=1 and the construction-time errors."""

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

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


class FixedDataModel(BoringModel):
    """BoringModel whose data exists before fit, so reseeding at set-up cannot change it."""

    def __init__(self):
        super().__init__()
        self.data = RandomDataset(32, 64)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=2)


def test_one_device_trains_like_no_strategy_and_sends_nothing():
    L.seed_everything(1)
    ref = FixedDataModel()
    # Lightning shuffles training data whenever it adds a distributed sampler: keep the order fixed.
    _trainer(strategy="auto", use_distributed_sampler=False).fit(ref)
    L.seed_everything(1)
    model = FixedDataModel()
    trainer = _trainer(strategy="allreduce", use_distributed_sampler=False)
    trainer.fit(model)
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    stats = trainer.strategy.comm_stats
    assert (stats.bytes_sent, stats.calls, stats.steps) == (0, 0, 3)
    assert repr(trainer.strategy.comm).startswith("LocalCommunicator")


def test_monitor_logs_to_logger_and_prints_summary(tmp_path, caplog):
    trainer = _trainer(
        strategy="allreduce",
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        callbacks=[CommStatsMonitor(summary_every_n_steps=2)],
    )
    with caplog.at_level("INFO"):
        trainer.fit(BoringModel())
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    for key in ("comm/bytes", "comm/MB", "comm/seconds", "comm/compute_seconds", "comm/calls"):
        assert key in header
    assert "[comm] steps 2: sent 0.000 MB" in caplog.text
    assert "[comm] steps 3" in caplog.text


def test_monitor_refuses_a_bad_summary_period():
    with pytest.raises(ValueError, match="summary_every_n_steps"):
        CommStatsMonitor(summary_every_n_steps=0)


def test_unknown_backend_is_named():
    with pytest.raises(
        ValueError, match=r"backend='tcp' is not supported; choose one of \('auto', 'gloo', 'nccl', 'mpi'\)"
    ):
        AllReduceStrategy(backend="tcp")


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        AllReduceStrategy(bucket_cap_mb=0)
    with pytest.raises(ValueError, match="start_method='thread'"):
        AllReduceStrategy(start_method="thread")


def test_nccl_on_cpu_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA devices"):
        _trainer(strategy=AllReduceStrategy(backend="nccl"))


def test_incompatible_accelerator_is_named():
    class Abacus(Accelerator):
        @staticmethod
        def name():
            return "abacus"

        def setup_device(self, device): ...
        def teardown(self): ...
        @staticmethod
        def parse_devices(devices):
            return devices

        @staticmethod
        def get_parallel_devices(devices):
            return [torch.device("cpu")] * devices

        @staticmethod
        def auto_device_count():
            return 1

        @staticmethod
        def is_available():
            return True

        def get_device_stats(self, device):
            return {}

    with pytest.raises(ValueError, match="runs on accelerator='cpu' or 'cuda', got accelerator=Abacus"):
        _trainer(accelerator=Abacus(), strategy="allreduce")


def test_devices_must_match_the_launched_ranks(monkeypatch):
    # what torchrun (or this project's test harness) exports for rank 0 of 2
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    with pytest.raises(ValueError, match=r"started 2 processes but the Trainer asks for devices=4 x num_nodes=1 = 4"):
        _trainer(strategy="allreduce", devices=4)


@pytest.mark.mpi4py
def test_mpi_backend_without_mpiexec_is_refused():
    with pytest.raises(RuntimeError, match="backend='mpi' with devices=2 needs its ranks started by MPI"):
        _trainer(strategy=AllReduceStrategy(backend="mpi"), devices=2)
