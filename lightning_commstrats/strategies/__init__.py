"""Lightning strategies, one file per communication scheme; registry names are the public API."""

from lightning_commstrats.strategies.allreduce import AllReduceStrategy
from lightning_commstrats.strategies.base import CommStrategy

STRATEGIES: tuple[type[CommStrategy], ...] = (AllReduceStrategy,)

__all__ = ["STRATEGIES", "AllReduceStrategy", "CommStrategy"]
