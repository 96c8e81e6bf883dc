"""Log records that every rank would write alike, written once, by global rank 0."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_only


def log_rank_zero(logger: logging.Logger, level: int, msg: str, *args: Any) -> None:
    """``logger.log(level, msg, *args)`` on global rank 0 only.

    For what every rank would print alike: a warning about the configuration or a checkpoint's
    state, a decision all ranks took together. A rank's own trouble (its failure, its shard) goes
    to ``logger`` on that rank. The rank is Lightning's ``rank_zero_only.rank``, which the package's
    strategies set when they know their rank (before that, Lightning's guess from the environment).
    """
    if getattr(rank_zero_only, "rank", 0) == 0:
        logger.log(level, msg, *args, stacklevel=2)
