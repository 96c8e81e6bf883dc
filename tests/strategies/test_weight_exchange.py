"""`bmuf`, `model_averaging`, `local_sgd` in one process: construction errors, defaults and units."""

import math
import re

import pytest

import lightning_commstrats.strategies.local_sgd as local_sgd_module
from lightning_commstrats import BMUFStrategy, LocalSGDStrategy, ModelAveragingStrategy

FT = {"lighthouse": "http://localhost:1", "replica_id": "r0"}  # never contacted: construction only


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
        (BMUFStrategy, {"variant": "CNTK"}, r"variant='CNTK' is not supported; choose one of \('paper', 'cntk'\)"),
        (
            BMUFStrategy,
            {"variant": "cntk", "sync_period": 8, "sync_period_unit": "steps", "fault_tolerance": FT},
            "variant='cntk' cannot be honoured with fault_tolerance",
        ),
        (ModelAveragingStrategy, {"weighting": "mean"}, "weighting='mean' is not supported"),
        (
            ModelAveragingStrategy,
            {"weighting": "samples", "sync_period": 8, "sync_period_unit": "steps", "num_fragments": 2},
            "weighting='samples' needs a blocking exchange of the whole model",
        ),
        (
            ModelAveragingStrategy,
            {"weighting": "samples", "sync_period": 8, "sync_period_unit": "steps", "fault_tolerance": FT},
            "weighting='samples' needs a blocking exchange of the whole model",
        ),
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


def test_cntk_variant_counts_the_time_constant_over_all_workers(monkeypatch):
    paper = BMUFStrategy(sync_period=1000, block_momentum_as_time_constant=4000.0)
    cntk = BMUFStrategy(sync_period=1000, block_momentum_as_time_constant=4000.0, variant="cntk")
    for strategy in (paper, cntk):
        monkeypatch.setattr(type(strategy), "world_size", property(lambda self: 4))
    # the paper form's time constant is per worker; CNTK's blockMomentumAsTimeConstant counts the
    # samples of all workers, against CNTK's blockSize = 4 x 1000
    assert paper.block_momentum == pytest.approx(math.exp(-1000 / 4000))
    assert cntk.block_momentum == pytest.approx(math.exp(-4 * 1000 / 4000))
    assert cntk.time_constant == pytest.approx(4000.0) and paper.time_constant == pytest.approx(4000.0)
    # the same momentum in both units: CNTK's time constant is N times the per-worker one
    same = BMUFStrategy(sync_period=1000, block_momentum_as_time_constant=16000.0, variant="cntk")
    assert same.block_momentum == pytest.approx(paper.block_momentum)


def test_a_checkpoint_of_one_bmuf_form_is_refused_by_the_other():
    paper = BMUFStrategy(sync_period=8, sync_period_unit="steps")
    cntk = BMUFStrategy(sync_period=8, sync_period_unit="steps", variant="cntk")
    with pytest.raises(ValueError, match="it was saved with variant='paper' and this run has variant='cntk'"):
        cntk.load_state_dict({"variant": "paper"}, {})
    with pytest.raises(ValueError, match="it was saved with variant='cntk' and this run has variant='paper'"):
        paper.load_state_dict({"variant": "cntk"}, {})


def test_local_sgd_without_mpi4py_says_how_to_install(monkeypatch):
    monkeypatch.setattr(local_sgd_module, "MPI4PY_AVAILABLE", False)
    with pytest.raises(ModuleNotFoundError, match=re.escape('pip install "lightning-commstrats[mpi]"')):
        LocalSGDStrategy()


@pytest.mark.mpi4py
def test_local_sgd_with_two_devices_without_mpiexec_is_refused():
    import lightning as L

    with pytest.raises(RuntimeError, match="run `mpiexec -n 2 python <script>`"):
        L.Trainer(accelerator="cpu", devices=2, strategy="local_sgd", logger=False)
