import importlib
import subprocess
import sys

import pytest
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry

import lightning_commstrats
from lightning_commstrats import STRATEGIES, AllReduceStrategy, register_strategies
from lightning_commstrats._registry import (
    is_registered_strategy,
    nearest_strategy_names,
    package_strategy_names,
    strategy_class_path,
    unknown_strategy_message,
)


def test_import_registers_names_once():
    assert StrategyRegistry["allreduce"]["strategy"] is AllReduceStrategy
    assert register_strategies() == []  # already there: nothing added, nothing raised
    importlib.reload(lightning_commstrats)  # a reload makes new class objects with the same names
    assert "allreduce" in StrategyRegistry


def test_import_in_a_fresh_interpreter():
    code = (
        "import lightning_commstrats, lightning_commstrats\n"
        "from lightning.pytorch.strategies import StrategyRegistry as R\n"
        "print(R['allreduce']['strategy'].__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "AllReduceStrategy"


def test_name_clash_with_another_package_is_an_error():
    registry = _StrategyRegistry()

    class SomeoneElses:
        pass

    registry.register("allreduce", SomeoneElses)
    with pytest.raises(RuntimeError, match=r"'allreduce' is already registered to .*SomeoneElses"):
        register_strategies(registry)


def test_fresh_registry_gets_every_name():
    registry = _StrategyRegistry()
    names = register_strategies(registry)
    assert "allreduce" in names and set(names) == set(registry)


@pytest.mark.parametrize(
    ("value", "nearest"),
    [
        ("dilocco", ["diloco"]),
        ("streaming-diloco", ["streaming_diloco"]),
        ("onebit", ["onebit_sgd", "onebit_adam"]),
        ("dpp", ["ddp"]),  # Lightning's names count
        ("DiLoCoStrategy", ["diloco"]),  # a class name stands for its registered name
        ("lightning_commstrats.DiLoCoStrateg", ["diloco"]),
        ("xyzzy", []),
    ],
)
def test_the_nearest_registered_names(value, nearest):
    assert nearest_strategy_names(value) == nearest


def test_the_message_names_the_argument_the_nearest_and_the_package_names():
    message = unknown_strategy_message("--trainer.strategy", "dilocco")
    assert message.startswith("--trainer.strategy='dilocco' is not a registered strategy name; did you mean 'diloco'?")
    assert "lightning_commstrats registers " + ", ".join(cls.strategy_name for cls in STRATEGIES) in message
    assert "did you mean" not in unknown_strategy_message("--strategy", "xyzzy")
    # only among the names given: Lightning's ddp is no FabricStrategy scheme
    assert "did you mean" not in unknown_strategy_message("scheme", "dpp", package_strategy_names())


def test_registered_names_as_the_trainer_takes_them():
    assert all(is_registered_strategy(name) for name in ("auto", "ddp", "diloco", "DiLoCo"))  # the Trainer lowercases
    assert not is_registered_strategy("dilocco")
    assert strategy_class_path("diloco") == "lightning_commstrats.DiLoCoStrategy"
    assert strategy_class_path("ddp") is None


@pytest.mark.parametrize(("name", "nearest"), [("dilocoo", "'diloco'"), ("DiLoCoo", "'diloco'"), ("ddpp", "'ddp'")])
def test_the_trainer_names_the_nearest_registered_names(name, nearest):
    import lightning as L

    with pytest.raises(
        ValueError, match=f"^strategy='{name}' is not a registered strategy name; did you mean {nearest}"
    ):
        L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)


def test_the_trainer_takes_and_refuses_what_it_did_before():
    import lightning as L

    assert type(L.Trainer(strategy="DiLoCo", accelerator="cpu", devices=1, logger=False).strategy).__name__ == (
        "DiLoCoStrategy"
    )
    with pytest.raises(ValueError, match="You selected an invalid accelerator name"):  # Lightning's own, unchanged
        L.Trainer(strategy="diloco", accelerator="cpuu", logger=False)
    importlib.reload(lightning_commstrats)  # wrapped once, however often the package is imported
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    assert not getattr(_AcceleratorConnector.__init__.__wrapped__, "__commstrats_wrapped__", False)
