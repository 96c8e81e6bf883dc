import importlib
import subprocess
import sys

import pytest
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry

import lightning_commstrats
from lightning_commstrats import AllReduceStrategy, register_strategies


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
