"""Registration of the package's strategy names with Lightning's ``StrategyRegistry``."""

from __future__ import annotations

from typing import Any


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def register_strategies(registry: Any = None) -> list[str]:
    """Register every strategy of the package; returns the names added by this call.

    A name that is already registered to the same class (a second import, or a reload) is skipped.
    A name registered to another class by another package is an error, never a silent override.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_commstrats.strategies import STRATEGIES

    registry = StrategyRegistry if registry is None else registry
    added = []
    for cls in STRATEGIES:
        name = cls.strategy_name
        if name in registry:
            existing = registry[name]["strategy"]
            if _qualname(existing) == _qualname(cls):
                continue
            raise RuntimeError(
                f"Strategy name {name!r} is already registered to {_qualname(existing)}; lightning_commstrats"
                f" cannot register {_qualname(cls)} under the same name. Pass an instance instead:"
                f" Trainer(strategy={cls.__name__}(...))"
            )
        cls.register_strategies(registry)
        added.append(name)
    return added
