"""Averaging named tensors over ranks at a chosen precision: the exchange component schemes hold.

:class:`TensorExchange` is what a strategy holds to average its gradients (``onebit_sgd``,
``sampled_vocab``, ``expert_parallel``) or its pseudo-gradients (the periodic schemes), so that every
scheme composes with every codec:

- ``bits=32``: every tensor in fused fp32 all-reduces (buckets of at most ``bucket_cap_mb``);
- ``bits`` in 1, 2, 4, 8, 16: matrices (2+ dimensions, more than ``small_tensor_numel`` values) go
  through the two-stage quantized all-reduce with error feedback
  (:class:`~lightning_commstrats.compression.QuantizedAllReduce`: an all-to-all of packed stripes,
  then an all-gather), the rest (biases, norms) in fused fp32 all-reduces. The codec of the
  matrices: ``codec="uniform"`` (:class:`~lightning_commstrats.compression.ColumnCodec`: 1-bit SGD's
  two means at 1 bit, a uniform grid of ``2^bits`` levels on ``[lo, hi]`` per line at 2, 4, 8 bits,
  half floats at 16) or ``codec="e3m0"`` at 4 bits (:class:`~lightning_commstrats.compression.E3M0Codec`,
  Streaming DiLoCo's 4-bit float: ``+-scale * 2^e`` on one scale per line);
- ``codec="topk"``: tensors of more than ``small_tensor_numel`` values, 1-D ones included, go sparse
  (:class:`~lightning_commstrats.compression.sparse.SparseAllGather`,
  SparseLoCo's exchange: the ``topk_per_chunk`` largest values of every chunk of ``topk_chunk``
  values in ``bits`` bits with their positions, all-gathered, and decayed error feedback), the rest
  in fused fp32 all-reduces; with ``topk_form="published"`` the chunks are 2-D tiles of up to
  ``topk_tile x topk_tile`` and the values go on a statistical grid with a per-tensor lookup, also
  on one rank (:class:`~lightning_commstrats.compression.sparse_tiles.TiledSparseAllGather`);
- ``codec="statistical"``: tensors of more than ``small_tensor_numel`` values go dense in ``bits`` bits
  on that statistical grid, all-gathered, with decayed error feedback
  (:class:`~lightning_commstrats.compression.density.StatisticalAllGather`), the rest in fp32.

Its state is the rank-local error-feedback residuals, keyed by tensor name
(:meth:`TensorExchange.state_dict`). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_commstrats.buckets import (
    BucketKey,
    FlatBuffers,
    check_residuals,
    layout_key,
    plan_buckets,
    residual_home,
    unflatten_into,
)
from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.aggregation import MatrixLayout, QuantizedAllReduce
from lightning_commstrats.compression.density import StatisticalAllGather
from lightning_commstrats.compression.quantizers import check_codec, make_codec
from lightning_commstrats.compression.sparse import SparseAllGather, TopKCodec, check_sparse_args
from lightning_commstrats.compression.sparse_tiles import TiledSparseAllGather, check_tiles_args

EXCHANGE_BITS = (1, 2, 4, 8, 16, 32)
SCALES = ("columns", "rows")
# averages one flat fp32 bucket over ranks: (flat, tag, the bucket's key: its tensors' names) -> a new tensor
Average = Callable[[Tensor, str, BucketKey], Tensor]
WARM_START_UNITS = ("samples", "steps")
HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class BucketedAllReduce:
    """Average tensors over ranks in place, fused into buckets of at most ``cap_bytes`` each.

    The bucket plan of a list of tensors (by shapes, dtypes, devices) is computed once and reused.
    With ``keep_buffers`` (default) each traffic tag keeps the flat buffers of its last layout
    (:class:`~lightning_commstrats.buckets.FlatBuffers`): a step copies its tensors into them and
    back out with one fused copy each way and allocates nothing; another layout (other shapes,
    dtypes, devices) or another CUDA stream replaces them. The price is one copy of the tensors per
    tag held between calls, as DDP holds its buckets. ``keep_buffers=False`` makes them per call
    (for large exchanges that come rarely). One caller at a time (a background exchange has its own).
    ``average(flat, tag, key)``, when given, averages a bucket instead of the flat all-reduce (a
    two-level all-reduce, maybe quantized); ``key`` is the bucket's
    :class:`~lightning_commstrats.buckets.BucketKey`, made from the ``names`` every call must then give.
    """

    def __init__(
        self, comm: Communicator, cap_bytes: int, *, keep_buffers: bool = True, average: Average | None = None
    ) -> None:
        self.comm = comm
        self.cap_bytes = cap_bytes
        self.keep_buffers = keep_buffers
        self.average = average
        self._plans: dict[tuple[Any, ...], list[list[int]]] = {}
        self._buffers: dict[str, FlatBuffers] = {}

    def __call__(
        self,
        tensors: Sequence[Tensor],
        *,
        tag: str,
        names: Sequence[str] | None = None,
        exchange: Callable[[Tensor, list[int]], Tensor] | None = None,
        finite_flags: list[Tensor] | None = None,
    ) -> None:
        """``names``: the tensors' names, one each (required with ``average``: they key each bucket's
        residual). ``exchange(flat, indices)`` replaces the plain all-reduce of one bucket (``indices``
        into ``tensors``); it must return the same tensor on every rank, and keep no reference to
        ``flat`` (a buffer the next call overwrites). With ``finite_flags``, one boolean device
        tensor per bucket is appended to it: whether the bucket's average is finite."""
        if names is not None and len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        if self.average is not None and exchange is None and names is None:
            raise ValueError(f"the buckets of {tag!r} go through {self.average!r}: give their tensors' names (keys)")
        key = layout_key(tensors)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_buckets(tensors, self.cap_bytes)
        buffers = self._buffers.get(tag) if self.keep_buffers else None
        if buffers is None or not buffers.fits(key):
            buffers = FlatBuffers(tensors, plan)
            if self.keep_buffers:
                self._buffers[tag] = buffers
        for b, indices in enumerate(plan):
            bucket = [tensors[i] for i in indices]
            flat = buffers.fill(b, bucket)
            if exchange is not None:
                out = exchange(flat, indices)
            elif self.average is not None:
                assert names is not None
                out = self.average(flat, tag, BucketKey(tag, tuple(names[i] for i in indices)))
            else:
                out = self.comm.all_reduce(flat, "avg", tag=tag)
            if finite_flags is not None:
                finite_flags.append(torch.isfinite(out).all())
            if out is flat:
                buffers.empty(b, bucket)
            else:
                unflatten_into(out, bucket)

    def buffers(self, tag: str) -> FlatBuffers | None:
        """The flat buffers kept for ``tag`` (``None`` when none are)."""
        return self._buffers.get(tag)

    def held_tensors(self) -> list[Tensor]:
        """The flat buffers kept between calls (for memory accounting)."""
        return [flat for buffers in self._buffers.values() for flat in buffers.flats]

    def release(self, tag: str | None = None) -> None:
        """Drop the buffers kept for ``tag`` (for every tag with ``None``): traffic that has ended."""
        if tag is None:
            self._buffers.clear()
        else:
            self._buffers.pop(tag, None)


class TensorExchange:
    """Average named tensors over ranks in place: fp32, 16-bit, or n-bit with error feedback.

    Args:
        comm: the ranks' communicator.
        bits: 32 (fp32), 16 (``half_dtype`` values) or 1, 2, 4, 8 (packed codes + per-column scales).
        half_dtype: ``"float16"`` or ``"bfloat16"`` for 16 bits.
        small_tensor_numel: tensors with at most this many values, and one-dimensional ones, travel
            in fp32 (CNTK: 1024); they are few bytes and sensitive (biases, norms).
        tag: traffic tag of the fp32 part; the quantized part is charged to ``<tag>_quantized``.
        bucket_cap_mb: largest fused fp32 buffer, MiB.
        keep_buffers: keep the fused fp32 buffers between calls (see :class:`BucketedAllReduce`).
        average: averages the fp32 buckets instead of a flat all-reduce (see :class:`BucketedAllReduce`).
        scales: ``"columns"`` (one scale pair per column of a matrix, 1-bit SGD's layout) or
            ``"rows"`` (per row: every word of a vocabulary matrix on its own scale).
        codec: ``"uniform"`` (default: two means at 1 bit, ``2^bits`` uniform levels between two
            float32 scales per line at 2, 4, 8 bits) or ``"e3m0"`` (``bits=4`` only: Streaming DiLoCo's
            4-bit float, ``+-scale * 2^e`` for ``e`` in -6..0 and zero, one float32 scale per line) or
            ``"topk"`` (sparse: ``bits`` in 2, 4, 8, 32 is the width of the kept values) or
            ``"statistical"`` (every value of tensors of more than ``small_tensor_numel`` values in ``bits``
            = 2, 4 or 8 on the published statistical grid with a per-tensor lookup, all-gathered, with
            decayed error feedback: :class:`~lightning_commstrats.compression.density.StatisticalAllGather`).
        topk_chunk: with ``codec="topk"``, values per chunk (SparseLoCo: 4096).
        topk_per_chunk: with ``codec="topk"``, values kept per chunk (SparseLoCo: 64).
        error_feedback_decay: with ``codec="topk"`` or ``"statistical"``, the decay of the error
            feedback (SparseLoCo: 0.95); other codecs carry their residuals undecayed (1.0).
        topk_sigmas: with ``topk_form="published"`` or ``codec="statistical"``, the statistical grid's
            width in standard deviations (6).
        topk_form: with ``codec="topk"``, ``"chunks"`` (runs of ``topk_chunk`` consecutive values, the
            sign-and-magnitude code; skipped on one rank) or ``"published"`` (SparseLoCo as published:
            2-D tiles of up to ``topk_tile x topk_tile``, ``topk_per_chunk`` kept per tile, the
            statistical quantizer; on one rank too; see
            :mod:`~lightning_commstrats.compression.sparse_tiles`).
        topk_tile: with ``topk_form="published"``, the largest side of a tile (64).
        residual_home: where the error-feedback residuals are kept between calls: ``None`` (where
            they are made, the tensors' device) or the host (``torch.device("cpu")``: pinned memory
            on a CUDA run; each comes to the device only while its tensor is encoded).
    """

    def __init__(
        self,
        comm: Communicator,
        bits: int = 32,
        *,
        half_dtype: str = "float16",
        small_tensor_numel: int = 1024,
        tag: str = "grad",
        bucket_cap_mb: float = 25.0,
        keep_buffers: bool = True,
        average: Average | None = None,
        scales: str = "columns",
        codec: str = "uniform",
        topk_chunk: int = 4096,
        topk_per_chunk: int = 64,
        error_feedback_decay: float = 1.0,
        topk_form: str = "chunks",
        topk_tile: int = 64,
        topk_sigmas: float = 6.0,
        residual_home: torch.device | None = None,
    ) -> None:
        check_exchange_args(bits, half_dtype, small_tensor_numel)
        check_codec_settings(
            codec, bits, topk_chunk, topk_per_chunk, error_feedback_decay, topk_form, topk_tile, topk_sigmas
        )
        if scales not in SCALES:
            raise ValueError(f"scales={scales!r} is not supported; choose one of {SCALES}")
        self.by_rows = scales == "rows"
        self.comm = comm
        self.bits = bits
        self.small_tensor_numel = small_tensor_numel
        self.tag = tag
        self.fused = BucketedAllReduce(comm, int(bucket_cap_mb * 2**20), keep_buffers=keep_buffers, average=average)
        self.codec = codec
        self.quantized: QuantizedAllReduce | SparseAllGather | None = None
        if codec == "statistical":
            self.quantized = StatisticalAllGather(
                comm, bits=bits, sigmas=topk_sigmas, tag=f"{tag}_statistical", decay=error_feedback_decay
            )
        elif codec == "topk" and topk_form == "published":
            self.quantized = TiledSparseAllGather(
                comm,
                tile=topk_tile,
                k=topk_per_chunk,
                bits=bits,
                sigmas=topk_sigmas,
                tag=f"{tag}_sparse",
                decay=error_feedback_decay,
            )
        elif codec == "topk":
            self.quantized = SparseAllGather(
                TopKCodec(topk_chunk, topk_per_chunk, bits), comm, tag=f"{tag}_sparse", decay=error_feedback_decay
            )
        elif bits < 32:
            line_codec = make_codec(codec, min(bits, 16), HALF_DTYPES[half_dtype])
            self.quantized = QuantizedAllReduce(line_codec, comm, tag=f"{tag}_quantized", by_rows=self.by_rows)
        if self.quantized is not None:
            self.quantized.home = residual_home

    def quantizes(self, t: Tensor) -> bool:
        """Whether ``t`` travels quantized (a matrix of more than ``small_tensor_numel`` values) or sparse
        (any tensor of more than ``small_tensor_numel`` values: top-k needs no per-line scales, so a
        long bias, such as an output layer's over the vocabulary, goes sparse too)."""
        if self.quantized is None or t.numel() <= self.small_tensor_numel:
            return False
        return t.dim() >= 2 or isinstance(self.quantized, SparseAllGather)

    def average(self, named: Mapping[str, Tensor], *, quantize: bool = True, commit: bool = True) -> list[str]:
        """Replace every tensor of ``named`` with its average over ranks (identical on every rank).

        ``quantize=False`` sends everything in fp32 (a warm start); residuals are left as they are.
        ``commit=False`` keeps the new residuals aside until :meth:`commit` (or drops them at
        :meth:`discard`): a caller that learns only after the exchange whether it counts.

        Returns the names of the tensors whose average holds an inf or a NaN (empty when all are
        finite); every rank returns the same names, since all hold the same averages. A quantized
        exchange with a non-finite result keeps its old residuals: they never take a non-finite
        value. What to do about it (raise, skip the step) is the caller's policy.
        """
        if not named:
            return []
        # on one rank the average is the tensor itself: only its finiteness to tell. Not for the published
        # sparse form (a quorum of one replica too): its top-k and error feedback do not depend on the ranks
        compresses = quantize and isinstance(self.quantized, SparseAllGather) and self.quantized.compresses_alone
        if self.comm.world_size == 1 and not compresses:
            finite = torch.stack([torch.isfinite(t).all() for t in named.values()]).tolist()
            return [n for n, ok in zip(named, finite, strict=True) if not ok]
        large = {n: t for n, t in named.items() if quantize and self.quantizes(t)}
        small = {n: t for n, t in named.items() if n not in large}
        flags: list[Tensor] = []
        if small:
            self.fused(list(small.values()), tag=self.tag, names=list(small), finite_flags=flags)
        bad: list[str] = []
        if large:
            assert self.quantized is not None
            for name, avg in self.quantized(large, commit=False).items():
                large[name].copy_(avg)
            bad += self.quantized.nonfinite
        if flags and not bool(torch.stack(flags).all()):
            bad += [n for n, t in small.items() if not bool(torch.isfinite(t).all())]
        if large and not bad and commit:  # a non-finite tensor anywhere leaves every residual as it was
            self.quantized.commit()
        elif bad and self.quantized is not None:
            self.quantized.discard()
        return bad

    def commit(self) -> None:
        """Keep the residuals of the last ``average(..., commit=False)``."""
        if self.quantized is not None:
            self.quantized.commit()

    def discard(self) -> None:
        """Drop the residuals of the last ``average(..., commit=False)``: the old ones stay."""
        if self.quantized is not None:
            self.quantized.discard()

    def rebind(self, comm: Communicator) -> None:
        """Exchange over ``comm`` from now on (another membership of the ranks). The stage-2 residuals
        belong to the stripe this rank owned among the old ranks: they restart at zero when the
        rank or the number of ranks changes; the stage-1 residuals (this rank's own error) stay."""
        old, self.comm, self.fused.comm = self.comm, comm, comm
        if self.quantized is not None:
            self.quantized.rebind(comm, keep_stripes=(old.rank, old.world_size) == (comm.rank, comm.world_size))

    # ------------------------------------------------------------------ rank-local state

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """The error-feedback residuals of both stages, per tensor name (rank-local)."""
        if self.quantized is None:
            return {"residuals": {}, "residuals2": {}}
        return self.quantized.state_dict()

    def check_state(self, state: Mapping[str, Mapping[str, Tensor]], shapes: Mapping[str, torch.Size]) -> None:
        """Raise ``ValueError`` when saved residuals do not fit tensors of ``shapes`` on this rank."""
        sparse = isinstance(self.quantized, SparseAllGather)
        if any(state.get(kind) for kind in ("residuals", "residuals2")) and (state.get("codec") == "topk") != sparse:
            saved = "sparse (codec='topk')" if state.get("codec") == "topk" else "dense (a line codec)"
            raise ValueError(f"its residuals are {saved}, this run's codec is {self.codec!r}")
        form = state.get("form", "chunks")  # saved before there were two forms: chunks
        if state.get("residuals") and sparse and form != self.quantized.form:
            raise ValueError(
                f"its sparse error feedback is of topk_form={form!r}, this run's topk_form is {self.quantized.form!r}"
            )
        for kind in ("residuals", "residuals2"):
            for name, res in state.get(kind, {}).items():
                if name not in shapes:
                    raise ValueError(f"its residual for {name!r} has no tensor of that name in the model")
                if sparse:
                    if kind == "residuals2" or tuple(res.shape) != tuple(shapes[name]):
                        raise ValueError(
                            f"its {kind} for {name!r} have shape {tuple(res.shape)}, this model's sparse error"
                            f" feedback needs {tuple(shapes[name])}"
                        )
                    continue
                lay = MatrixLayout.of(shapes[name], self.comm.world_size, self.by_rows)
                c0, c1 = lay.stripes[self.comm.rank]
                expected = (lay.cols, lay.rows) if kind == "residuals" else (c1 - c0, lay.rows)
                if tuple(res.shape) != expected:
                    raise ValueError(
                        f"its {kind} for {name!r} have shape {tuple(res.shape)}, this model needs {expected}"
                    )

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        if self.quantized is not None:
            self.quantized.load_state_dict(state)

    def reset(self) -> None:
        """Forget the residuals (they restart at zero)."""
        if self.quantized is not None:
            self.quantized.reset()


class GradientCompression:
    """How a gradient scheme averages its gradients: the codec, a full-precision warm start, and the
    :class:`TensorExchange` (with its residuals) once bound to the ranks.

    ``onebit_sgd``, ``sampled_vocab`` and ``expert_parallel`` each hold one, so any of them composes
    with any codec.

    Args:
        bits: 1, 2, 4, 8, 16 or 32 (see :class:`TensorExchange`).
        distributed_after: exchange in fp32 until this many ``distributed_after_unit`` have been
            trained (CNTK's ``distributedAfterSampleCount``), then quantize.
        distributed_after_unit: ``"samples"`` (over all ranks, CNTK's unit) or ``"steps"``.
        small_tensor_numel: tensors this small (or 1-D) always travel in fp32.
        half_dtype: the 16-bit format.
        residuals: where the error-feedback residuals wait between steps: ``"device"`` (default: where
            they are made) or ``"host"`` (pinned host memory on CUDA, each brought to the device while
            its gradient is encoded; see :class:`~lightning_commstrats.buckets.Parking`).
    """

    def __init__(
        self,
        bits: int = 32,
        distributed_after: int = 0,
        distributed_after_unit: str = "samples",
        small_tensor_numel: int = 1024,
        half_dtype: str = "float16",
        *,
        residuals: str = "device",
    ) -> None:
        check_exchange_args(bits, half_dtype, small_tensor_numel, name="num_quantization_bits")
        check_residuals(residuals)
        if isinstance(distributed_after, bool) or not isinstance(distributed_after, int) or distributed_after < 0:
            raise ValueError(f"distributed_after must be an int >= 0, got {distributed_after!r}")
        if distributed_after_unit not in WARM_START_UNITS:
            raise ValueError(
                f"distributed_after_unit={distributed_after_unit!r} is not supported; choose one of {WARM_START_UNITS}"
            )
        self.bits = bits
        self.distributed_after = distributed_after
        self.distributed_after_unit = distributed_after_unit
        self.small_tensor_numel = small_tensor_numel
        self.half_dtype = half_dtype
        self.residuals = residuals
        self.exchange: TensorExchange | None = None

    def bind(self, comm: Communicator, bucket_cap_mb: float, average: Average | None = None) -> TensorExchange:
        """The exchange over ``comm`` (made on first use; residuals start at zero); ``average``
        averages its fp32 buckets (a two-level all-reduce): every call must give the same (a restore
        that bound it without the hop would send every later fp32 bucket past it)."""
        if self.exchange is not None and average is not self.exchange.fused.average:
            raise ValueError(
                f"the exchange was bound with average={self.exchange.fused.average!r}, now with {average!r}:"
                " bind it alike everywhere"
            )
        if self.exchange is None:
            self.exchange = TensorExchange(
                comm,
                self.bits,
                half_dtype=self.half_dtype,
                small_tensor_numel=self.small_tensor_numel,
                tag="grad",
                bucket_cap_mb=bucket_cap_mb,
                average=average,
                residual_home=residual_home(self.residuals),
            )
        return self.exchange

    def quantizing(self, samples_seen: int, steps: int) -> bool:
        """Whether a step that starts after ``samples_seen`` samples (all ranks) and ``steps`` steps quantizes."""
        if self.bits == 32:
            return False
        seen = steps if self.distributed_after_unit == "steps" else samples_seen
        return seen >= self.distributed_after

    def average(self, named: Mapping[str, Tensor], *, samples_seen: int, steps: int, commit: bool = True) -> list[str]:
        """Average ``named`` gradients over the bound ranks in place (fp32 during the warm start);
        returns the names whose average is not finite (see :meth:`TensorExchange.average`).
        ``commit=False``: the new residuals wait for the exchange's ``commit()`` or ``discard()``."""
        assert self.exchange is not None, "bind() first"
        return self.exchange.average(named, quantize=self.quantizing(samples_seen, steps), commit=commit)

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        return self.exchange.state_dict() if self.exchange is not None else {"residuals": {}, "residuals2": {}}


def check_codec_settings(
    codec: str,
    bits: int,
    topk_chunk: int,
    topk_per_chunk: int,
    error_feedback_decay: float,
    topk_form: str,
    topk_tile: int,
    topk_sigmas: float,
    *,
    codec_name: str = "codec",
    bits_name: str = "bits",
) -> None:
    """Raise ``ValueError`` unless the codec and its top-k settings go together (the codec and its
    bits, the tiles' form, the chunks and error feedback of a sparse codec); ``codec_name`` and
    ``bits_name`` are the caller's argument names (the periodic schemes' ``pseudo_grad_*``)."""
    check_codec(codec, bits, name=codec_name, bits_name=bits_name)
    check_tiles_args(
        codec,
        topk_form,
        topk_tile,
        topk_per_chunk,
        topk_sigmas,
        names=(codec_name, "topk_form", "topk_tile", "topk_per_chunk", "topk_sigmas"),
    )
    check_sparse_args(
        codec,
        topk_tile * topk_tile if topk_form == "published" else topk_chunk,
        topk_per_chunk,
        bits,
        error_feedback_decay,
        names=(codec_name, "topk_chunk", "topk_per_chunk", bits_name, "error_feedback_decay"),
    )


def check_exchange_args(bits: int, half_dtype: str, small_tensor_numel: int, name: str = "bits") -> None:
    """Construction-time checks of the exchange's arguments; ``name`` is the caller's argument name."""
    if isinstance(bits, bool) or bits not in EXCHANGE_BITS:
        raise ValueError(f"{name}={bits!r} is not supported; choose one of {EXCHANGE_BITS}")
    if half_dtype not in HALF_DTYPES:
        raise ValueError(f"half_dtype={half_dtype!r} is not supported; choose one of {tuple(HALF_DTYPES)}")
    if isinstance(small_tensor_numel, bool) or not isinstance(small_tensor_numel, int) or small_tensor_numel < 0:
        raise ValueError(f"small_tensor_numel must be an int >= 0, got {small_tensor_numel!r}")
