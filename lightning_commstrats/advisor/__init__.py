"""Which scheme to train with: every candidate's predicted step time from the cost model, ranked.

Given a model (or its parameter shapes), the link rate between the ranks, the measured compute
time of one training step (one rank, no communication) and the number of ranks,
:func:`advise` predicts the seconds per optimizer step of each candidate scheme and setting
(period, bits, sampled rows) and returns them fastest first; ``commstrats-advise`` prints them as
a markdown table::

    commstrats-advise --config lstm_demo --bandwidth 100 --compute-seconds 0.63 --ranks 4
    commstrats-advise --shapes shapes.json --bandwidth 1000 --compute-seconds 0.2 --ranks 8 \\
        --schemes diloco streaming_diloco

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

from lightning_commstrats.advisor.command import (
    main,
    measure_bandwidth,
    model_from_config,
    model_from_json,
    optimizer_from_config,
)
from lightning_commstrats.advisor.fsdp import (
    FsdpGathers,
    FsdpTraffic,
    FsdpUnits,
    fsdp_gathers,
    fsdp_traffic,
    fsdp_transient,
    fsdp_units,
    units_by_size,
)
from lightning_commstrats.advisor.grid import advise, default_settings, departure, mib, readable, recommend, table
from lightning_commstrats.advisor.inputs import (
    OUT_OF_SCOPE,
    SCHEMES,
    SETTINGS,
    SHARDABLE,
    model_shape,
    parse_size,
    resolve_links,
    vocabulary_of,
)
from lightning_commstrats.advisor.memory import Memory, memory_per_rank
from lightning_commstrats.advisor.peak import (
    ALLOCATOR_SLACK,
    HOST_PROCESS_BYTES,
    Peak,
    activation_bytes,
    peak_per_rank,
    peak_phases,
)
from lightning_commstrats.advisor.predict import (
    Candidate,
    Sharded,
    expected_distinct,
    expected_sampled_rows,
    predict,
    zipf_probabilities,
)
from lightning_commstrats.advisor.schedule import gathered_exchange_bytes, sparse_exchange_bytes

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
    "Sharded",
    "activation_bytes",
    "advise",
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
    "optimizer_from_config",
    "parse_size",
    "peak_per_rank",
    "peak_phases",
    "predict",
    "readable",
    "recommend",
    "resolve_links",
    "sparse_exchange_bytes",
    "table",
    "units_by_size",
    "vocabulary_of",
    "zipf_probabilities",
]
