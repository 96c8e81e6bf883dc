"""Fusing many small tensors into few large buffers, so that each collective moves one buffer.

Pure tensor code. A bucket holds tensors of one dtype and device, in the order given, up to a size
cap; the order is the parameters' registration order, identical on every rank, so every rank
builds the same buckets without talking. :class:`FlatBuffers` keeps the flat buffers of a plan
from one call to the next, so that a step allocates nothing.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass(frozen=True)
class BucketKey:
    """The identity of one fused bucket: its traffic tag and the names of its tensors, in order.

    What keys a bucket's error-feedback residual on a quantized hop. Built from names, never from a
    size: two buckets of equal length (identical Transformer blocks) hold different tensors and
    must not share a residual. :meth:`residual_key` is the string a checkpoint stores; a holder of
    residuals keeps :attr:`names` beside it, so that a key reused for other tensors raises.
    """

    tag: str
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.names or not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(f"a bucket key needs the names of the bucket's tensors, got {self.names!r}")

    @property
    def residual_key(self) -> str:
        """``<tag>:<first>[..<last>]#<count>:<crc32 of every name>``: readable, and distinct for other names."""
        span = self.names[0] if len(self.names) == 1 else f"{self.names[0]}..{self.names[-1]}"
        digest = zlib.crc32("\0".join(self.names).encode())
        return f"{self.tag}:{span}#{len(self.names)}:{digest:08x}"


def park(t: Tensor, home: torch.device | None) -> Tensor:
    """``t`` kept at ``home``: itself when ``home`` is ``None`` or its device, else a copy there (in
    pinned memory when ``home`` is the host of a CUDA tensor; the copy waits for the tensor)."""
    if home is None or t.device == home:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=home, pin_memory=home.type == "cpu" and t.is_cuda)
    return out.copy_(t)


def visit(t: Tensor | None, device: torch.device) -> Tensor | None:
    """``t`` on ``device`` to be used there (a copy from pinned host memory is queued on the current
    stream, ordered before what uses it)."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=t.is_pinned())


RESIDUAL_PLACES = ("device", "host")


def check_residuals(residuals: Any, name: str = "residuals") -> None:
    """``residuals`` (where error-feedback residuals wait between steps) must be one of :data:`RESIDUAL_PLACES`."""
    if residuals not in RESIDUAL_PLACES:
        raise ValueError(
            f"{name}={residuals!r} is not supported; choose one of {RESIDUAL_PLACES} (where the error-feedback"
            " residuals wait between steps: on the training device, or in host memory, pinned on CUDA)"
        )


def residual_home(residuals: str) -> torch.device | None:
    """The :class:`Parking` home of a ``residuals`` setting: the host, or ``None`` (where they are made)."""
    check_residuals(residuals)
    return torch.device("cpu") if residuals == "host" else None


class Parking:
    """Where a holder's error-feedback residuals wait between calls, and their copies there and back.

    ``home`` ``None``: where they are made (the training device); nothing moves. The host
    (``torch.device("cpu")``) on a CUDA run: each residual waits in pinned host memory and comes to
    the device only while its tensor is encoded, and no copy makes the host wait:

    - :meth:`park` copies into a new pinned buffer with ``non_blocking=True`` on the current stream
      (after the kernels that made the residual, in stream order), then records an event;
    - :meth:`visit` makes the current stream wait for that event (a wait on the device: a visit from
      another stream than the parking one still reads what was written) and copies to the device
      with ``non_blocking=True`` from pinned memory;
    - the host reads residuals only after :meth:`settle` (a checkpoint, a snapshot), which waits for
      the event.

    Every park writes a new buffer, never the old one: the old one may still be read by a visit
    queued earlier, or held by a checkpoint being written. PyTorch's pinned-memory allocator hands a
    freed buffer out again only once the copies queued on it have run (it records an event for every
    non-blocking copy from or into pinned memory), so that memory comes back without a synchronisation
    either. A residual handed in from the host (a checkpoint's) is kept as it is until its first
    park: pageable memory, copied to the device synchronously by that one visit. On a CPU run the
    host is the device: nothing is copied.
    """

    def __init__(self, home: torch.device | None = None) -> None:
        self.home = home
        self._parked: Any = None  # torch.cuda.Event after the last non-blocking parks

    def park(self, t: Tensor) -> Tensor:
        """``t`` kept at the home (itself when it is there already, or there is none)."""
        if self.home is None or t.device == self.home:
            return t
        pinned = self.home.type == "cpu" and t.is_cuda
        out = torch.empty(t.shape, dtype=t.dtype, device=self.home, pin_memory=pinned)
        return out.copy_(t, non_blocking=pinned)

    def park_all(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`park` every value, then one event after the copies (the host went on meanwhile)."""
        out = {name: self.park(t) for name, t in tensors.items()}
        made = next((t.device for name, t in tensors.items() if t.is_cuda and out[name] is not t), None)
        if made is not None:  # on the stream the copies were queued on
            self._parked = torch.cuda.Event()
            self._parked.record(torch.cuda.current_stream(made))
        return out

    def visit(self, t: Tensor | None, device: torch.device) -> Tensor | None:
        """``t`` on ``device`` to be used there; a copy from pinned memory is queued on the current
        stream after the parks (see the class notes)."""
        if t is None or t.device == device:
            return t
        if self._parked is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self._parked)
        return t.to(device, non_blocking=t.is_pinned())

    def settle(self) -> None:
        """Wait until the parked residuals are written (before the host reads them)."""
        if self._parked is not None:
            self._parked.synchronize()
            self._parked = None


def plan_buckets(tensors: Sequence[Tensor], cap_bytes: int) -> list[list[int]]:
    """Group tensor indices into buckets of one dtype and device, each at most ``cap_bytes`` (a tensor
    larger than the cap gets a bucket of its own)."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    buckets: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        size = t.numel() * t.element_size()
        indices, used = open_buckets.get(key, ([], 0))
        if indices and used + size > cap_bytes:
            buckets.append(indices)
            indices, used = [], 0
        indices.append(i)
        open_buckets[key] = (indices, used + size)
    buckets.extend(indices for indices, _ in open_buckets.values() if indices)
    return sorted(buckets, key=lambda b: b[0])


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One new contiguous 1-D buffer holding ``tensors`` back to back."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (in place)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat buffer has {flat.numel()} elements, tensors hold {offset}")


def layout_key(tensors: Sequence[Tensor]) -> tuple[Any, ...]:
    """What a bucket plan and its buffers depend on: the shapes, dtypes and devices, in order."""
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


def _streams(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """The current CUDA stream of every CUDA device of a layout (empty on CPU)."""
    devices = sorted({device.index for _, _, device in key if device.type == "cuda"})
    return tuple(torch.cuda.current_stream(d) for d in devices)


class FlatBuffers:
    """One contiguous 1-D buffer per bucket of ``plan``, made once and reused, each with a view
    shaped like every tensor of its bucket: tensors go in and come out with one fused copy each way
    (``torch._foreach_copy_``) instead of a new concatenation per call.

    The buffers are used on the CUDA stream current when they were made; :meth:`fits` refuses
    another stream, so that a buffer is never written on one stream while another still reads it.

    Args:
        tensors: tensors with the layout (shapes, dtypes, devices) the buffers are for.
        plan: buckets of indices into ``tensors`` (:func:`plan_buckets`).
    """

    def __init__(self, tensors: Sequence[Tensor], plan: Sequence[Sequence[int]]) -> None:
        self.key = layout_key(tensors)
        self.streams = _streams(self.key)
        self.flats: list[Tensor] = []
        self.views: list[list[Tensor]] = []
        for indices in plan:
            bucket = [tensors[i] for i in indices]
            flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            parts = flat.split([t.numel() for t in bucket])
            self.flats.append(flat)
            self.views.append([v.view(t.shape) for v, t in zip(parts, bucket, strict=True)])

    def fits(self, key: tuple[Any, ...]) -> bool:
        """Whether tensors of layout ``key`` (:func:`layout_key`) fit, on the streams current now."""
        return key == self.key and _streams(key) == self.streams

    def fill(self, b: int, bucket: Sequence[Tensor]) -> Tensor:
        """Copy ``bucket`` (the tensors of bucket ``b``) into its buffer; returns the buffer."""
        with torch.no_grad():  # the buffer never joins a graph, whatever the tensors are
            torch._foreach_copy_(self.views[b], list(bucket))
        return self.flats[b]

    def empty(self, b: int, bucket: Sequence[Tensor]) -> None:
        """Copy bucket ``b``'s buffer back into its tensors (in place)."""
        with torch.no_grad():
            torch._foreach_copy_(list(bucket), self.views[b])
