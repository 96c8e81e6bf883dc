"""What a periodic scheme sends at a sync: its settings with the strategies' defaults, checked as the
strategies check them, and the bytes of its sparse and gathered exchanges."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_commstrats.advisor.inputs import STREAMING_FRAGMENTS, int_setting
from lightning_commstrats.comm import wire
from lightning_commstrats.comm.base import LocalCommunicator
from lightning_commstrats.compression.density import StatisticalAllGather, check_schedule
from lightning_commstrats.compression.sparse import SPARSE_VALUE_BITS, TopKCodec
from lightning_commstrats.compression.sparse_tiles import TiledSparseAllGather
from lightning_commstrats.strategies.periodic_settings import PSEUDO_GRAD_BITS
from lightning_commstrats.strategies.streaming_diloco import default_delay


@dataclass(frozen=True)
class Schedule:
    """A periodic scheme's settings with the strategy's defaults filled in."""

    period: int
    bits: int
    by_rows: bool
    fragments: int
    delay: int
    keep_local_progress: bool
    sparse: TopKCodec | None  # sparseloco's codec (topk_form="chunks")
    small: int
    # sparseloco's published form, or diloco's dense statistical codec: one rank's payload per tensors
    gather: TiledSparseAllGather | None = None


def schedule_of(scheme: str, settings: Mapping[str, Any], tensors: int) -> Schedule:
    """``settings`` of a periodic scheme with the strategy's defaults, checked as the strategy checks
    them; ``tensors``: the model's parameter tensors (fragments are runs of them)."""
    if "sync_period" not in settings:
        raise ValueError(f"settings: {scheme} needs sync_period (in optimizer steps)")
    period = int_setting(settings, "sync_period", 0)
    if period < 1:
        raise ValueError(f"settings: sync_period must be an int >= 1 (optimizer steps), got {period!r}")
    unit = settings.get("sync_period_unit", "steps")
    if unit != "steps":
        raise ValueError(f"settings: the advisor counts periods in optimizer steps; sync_period_unit={unit!r}")
    published = scheme == "sparseloco" and settings.get("topk_form", "chunks") == "published"
    if scheme == "sparseloco" and settings.get("topk_form", "chunks") not in ("chunks", "published"):
        raise ValueError(
            f"settings: topk_form={settings['topk_form']!r} is not supported; choose 'chunks' or 'published'"
        )
    small = int_setting(settings, "small_tensor_numel", 0 if published else 1024)
    codec = settings.get("pseudo_grad_codec", "uniform")
    if codec not in ("uniform", "e3m0", "statistical"):
        raise ValueError(
            f"settings: the advisor predicts pseudo_grad_codec 'uniform', 'e3m0' or 'statistical', got {codec!r}"
        )
    default_bits = {"streaming_diloco": 4, "sparseloco": 2}.get(scheme, 2 if codec == "statistical" else 32)
    allowed = SPARSE_VALUE_BITS if scheme == "sparseloco" else (2, 4, 8) if codec == "statistical" else PSEUDO_GRAD_BITS
    bits = int_setting(settings, "pseudo_grad_bits", default_bits, allowed)
    gather = StatisticalAllGather(LocalCommunicator(), bits=bits) if codec == "statistical" else None
    scales = settings.get("pseudo_grad_scales", "rows")
    if scales not in ("rows", "columns"):
        raise ValueError(f"settings: pseudo_grad_scales={scales!r} is not supported; choose one of ('rows', 'columns')")
    fragments, delay, keep, sparse = 1, 0, False, None
    if scheme in ("streaming_diloco", "sparseloco"):
        streaming = scheme == "streaming_diloco"
        fragments = int_setting(settings, "num_fragments", STREAMING_FRAGMENTS if streaming else 1)
        most = 5 if streaming else 1  # the strategies' default delays (or less where the period allows less)
        delay = int_setting(settings, "fragment_sync_delay", default_delay(period, fragments, most=most))
        keep = settings.get("keep_local_progress", not streaming)
        if not isinstance(keep, bool):
            raise ValueError(f"settings: keep_local_progress must be True or False, got {keep!r}")
        if not 1 <= fragments <= min(period, tensors):
            raise ValueError(
                f"settings: num_fragments={fragments} must be in [1, min(sync_period, parameter tensors)]"
                f" = [1, {min(period, tensors)}]"
            )
        if delay < 0 or (delay and delay * fragments >= period):
            raise ValueError(
                f"settings: fragment_sync_delay={delay} must be >= 0 and < sync_period / num_fragments"
                f" = {period}/{fragments}"
            )
        if published:  # the steady state: the schedule's first syncs send more
            tile = int_setting(settings, "topk_tile", 64)
            kept = int_setting(settings, "topk_per_chunk", 64)
            if tile < 1 or not 1 <= kept <= tile * tile:
                raise ValueError(
                    f"settings: topk_tile={tile} must be >= 1 and topk_per_chunk={kept} in [1, topk_tile^2]"
                )
            check_schedule(settings.get("topk_schedule"), kept, tile * tile, name="settings: topk_schedule")
            gather = TiledSparseAllGather(LocalCommunicator(), tile=tile, k=kept, bits=bits)
        elif not streaming:
            chunk = int_setting(settings, "topk_chunk", 4096)
            kept = int_setting(settings, "topk_per_chunk", 64)
            if chunk < 2 or not 1 <= kept <= chunk:
                raise ValueError(
                    f"settings: topk_chunk={chunk} must be >= 2 and topk_per_chunk={kept} in [1, topk_chunk]"
                )
            sparse = TopKCodec(chunk, kept, bits)
    return Schedule(period, bits, scales == "rows", fragments, delay, keep, sparse, small, gather)


def sparse_exchange_bytes(shapes: Sequence[tuple[int, ...]], n: int, codec: TopKCodec, small_tensor_numel: int) -> int:
    """Bytes one rank sends in one sparse averaging (``sparseloco``'s exchange): every tensor of more
    than ``small_tensor_numel`` values in chunks of ``codec.chunk`` (the last one of each tensor
    padded), one payload per rank all-gathered; the rest in an fp32 ring all-reduce."""
    sizes = [math.prod(s) for s in shapes]
    chunks = sum(-(-k // codec.chunk) for k in sizes if k > small_tensor_numel)
    dense = sum(k for k in sizes if k <= small_tensor_numel)
    payload = codec.payload_bytes(chunks) if chunks else 0
    return wire.all_gather_bytes(payload, 1, n) + wire.all_reduce_bytes(dense, 4, n)


def gathered_exchange_bytes(
    shapes: Sequence[tuple[int, ...]], n: int, gather: TiledSparseAllGather, small_tensor_numel: int
) -> int:
    """Bytes one rank sends in one averaging by ``gather`` (``sparseloco``'s published form, or the dense
    statistical codec): every tensor of more than ``small_tensor_numel`` values in one payload per rank,
    all-gathered; the rest in an fp32 ring all-reduce."""
    big = [tuple(s) for s in shapes if math.prod(s) > small_tensor_numel]
    dense = sum(math.prod(s) for s in shapes if math.prod(s) <= small_tensor_numel)
    payload = gather.payload_bytes(big) if big else 0
    return wire.all_gather_bytes(payload, 1, n) + wire.all_reduce_bytes(dense, 4, n)
