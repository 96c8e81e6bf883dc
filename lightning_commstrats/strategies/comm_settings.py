"""The settings every scheme of the package takes (:class:`~lightning_commstrats.strategies.base.CommStrategy`'s
constructor), checked before anything is built: a bad value is a ``ValueError`` naming the argument and what
is allowed; an argument no class of the scheme's hierarchy takes is a ``TypeError`` with the nearest names."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

from lightning_commstrats._cli_errors import nearest
from lightning_commstrats.comm import BACKENDS, import_mpi
from lightning_commstrats.compression.hierarchical import check_slow_bits
from lightning_commstrats.sharding import check_shard
from lightning_commstrats.sharding.process_memory import check_phases

START_METHODS = ("popen", "spawn", "fork", "forkserver")
RESUME_MISMATCH = ("error", "reset", "reshard")
NONFINITE_POLICIES = ("raise", "skip")


def check_comm_settings(
    owner: type,
    unknown: dict[str, Any],
    *,
    backend: str,
    timeout: Any,
    start_method: str,
    bucket_cap_mb: float,
    resume_mismatch: str,
    nonfinite: str,
    verify_sync_every: Any,
    verify_sync_action: str,
    process_group_backend: str | None,
    group_size: Any,
    slow_hop_bits: int,
    shard: Any,
    shard_policy: Any,
    memory_phases: Any,
) -> tuple[str, timedelta]:
    """Check the settings of scheme class ``owner`` (``unknown``: the keyword arguments its constructors
    did not take); returns the backend (``process_group_backend``, Lightning's name, folded in) and the
    timeout as a ``timedelta``."""
    if "fault_tolerance" in unknown:
        raise ValueError(
            f"{owner.__name__} cannot honour fault_tolerance: only the periodic schemes (model_averaging,"
            " bmuf, diloco, streaming_diloco, sparseloco, PeriodicSyncStrategy) survive replicas that die and"
            " rejoin; a scheme that exchanges every step needs every rank at every step"
        )
    if unknown:
        hint = _suggest(owner, unknown)
        raise TypeError(
            f"{owner.__name__} got unexpected keyword argument(s) {sorted(unknown)}{hint};"
            f" see help(lightning_commstrats.{owner.__name__}) for what it takes"
        )
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive timedelta or number of seconds, got {timeout!r}")
    if process_group_backend is not None:  # the name Lightning's DDPStrategy uses
        if backend not in ("auto", process_group_backend):
            raise ValueError(
                f"backend={backend!r} and process_group_backend={process_group_backend!r} disagree; give one"
            )
        backend = process_group_backend
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {BACKENDS}")
    if backend == "mpi":
        import_mpi()  # without the [mpi] extra: an install hint now, not at the first collective
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not supported; choose one of {START_METHODS}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if resume_mismatch not in RESUME_MISMATCH:
        raise ValueError(f"resume_mismatch={resume_mismatch!r} is not supported; choose one of {RESUME_MISMATCH}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r} is not supported; choose one of {NONFINITE_POLICIES}")
    if group_size is not None and group_size != "node":
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, 'node' or None, got {group_size!r}")
    check_slow_bits(slow_hop_bits)
    check_phases(memory_phases, "memory_phases")
    if slow_hop_bits < 32 and group_size is None and shard is None:
        raise ValueError(f"slow_hop_bits={slow_hop_bits} needs group_size (the hop between groups of ranks)")
    if isinstance(verify_sync_every, bool) or not isinstance(verify_sync_every, int) or verify_sync_every < 0:
        raise ValueError(f"verify_sync_every must be an int >= 0 (0: never), got {verify_sync_every!r}")
    if verify_sync_action not in ("raise", "warn"):
        raise ValueError(f"verify_sync_action={verify_sync_action!r} is not supported; choose one of ('raise', 'warn')")
    check_shard(shard, owner.__name__, getattr(owner, "supports_shard", False), backend)
    if shard_policy is not None and shard is None:
        raise ValueError("shard_policy is given without shard: pass shard='fsdp' too, or no shard_policy")
    return backend, timeout


def _suggest(cls: type, unknown: dict[str, Any]) -> str:
    """``" (did you mean: sync_peroid -> sync_period?)"`` for misspelled keyword arguments: the nearest
    of the names every ``__init__`` in ``cls``'s hierarchy takes, or ``""``."""
    taken = {
        name
        for klass in cls.__mro__
        if "__init__" in vars(klass)
        for name, param in inspect.signature(vars(klass)["__init__"]).parameters.items()
        if name != "self" and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)
    }
    hints = [f"{name} -> {' or '.join(close)}" for name in sorted(unknown) if (close := nearest(name, sorted(taken)))]
    return f" (did you mean: {', '.join(hints)}?)" if hints else ""
