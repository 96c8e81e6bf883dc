"""Registration of the package's strategy names with Lightning's ``StrategyRegistry``, and the
error for a name that nothing registered (with the nearest names, where the package sees the value:
the recipes, :class:`~lightning_commstrats.FabricStrategy`, the CLI, the Trainer)."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
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


def package_strategy_names() -> list[str]:
    """The registry names of the package's strategies, in the order of ``STRATEGIES``."""
    from lightning_commstrats.strategies import STRATEGIES

    return [cls.strategy_name for cls in STRATEGIES]


def strategy_class_path(name: str) -> str | None:
    """``"lightning_commstrats.DiLoCoStrategy"`` for the package's name ``"diloco"``; None for any other."""
    from lightning_commstrats.strategies import STRATEGIES

    return next((f"lightning_commstrats.{cls.__name__}" for cls in STRATEGIES if cls.strategy_name == name), None)


def _trainer_names() -> list[str]:
    from lightning.pytorch.strategies import StrategyRegistry

    return ["auto", *StrategyRegistry]


def is_registered_strategy(value: str, names: Iterable[str] | None = None) -> bool:
    """Whether ``value`` is a strategy name the Trainer takes (``"auto"`` or a registered name; the
    Trainer lowercases the value), or one of ``names``."""
    return value.lower() in {name.lower() for name in (_trainer_names() if names is None else names)}


def nearest_strategy_names(value: str, names: Iterable[str] | None = None, n: int = 3) -> list[str]:
    """Up to ``n`` of ``names`` (default: every name the Trainer takes) closest to ``value``, the
    closest first: those within 0.1 of the best :class:`difflib.SequenceMatcher` ratio, and at least
    0.6. The package's class names and paths stand for their names, so that ``DiLoCoStrategy`` or a
    misspelled ``lightning_commstrats.DiLoCoStrategy`` finds ``diloco``."""
    from lightning_commstrats.strategies import STRATEGIES

    names = list(_trainer_names() if names is None else names)
    candidates = {name.lower(): name for name in names}
    for cls in STRATEGIES:
        if cls.strategy_name in names:
            candidates.setdefault(cls.__name__.lower(), cls.strategy_name)
            candidates.setdefault(f"lightning_commstrats.{cls.__name__}".lower(), cls.strategy_name)
            candidates.setdefault(f"{cls.__module__}.{cls.__name__}".lower(), cls.strategy_name)
    score: dict[str, float] = {}
    for key, shown in candidates.items():
        ratio = difflib.SequenceMatcher(None, value.lower(), key).ratio()
        score[shown] = max(score.get(shown, 0.0), ratio)
    best = max(score.values(), default=0.0)
    close = [name for name in score if score[name] >= max(0.6, best - 0.1)]
    return sorted(close, key=lambda name: -score[name])[:n]


def suggest_names_in_trainer() -> bool:
    """Make ``Trainer(strategy="dilocoo")`` name the nearest registered names, as the CLI and
    :class:`~lightning_commstrats.FabricStrategy` do, instead of Lightning's fixed examples (``auto,
    ddp, ddp_spawn, deepspeed, ...``). Called once when the package is imported.

    Lightning offers no hook for that error: it checks the name in the constructor of its private
    ``_AcceleratorConnector``, which the Trainer builds with ``strategy=`` as a keyword. This wraps that
    constructor: when it raises ``ValueError`` for a string that no registry entry matches, the error
    is raised again with :func:`unknown_strategy_message`; every other call and error passes through
    unchanged, so the Trainer refuses exactly what it refused before. Returns whether the wrapper is
    in place (``False`` when a Lightning release moved the class: its own message then stands).
    """
    try:
        from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
    except ImportError:
        return False
    init = _AcceleratorConnector.__init__
    if getattr(init, "__commstrats_wrapped__", False):  # a second import, or a reload
        return True

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValueError:
            strategy = kwargs.get("strategy")
            if isinstance(strategy, str) and not is_registered_strategy(strategy):
                raise ValueError(unknown_strategy_message("strategy", strategy)) from None
            raise

    __init__.__commstrats_wrapped__ = True  # type: ignore[attr-defined]
    _AcceleratorConnector.__init__ = __init__  # type: ignore[method-assign]
    return True


def unknown_strategy_message(argument: str, value: str, names: Iterable[str] | None = None) -> str:
    """The error for ``argument=value`` when ``value`` names no strategy: the nearest names (among
    every name the Trainer takes, the package's and Lightning's, or among ``names`` when given) and
    the package's names.

    Example: ``--trainer.strategy='dilocco' is not a registered strategy name; did you mean 'diloco'?
    lightning_commstrats registers allreduce, onebit_sgd, ...``
    """
    close = nearest_strategy_names(value, names)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    ours = ", ".join(package_strategy_names())
    if names is not None:
        return f"{argument}={value!r} is not a lightning_commstrats strategy; {hint}choose one of {ours}"
    return (
        f"{argument}={value!r} is not a registered strategy name; {hint}lightning_commstrats registers {ours};"
        " Lightning's own names (ddp, fsdp, deepspeed...) work too"
    )
