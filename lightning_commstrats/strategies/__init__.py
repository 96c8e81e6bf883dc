"""Lightning strategies, one file per communication scheme; registry names are the public API."""

from lightning_commstrats.strategies.allreduce import AllReduceStrategy
from lightning_commstrats.strategies.base import CommStrategy
from lightning_commstrats.strategies.onebit_sgd import OneBitSGDStrategy

STRATEGIES: tuple[type[CommStrategy], ...] = (AllReduceStrategy, OneBitSGDStrategy)

__all__ = ["STRATEGIES", "AllReduceStrategy", "CommStrategy", "OneBitSGDStrategy"]
