"""Memory accounting: the bytes a rank holds, by kind and device, counted from the tensors' storages.

Not a formula: every tensor is traced to its storage (``untyped_storage()``), each storage is counted
once, in the first kind that reaches it, in full (a view of a larger buffer counts the buffer, as
the allocator holds it; FSDP2's padded shards count their padding). Kinds:

- ``parameters``: the module's parameters (this rank's shards under ``shard="fsdp"``) and buffers;
- ``gradients``: their ``.grad``;
- ``optimizer``: every tensor in the optimizers' state (Adam's moments, momentum buffers, steps);
- ``scheme``: the scheme's own state (the global model and outer optimizer of a periodic scheme, an
  exchange in flight, error-feedback residuals, fused buckets kept between steps).

Devices are named as torch names them (``"cpu"``, ``"cuda:0"``); pinned host memory is ``"cpu"``.
On a CPU run every kind is host memory: keeping the outer state "on the host" or "on the device"
is the same memory there, and the accounting shows it so. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_commstrats.sharding.layout import local
from lightning_commstrats.sharding.process_memory import format_process_memory

KINDS = ("parameters", "gradients", "optimizer", "scheme")


def memory_by_kind(
    module: nn.Module, optimizers: Sequence[Optimizer], scheme: Iterable[Tensor] = ()
) -> dict[str, dict[str, int]]:
    """``{kind: {device: bytes}}`` for this rank (see the module docstring); kinds with nothing held
    map to an empty dict."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, dict[str, int]] = {kind: {} for kind in KINDS}

    def count(kind: str, tensors: Iterable[Tensor | None]) -> None:
        for t in tensors:
            if t is None:
                continue
            t = local(t)
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            out[kind][str(t.device)] = out[kind].get(str(t.device), 0) + storage.nbytes()

    params = list(module.parameters())
    count("parameters", [*params, *module.buffers()])
    count("gradients", [p.grad for p in params])
    count(
        "optimizer",
        [v for opt in optimizers for state in opt.state.values() for v in state.values() if isinstance(v, Tensor)],
    )
    count("scheme", scheme)
    return out


def tensors_in(obj: Any) -> list[Tensor]:
    """Every tensor in a nested structure of dicts, lists and tuples, and the buffers an object with
    ``held_tensors()`` keeps (a fused all-reduce's)."""
    found: list[Tensor] = []

    def visit(o: Any) -> None:
        if isinstance(o, Tensor):
            found.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)
        elif hasattr(o, "held_tensors"):
            visit(o.held_tensors())

    visit(obj)
    return found


def total_bytes(report: dict[str, dict[str, int]], kinds: Iterable[str] = KINDS) -> int:
    """The bytes of ``kinds`` over every device."""
    return sum(sum(report[k].values()) for k in kinds)


def format_memory(report: dict[str, dict[str, int]], process: dict[str, dict[str, Any]] | None = None) -> str:
    """One line: MiB per kind (with the device when not every tensor is on one); then, given
    ``process`` (:meth:`~lightning_commstrats.sharding.process_memory.ProcessMemory.stats`), what the
    process held at its peak, after ``|``."""
    devices = {d for by_device in report.values() for d in by_device}
    parts = []
    for kind in KINDS:
        by_device = report[kind]
        if len(devices) > 1:
            shown = " + ".join(f"{b / 2**20:.1f} {d}" for d, b in sorted(by_device.items())) or "0"
        else:
            shown = f"{sum(by_device.values()) / 2**20:.1f}"
        parts.append(f"{kind} {shown}")
    where = f" MiB on {next(iter(devices))}" if len(devices) == 1 else " MiB"
    line = ", ".join(parts) + where
    if process:
        line += " | " + format_process_memory(process)
    return line
