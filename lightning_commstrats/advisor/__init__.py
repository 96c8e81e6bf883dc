"""Which scheme to train with: every candidate's predicted step time from the cost model, ranked.

Given a model (or its parameter shapes), the link rate between the ranks, the measured compute
time of one training step (one rank, no communication) and the number of ranks,
:func:`advise` predicts the seconds per optimizer step of each candidate scheme and setting
(period, bits, sampled rows) and returns them fastest first; ``commstrats-advise`` answers in one
line (whether it fits, what to run, its bytes and step: :func:`answer_line`, every figure from one
:class:`Row`), then prints the best few as a short markdown table (``--full``: all of them)::

    commstrats-advise --config lstm_demo --bandwidth 100 --compute-seconds 0.63 --ranks 4
    commstrats-advise --model pythia-1b --batch-size 1 --seq-len 2048 --ranks 8 --shard 4 \\
        --link-inside 400000 --link-between 1000 --compute-seconds 0.5 --device-memory 8GiB

The Python API's arguments are the command's flags, in the same units (``bandwidth`` in Mbit/s,
``schemes``, ``memory_overhead``); the old names are accepted for one more release.

The step time is ``compute + communication``: this package's strategies do not overlap their
collectives with compute, except ``streaming_diloco``, whose fragment exchanges run in the
background for ``fragment_sync_delay`` inner steps and only stall training for what is left of
them. Communication seconds are bytes over the link rate (:mod:`lightning_commstrats.cost_model`:
the bytes the strategies put on the wire, no latency, the link the only bottleneck).

What it does not know: a scheme's own compute (quantizing, selecting rows, the outer step), the
link's protocol overhead, latency, and above all quality. A periodic or compressed scheme that
steps faster is not equally good per step: every candidate whose optimisation differs from
synchronous SGD says so in its note, and its quality must be checked (``benchmarks/compare.py``
races them to a target perplexity). :func:`recommend` therefore prefers, among the candidates
within a tolerance of the fastest, the one that departs least from synchronous SGD.

Memory: :func:`memory_per_rank` predicts the bytes one rank holds between optimizer steps: the
parameters, their gradients and the inner optimizer's state (AdamW's two moments unless told
otherwise), and the scheme's own state as the strategies allocate it (fused gradient buckets, error
feedback residuals, the periodic schemes' global copy and outer optimizer state, a fragment's
exchange in flight), on the device or in host memory (``outer_state``), unsharded or with
``shard="fsdp"`` over groups of ``shard`` ranks. Every :class:`Candidate` carries its
:class:`Memory`; the command prints it beside the step time (``--shard``, ``--outer-state``,
``--optimizer``). Not counted: activations, FSDP2's gathered units, the transient buffers of a sync
(flat copies of a fragment, the codec's scratch), module buffers, the allocator's slack: with a
device's memory (``device_memory``), :func:`peak_phases` adds them phase by phase to each layout's peak
(:class:`Peak`), with the factors measured on a CPU host and a GPU.

Every registered strategy name is either advised (:data:`SCHEMES`) or out of the advisor's scope
with the reason (:data:`OUT_OF_SCOPE`).

To measure the link between running ranks, :func:`measure_bandwidth` times an all-reduce of a
known size on the ranks' :class:`~lightning_commstrats.comm.Communicator`.
"""

import importlib
import sys
import types
from typing import Any

from lightning_commstrats.advisor.command import main

# Every public name and the module that defines it, imported on first use: the command's --help needs none
# of them (nor torch).
_WHERE = {
    "measure_bandwidth": "command",
    "model_from_config": "sources",
    "model_from_json": "sources",
    "module_from_name": "sources",
    "optimizer_from_config": "sources",
    "FsdpGathers": "fsdp",
    "FsdpTraffic": "fsdp",
    "FsdpUnits": "fsdp",
    "fsdp_gathers": "fsdp",
    "fsdp_traffic": "fsdp",
    "fsdp_transient": "fsdp",
    "fsdp_units": "fsdp",
    "units_by_size": "fsdp",
    "advise": "grid",
    "default_settings": "grid",
    "departure": "grid",
    "mib": "grid",
    "readable": "grid",
    "recommend": "grid",
    "table": "grid",
    "OUT_OF_SCOPE": "inputs",
    "SETTINGS": "inputs",
    "SHARDABLE": "inputs",
    "model_shape": "inputs",
    "parse_size": "inputs",
    "resolve_links": "inputs",
    "vocabulary_of": "inputs",
    "SCHEMES": "names",
    "Memory": "memory",
    "memory_per_rank": "memory",
    "ALLOCATOR_SLACK": "peak",
    "HOST_PROCESS_BYTES": "peak",
    "Peak": "peak",
    "activation_bytes": "peak",
    "peak_per_rank": "peak",
    "peak_phases": "peak",
    "Candidate": "predict",
    "Sharded": "predict",
    "expected_distinct": "predict",
    "expected_sampled_rows": "predict",
    "predict": "predict",
    "zipf_probabilities": "predict",
    "gathered_exchange_bytes": "schedule",
    "sparse_exchange_bytes": "schedule",
    "Row": "answer",
    "answer_line": "answer",
    "short_table": "answer",
    "strategy_call": "answer",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


class _Package(types.ModuleType):
    """This package, keeping its names for what :data:`_WHERE` says: importing the submodule ``predict``
    would otherwise bind the module over the function ``advisor.predict``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "ALLOCATOR_SLACK",
    "HOST_PROCESS_BYTES",
    "OUT_OF_SCOPE",
    "SCHEMES",
    "SETTINGS",
    "SHARDABLE",
    "Candidate",
    "FsdpGathers",
    "FsdpTraffic",
    "FsdpUnits",
    "Memory",
    "Peak",
    "Row",
    "Sharded",
    "activation_bytes",
    "advise",
    "answer_line",
    "default_settings",
    "departure",
    "expected_distinct",
    "expected_sampled_rows",
    "fsdp_gathers",
    "fsdp_traffic",
    "fsdp_transient",
    "fsdp_units",
    "gathered_exchange_bytes",
    "main",
    "measure_bandwidth",
    "memory_per_rank",
    "mib",
    "model_from_config",
    "model_from_json",
    "model_shape",
    "module_from_name",
    "optimizer_from_config",
    "parse_size",
    "peak_per_rank",
    "peak_phases",
    "predict",
    "readable",
    "recommend",
    "resolve_links",
    "short_table",
    "sparse_exchange_bytes",
    "strategy_call",
    "table",
    "units_by_size",
    "vocabulary_of",
    "zipf_probabilities",
]
