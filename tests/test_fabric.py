"""The Fabric front end in one process: names, instances, bad input, a run and a checkpoint."""

import re

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import MixedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

import lightning_commstrats
from lightning_commstrats import BMUFStrategy, FabricStrategy, LocalSGDStrategy, OneBitSGDStrategy
from lightning_commstrats.comm import MPI4PY_AVAILABLE
from lightning_commstrats.strategies import STRATEGIES


def test_every_scheme_is_a_fabric_strategy_name():
    for cls in STRATEGIES:
        if cls is LocalSGDStrategy and not MPI4PY_AVAILABLE:
            with pytest.raises(ModuleNotFoundError, match=re.escape('pip install "lightning-commstrats[mpi]"')):
                L.Fabric(accelerator="cpu", devices=1, strategy=cls.strategy_name)
            continue
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=cls.strategy_name)
        assert isinstance(fabric.strategy, FabricStrategy)
        assert type(fabric.strategy.scheme) is cls
    assert lightning_commstrats.register_fabric_strategies() == []  # a second registration adds nothing


def test_instances_and_settings():
    scheme = BMUFStrategy(sync_period=3, sync_period_unit="steps")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FabricStrategy(scheme))
    assert fabric.strategy.scheme is scheme
    strategy = FabricStrategy("bmuf", sync_period=5, sync_period_unit="steps")
    assert strategy.scheme.sync_period == 5


def test_bad_input_is_named_at_construction():
    with pytest.raises(
        ValueError,
        match=r"scheme='bmfu' is not a lightning_commstrats strategy; did you mean 'bmuf'\? choose one of allreduce, ",
    ):
        FabricStrategy("bmfu")
    with pytest.raises(ValueError, match=r"scheme='ddp' is not a lightning_commstrats strategy; choose one of"):
        FabricStrategy("ddp")  # Lightning's name: not a scheme, so not suggested either
    with pytest.raises(TypeError, match=r"settings \['sync_period'\] go to the scheme's constructor"):
        FabricStrategy(BMUFStrategy(sync_period=3), sync_period=4)
    with pytest.raises(TypeError, match="scheme must be a strategy name or an instance"):
        FabricStrategy(object())
    with pytest.raises(ValueError, match="sync_period must be a positive int"):
        FabricStrategy("bmuf", sync_period=0)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        FabricStrategy("allreduce", sync_period=4)
    taken = type(STRATEGY_REGISTRY)()
    taken.register("bmuf", object, description="another package's")
    with pytest.raises(RuntimeError, match="already registered"):
        lightning_commstrats.register_fabric_strategies(taken)


def test_a_gradscaler_precision_is_refused_with_a_pointer():
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))  # what "16-mixed" is on a GPU
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="allreduce", plugins=[fp16])
    fabric.launch()
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="GradScaler without rank agreement"):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_an_optimizer_over_other_tensors_is_refused():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="allreduce")
    fabric.launch()
    model = fabric.setup_module(nn.Linear(4, 2))
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="hold tensors that are not the model's parameters"):
        fabric.setup_optimizers(torch.optim.SGD([stray], lr=0.1))
    assert model is not None


def test_one_process_trains_counts_steps_and_round_trips_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FabricStrategy(OneBitSGDStrategy()))
    fabric.launch()
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    for _ in range(5):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    scheme = fabric.strategy.scheme
    assert scheme.optimizer_steps == 5 and scheme.samples_per_worker == 5 * 64
    fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": optimizer, "epoch": 3})
    saved = torch.load(tmp_path / "a.ckpt", weights_only=False)
    assert saved["lightning_commstrats"]["state"]["optimizer_steps"] == 5
    fabric.save(tmp_path / "w.ckpt", {"model": model}, filter={"model": lambda k, v: k.endswith("weight")})
    assert sorted(torch.load(tmp_path / "w.ckpt", weights_only=False)["model"]) == ["0.weight", "2.weight"]
    weights = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    fabric.load(tmp_path / "a.ckpt", state)
    assert state["epoch"] == 3
    for p, w in zip(model.parameters(), weights, strict=True):
        torch.testing.assert_close(p, w, atol=0, rtol=0)
    assert scheme.optimizer_steps == 5
