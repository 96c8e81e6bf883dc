"""Where a strategy's own state leaves and comes back: snapshots, checkpoint files, their restore.

A scheme's state is two dictionaries (:meth:`CommStrategy.state_dict`, the same on every rank, and
:meth:`CommStrategy.rank_state_dict`, this rank's), the slow hop's residuals held by its reducer, and
a few counters. :class:`StateStore` is the component a strategy holds for every way they are copied
out or put back, and each of those is a transaction (:meth:`StateStore.transaction`) that first lands
the work in flight: an exchange running in a background thread writes the error feedback, so a copy
taken or a state put back while it runs would be torn. AutoAdjust's trials roll back through
:meth:`StateStore.snapshot` / :meth:`StateStore.restore`; checkpoints go through
:meth:`StateStore.entry` (save) and :meth:`StateStore.read` then :meth:`StateStore.restore_pending`
(load, applied when training starts).

Checkpoint files of a run that is not sharded: rank 0 writes the file (the model, the state every
rank shares) and each rank streams its own state to a shard beside it, ``<file>.rank<r>-of-<N>``,
written before the file that names them. A sharded run's directory is
:mod:`lightning_commstrats.sharding.checkpoint`'s.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_commstrats._logging import log_rank_zero

log = logging.getLogger(__name__)

STATE_KEY = "lightning_commstrats"  # the scheme's entry in a Lightning checkpoint
TWO_LEVEL_KEY = "two_level"  # in a rank's state: the residuals of a quantized slow hop
COUNTER_TYPES = (int, float, bool)  # the strategy's plain attributes a snapshot keeps


class StateStore:
    """Snapshots and checkpoint files of ``strategy``'s own state, each a transaction that first waits
    for the work in flight (see the module docstring). ``strategy`` is the
    :class:`~lightning_commstrats.strategies.base.CommStrategy` that holds it (its state dicts,
    ``reducer``, ``wait_for_exchange``, ``resume_mismatch``, ranks and ``checkpoint_io`` are read)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.pending: dict[str, Any] | None = None  # read from a checkpoint, applied when training starts

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Land the work in flight (a background exchange) before the state is read or written."""
        self.strategy.wait_for_exchange()
        yield

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> dict[str, Any]:
        """A private copy of everything of the strategy's that training changes: both state dicts, the
        slow hop's residuals and the counters kept outside them (the samples at the last step, a run's
        sync count found at its first batch..., and those still unset that training may set)."""
        st = self.strategy
        with self.transaction():
            return {
                "state": copy.deepcopy(st.state_dict()),
                "rank_state": copy.deepcopy(st.rank_state_dict()),
                "two_level": copy.deepcopy(st.reducer.state_dict()),
                "counters": {k: v for k, v in vars(st).items() if v is None or type(v) in COUNTER_TYPES},
            }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Put back a :meth:`snapshot` (which stays usable). An exchange started since is waited for
        and dropped: landing after this, it would overwrite the error feedback put back."""
        st = self.strategy
        with self.transaction():
            st.load_state_dict(copy.deepcopy(snapshot["state"]), copy.deepcopy(snapshot["rank_state"]))
            st.reducer.reset()  # residuals made since (a trial's) go, whatever the snapshot held
            if snapshot["two_level"]:
                st.reducer.load_state_dict(copy.deepcopy(snapshot["two_level"]))
            for key, value in snapshot["counters"].items():
                if value is not None or type(getattr(st, key, None)) in COUNTER_TYPES:
                    setattr(st, key, value)

    # ------------------------------------------------------------------ saving

    def rank_state(self) -> dict[str, Any]:
        """This rank's state as checkpoints hold it: the scheme's, and the slow hop's residuals."""
        st = self.strategy
        with self.transaction():
            rank = st.rank_state_dict()
            hop = st.reducer.state_dict()
        return {**rank, TWO_LEVEL_KEY: hop} if hop else rank

    def entry(self, filepath: Any) -> dict[str, Any]:
        """Collective. The scheme's entry of the checkpoint ``filepath``: the state every rank shares,
        and either this process's own state (one process) or the names of the ranks' shards, each
        rank's written beside ``filepath`` before this returns (on every rank)."""
        st = self.strategy
        with self.transaction():
            entry: dict[str, Any] = {
                "strategy": type(st).__name__,
                "world_size": st.world_size,
                "state": to_cpu(st.state_dict()),
            }
            rank = self.rank_state()
        if st.world_size == 1:  # one process: its state goes in the file itself
            entry["rank"] = to_cpu(rank)
        else:
            shards = [shard_name(filepath, r, st.world_size) for r in range(st.world_size)]
            self.write_shard(to_cpu(rank), beside(filepath, shards[st.global_rank]))
            st.comm.barrier()
            entry["shards"] = shards
        return entry

    def write_shard(self, state: dict[str, Any], path: str) -> None:
        """Write a shard whole or not at all. A local file is streamed by ``torch.save`` to a
        temporary name and renamed (no in-memory copy of the state); other filesystems go through
        the strategy's ``CheckpointIO``."""
        if "://" in path:
            self.strategy.checkpoint_io.save_checkpoint(state, path)
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def remove_shard(self, filepath: Any) -> None:
        """Remove this rank's shard of the checkpoint ``filepath`` (every rank its own)."""
        st = self.strategy
        shard = beside(filepath, shard_name(filepath, st.global_rank, st.world_size))
        if os.path.exists(shard):
            st.checkpoint_io.remove_checkpoint(shard)

    # ------------------------------------------------------------------ loading

    def read(self, checkpoint: dict[str, Any], checkpoint_path: Any, weights_only: bool | None = None) -> None:
        """Take the scheme's entry of a loaded ``checkpoint`` (and this rank's shard beside it) as the
        state to restore when training starts (:meth:`restore_pending`)."""
        st = self.strategy
        saved = checkpoint.get(STATE_KEY)
        if saved is not None:
            saved = dict(saved)
            if "ranks" in saved:  # the earlier format: every rank's state in the one file
                ranks = saved.pop("ranks")
                saved["rank"] = ranks[st.global_rank] if saved["world_size"] == st.world_size else None
            elif "rank" in saved:  # saved by one process
                pass
            elif saved["world_size"] == st.world_size:  # this rank's shard only
                shard = beside(checkpoint_path, saved["shards"][st.global_rank])
                if not os.path.exists(shard):
                    raise FileNotFoundError(
                        f"{checkpoint_path} needs this rank's shard {shard} (rank {st.global_rank} of"
                        f" {st.world_size}): every rank's shard must be where it was written"
                    )
                saved["rank"] = st.checkpoint_io.load_checkpoint(shard, weights_only=weights_only)
            elif st.resume_mismatch == "reshard" and saved.get("shards"):
                # another number of ranks: rank r starts from old rank r mod N_old's state
                old = st.global_rank % saved["world_size"]
                shard = beside(checkpoint_path, saved["shards"][old])
                exists = os.path.exists(shard)
                saved["rank"] = st.checkpoint_io.load_checkpoint(shard, weights_only=weights_only) if exists else None
            else:
                saved["rank"] = None
        self.pending = saved

    def pending_rank_state(self) -> dict[str, Any] | None:
        """This rank's state from the checkpoint being restored, if any (before it is applied)."""
        if self.pending is None or self.pending.get("strategy") != type(self.strategy).__name__:
            return None
        return self.pending.get("rank")

    def restore_pending(self) -> None:
        """Apply the state :meth:`read` took (once), by the strategy's ``resume_mismatch`` when it does
        not fit this run."""
        saved, self.pending = self.pending, None
        if saved is None:
            return
        with self.transaction():
            self._restore(saved)

    def _restore(self, saved: dict[str, Any]) -> None:
        st = self.strategy
        name = type(st).__name__
        rank_state = saved.get("rank")
        two_level = None
        if isinstance(rank_state, dict) and TWO_LEVEL_KEY in rank_state:  # the slow hop's residuals
            rank_state = dict(rank_state)
            two_level = rank_state.pop(TWO_LEVEL_KEY)
            saved = {**saved, "rank": rank_state}
        st.reducer.reset()  # the hop's residuals carry over only to the same ranks; else restart at zero
        if two_level is not None and saved["world_size"] == st.world_size:
            # where the hop keeps them (residuals="host": the host, as read; no trip through the device)
            st.reducer.load_state_dict(to_device(two_level, st.reducer.home or st.root_device))
        if saved["strategy"] != name:
            log_rank_zero(
                log,
                logging.WARNING,
                "checkpoint state of %s is not %s state; %s starts afresh",
                saved["strategy"],
                name,
                name,
            )
            return
        if saved["world_size"] != st.world_size:
            problem = f"it was saved by {saved['world_size']} ranks and this run has {st.world_size}"
            if st.resume_mismatch == "reshard":
                try:
                    rank_state = st.resharded_rank_state(saved["state"], saved.get("rank"), saved["world_size"])
                    st.load_state_dict(saved["state"], to_device(rank_state, st.root_device))
                    log_rank_zero(
                        log, logging.WARNING, "%s: %s; its state was re-split over this run's ranks", name, problem
                    )
                    return
                except ValueError as err:
                    problem = f"{problem}, and {err}"
        else:
            try:
                st.load_state_dict(saved["state"], to_device(saved["rank"], st.root_device))
                return
            except ValueError as err:
                problem = str(err)
        if st.resume_mismatch == "reset":
            # another world size is every rank's problem alike; a rank's own state may fail alone
            say = log_rank_zero if saved["world_size"] != st.world_size else log_here
            say(
                log,
                logging.WARNING,
                "%s: not restoring the checkpoint's strategy state (%s); starting it afresh",
                name,
                problem,
            )
            st.reset_state()
            return
        raise ValueError(
            f"{name} cannot restore its state from the checkpoint: {problem}."
            f" Pass {name}(resume_mismatch='reset') to start that state afresh"
            + ("." if st.resume_mismatch == "reshard" else " (or 'reshard' to re-split it over these ranks).")
        )


def shard_name(filepath: Any, rank: int, world_size: int) -> str:
    """The file name of rank ``rank``'s shard of the checkpoint ``filepath`` (beside it)."""
    return f"{os.path.basename(str(filepath))}.rank{rank}-of-{world_size}"


def beside(filepath: Any, name: str) -> str:
    """The path of the file ``name`` in the folder of ``filepath``."""
    return os.path.join(os.path.dirname(str(filepath)), name)


def to_cpu(obj: Any) -> Any:
    return apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())


def to_device(obj: Any, device: torch.device) -> Any:
    return apply_to_collection(obj, Tensor, lambda t: t.to(device))


def log_here(logger: logging.Logger, level: int, msg: str, *args: Any) -> None:
    """``logger.log`` on this rank (what only this rank knows), as :func:`log_rank_zero` is called."""
    logger.log(level, msg, *args, stacklevel=2)
