"""`bmuf`, `model_averaging`, `local_sgd` in one process: construction errors and defaults."""

import re

import pytest

import lightning_commstrats.strategies.local_sgd as local_sgd_module
from lightning_commstrats import BMUFStrategy, LocalSGDStrategy, ModelAveragingStrategy


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (BMUFStrategy, {"sync_period": 0}, "sync_period must be a positive int, got 0"),
        (ModelAveragingStrategy, {"sync_period": -3}, "sync_period must be a positive int, got -3"),
        (LocalSGDStrategy, {"sync_period": 0}, "sync_period must be a positive int, got 0"),
        (BMUFStrategy, {"block_momentum": 1.0}, r"block_momentum must be in \[0, 1\), got 1.0"),
        (BMUFStrategy, {"block_momentum": -0.1}, r"block_momentum must be in \[0, 1\), got -0.1"),
        (
            BMUFStrategy,
            {"block_momentum": 0.5, "block_momentum_as_time_constant": 100.0},
            "give block_momentum or block_momentum_as_time_constant, not both",
        ),
        (BMUFStrategy, {"block_momentum_as_time_constant": 0.0}, "block_momentum_as_time_constant must be > 0"),
        (BMUFStrategy, {"block_learning_rate": 0.0}, "block_learning_rate must be > 0, got 0.0"),
        (BMUFStrategy, {"sync_period_unit": "epochs"}, "sync_period_unit='epochs' is not supported"),
        (ModelAveragingStrategy, {"parallelization_start": -1}, "parallelization_start must be an int >= 0"),
        (LocalSGDStrategy, {"backend": "gloo"}, "local_sgd talks MPI only; backend='gloo'"),
    ],
)
def test_bad_arguments_fail_at_construction(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_block_momentum_defaults_and_time_constant():
    s = BMUFStrategy(sync_period=100)
    assert s.block_momentum == 0.0  # 1 - 1/N with N = 1 before any launch
    s = BMUFStrategy(sync_period=100, block_momentum_as_time_constant=1000.0)
    assert s.block_momentum == pytest.approx(0.904837418)
    assert s.time_constant == pytest.approx(1000.0)
    assert BMUFStrategy().sync_period == 120_000 and ModelAveragingStrategy().sync_period == 40_000


def test_local_sgd_without_mpi4py_says_how_to_install(monkeypatch):
    monkeypatch.setattr(local_sgd_module, "MPI4PY_AVAILABLE", False)
    with pytest.raises(ModuleNotFoundError, match=re.escape('pip install "lightning-commstrats[mpi]"')):
        LocalSGDStrategy()


@pytest.mark.mpi4py
def test_local_sgd_with_two_devices_without_mpiexec_is_refused():
    import lightning as L

    with pytest.raises(RuntimeError, match="run `mpiexec -n 2 python <script>`"):
        L.Trainer(accelerator="cpu", devices=2, strategy="local_sgd", logger=False)
