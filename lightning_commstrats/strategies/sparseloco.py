"""``sparseloco``: DiLoCo's local steps, a sparse 2-bit pseudo-gradient, error feedback in place of outer
momentum (Sarfi et al. 2025)."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression.density import DensitySchedule, check_schedule
from lightning_commstrats.compression.exchange import TensorExchange
from lightning_commstrats.compression.sparse_tiles import TOPK_FORMS, TiledSparseAllGather, thin_tiles
from lightning_commstrats.sharding import local
from lightning_commstrats.strategies.periodic import PeriodicSyncStrategy, refuse_outer_arguments
from lightning_commstrats.strategies.streaming_diloco import default_delay


class SparseLoCoStrategy(PeriodicSyncStrategy):
    """SparseLoCo: every ``sync_period`` inner steps, each rank sends the top-k values of every chunk of its
    error-feedback buffer in 2 bits, and the global model takes a plain step on their average.

    Stores what ``diloco`` stores, with the error-feedback buffer of each rank (the tensors' shapes,
    rank-local, checkpointed) in place of the quantization residuals; the outer SGD has no momentum.

    The algorithm (per synced tensor, per rank ``r``; ``G_r = w - w_local_r`` after the block):

    1. ``e_r = beta * e_r + G_r`` (``beta = error_feedback_decay``, 0.95);
    2. per chunk of ``topk_chunk`` values (4096), the ``topk_per_chunk`` (64) of largest magnitude in
       ``e_r`` are kept, each quantized to ``pseudo_grad_bits`` (2: its sign, and whether its
       magnitude is in the upper half of the chunk's kept range, rebuilt at that half's centre;
       two float32 scales per chunk) and sent with its position (Elias-Fano coded: 8 bits for 64 in
       a chunk of 4096);
       ``e_r`` loses what was sent: ``e_r -= s_r``;
    3. every rank's payload is all-gathered; each rank rebuilds and sums them in rank order, the
       same everywhere: ``G = mean_r s_r``;
    4. the outer step is plain SGD, ``w = w - outer_lr * G`` (no momentum: the decayed error
       feedback accumulates what momentum would, rank by rank), and every rank restarts from ``w``.

    Overlapped by default: the exchange runs in a background thread while the next block trains
    (``fragment_sync_delay=1``), and lands one inner step later on top of that step's progress
    (``keep_local_progress=True``: the rank's weights become ``w`` plus the step taken meanwhile, so
    no local step is discarded). A sparse payload is a few hundred kilobytes even for a model of
    millions of weights: one step hides it on links of a few Mbit/s, and the outer step it delays
    is one inner step stale. ``fragment_sync_delay=0`` blocks instead (SparseLoCo as the paper runs it).

    Tensors of at most ``small_tensor_numel`` values (1024: biases, norms) are averaged densely in
    fp32; a longer 1-D tensor (an output layer's bias over the vocabulary) goes sparse like a matrix.

    Two forms (``topk_form``):

    - ``"chunks"`` (default; this package's form, described above): chunks of ``topk_chunk``
      consecutive values, sign-and-magnitude codes with two scales per chunk, small tensors dense in
      fp32 without error feedback; on one rank (or a quorum of one replica) nothing is sent and the
      pseudo-gradient is applied whole, without top-k or error feedback.
    - ``"published"``: SparseLoCo as the paper and Covenant's public code run it
      (:mod:`lightning_commstrats.compression.sparse_tiles`). A matrix is cut in 2-D tiles of up to
      ``topk_tile x topk_tile`` (64 x 64) values, a vector in runs of up to ``topk_tile``; the
      ``topk_per_chunk`` (64) largest magnitudes of each tile are kept (every value of a tile of at
      most that many: biases travel whole, in 2 bits); the kept values of a tensor are quantized on a
      statistical grid (``2^bits`` bins over ``topk_sigmas`` = 6 standard deviations around their
      mean, each bin decoded as the mean of its values: a lookup of ``2^bits`` float32 per tensor on
      the wire); every tensor has its error feedback (``small_tensor_numel`` defaults to 0), and the
      same top-k and error feedback run whatever the number of replicas. Tiles always divide their
      tensor: a tile's side is the largest divisor of that dimension not above ``topk_tile`` (the
      public code's rule; a 10000 x 256 embedding gets tiles of 50 x 64, keeping 64 of 3200 values). A
      dimension with no divisor near ``topk_tile`` gets thin tiles that keep more of their values
      (a prime dimension: tiles one row high); the strategy warns at setup about every tensor whose
      tiles keep more than twice the density of a full tile. Bytes per rank and sync: 80 per 64 x 64
      tile at 2 bits (64 of positions, 16 of codes) and 16 per tensor, all-gathered as above.

    The default stays ``"chunks"``: on the recipe's short runs neither form at the paper's density
    ends better than the ranks training alone (issue #36 measured ``"chunks"`` at perplexity 252.7
    and an independent implementation of the published form at 300.7 against 165.1 alone, 4 ranks,
    192 steps), so switching would not make the default safe, and it would change what every
    existing configuration trains (a checkpoint's error feedback names its form and is refused by
    the other). Nor would a density schedule on by default: measured here
    (``benchmarks/results/sparseloco/``: the recipe's LSTM with AdamW, 2 ranks, 192 steps,
    ``sync_period=16``, seeds 0 and 1) ``"chunks"`` ends at 249.2 and 251.0, ``"published"`` at 235.2
    and 242.0, ``"published"`` with ``topk_schedule="run"`` at 219.9 and 222.2, each rank alone at
    212.5 and 199.7, fp32 ``diloco`` at 181.3 and 180.1, and the dense statistical codec
    (``DiLoCoStrategy(pseudo_grad_codec="statistical")``, 2 bits, error feedback 0.95, outer lr 1) at
    185.9 and 184.3; at about 2,650x, 2,650x, 1,010x, 16x and 250x fewer bytes than fp32 DDP. With 12
    syncs only a dense exchange beat the ranks alone; the strategy warns instead (see below). At 576
    steps (36 syncs, seeds 0 and 1) the schedule ends at 155.3 and 155.9, the ranks alone at 158.8
    and 156.5, ``"published"`` without a schedule at 160.0 and 160.4, the dense codec at 146.2 and
    145.6, fp32 ``diloco`` at 131.3 and 130.1.

    Bytes: one payload per rank and sync is ``C * (8 + (k * (l + bits) + k + (chunk >> l)) / 8)``
    bytes for ``C`` chunks, ``l = floor(log2(chunk / k))`` (8 bytes of scales, the Elias-Fano
    positions, the codes; 88 bytes per chunk at the defaults); a ring all-gather makes each rank
    send ``N - 1`` of them. At the defaults that is ``(N - 1) * 88 / 4096`` bytes per synced value,
    against ``2 (N - 1) / N * 4`` for an fp32 all-reduce: at ``N = 4`` and ``H = 32``, about 3,000
    times fewer bytes per step than fp32 DDP (the dense small tensors add a little). The all-gather
    grows with ``N``; the payload does not.

    Short runs and the density schedule (``topk_schedule``, published form): sparse error feedback
    needs many syncs to pay off. Keeping ``k`` of ``n`` values per tile, a value waits about ``n / k``
    syncs for its turn (64 at the defaults), so a run with fewer syncs than that leaves most of its
    progress in the buffers: issue #36 measured the defaults on the recipe's LSTM (4 ranks, 192 steps,
    ``sync_period=16``: 12 syncs) at perplexity 262.7, worse than each rank training alone (165.1). At
    its first batch the strategy warns when the fit has fewer syncs than ``n / k`` (without a
    schedule), naming them. ``topk_schedule`` keeps more values at the first syncs:

    - ``"geometric"``: every value of a tile at the first sync (in ``pseudo_grad_bits`` bits, no
      positions), then a quarter as many at each sync (4096, 1024, 256, then ``topk_per_chunk``);
    - ``"run"``: the same steps, each held longer on a longer run, so that the denser steps take the
      first quarter of the syncs the fit will have (``trainer.estimated_stepping_batches /
      sync_period``, read at the fit's first batch; 12 syncs: as ``"geometric"``; 1200: 100 syncs each);
    - a list ``[k_0, k_1, ...]``: ``k_p`` values per tile at sync ``p`` (0: the first), then
      ``topk_per_chunk``.

    The place in the schedule is the count of syncs each fragment has launched (sync ``p``: the
    ``p``-th launch, whatever the period's unit: a period in samples that batches do not divide
    lands between steps, so the progress is no measure of it). Every rank launches the same syncs,
    checkpoints hold the count and a healing replica takes its source's, so a resumed run, and every
    rank, keep the same count at a sync: the payloads of a sync have one size on every rank (a plain
    all-gather); each sync is charged the bytes it sent. How to tune for a run of ``S`` syncs:
    with ``S`` well above ``n / k`` the paper's density needs no schedule; below it, use
    ``topk_schedule="run"``, or a constant ``topk_per_chunk`` near ``n / S`` or above, or a shorter
    ``sync_period``; if the loss still jumps at syncs, lower ``outer_lr``. A dense exchange in 2 bits
    (``DiLoCoStrategy(pseudo_grad_codec="statistical", error_feedback_decay=0.95, outer_lr=1,
    outer_momentum=0)``) is the same error feedback with every value sent.

    Hyperparameters:

    - ``topk_per_chunk / topk_chunk`` (density, 1.6%; ``topk_per_chunk / topk_tile^2`` in the
      published form): the paper found 1-3% best; denser sends more and tracks DiLoCo; sparser
      leaves more in ``e`` and reacts late. Keep ``topk_chunk / topk_per_chunk`` a power of two (the
      positions' low bits fill their range) and ``topk_chunk`` large enough that a chunk spans
      several rows.
    - ``error_feedback_decay`` (``beta``, 0.95): 1 keeps every unsent value until it is sent (plain
      error feedback), lower values forget stale directions; the paper tuned 0.95 for ``H`` in the
      tens, together with ``outer_lr``.
    - ``outer_lr`` (1.0): the paper's plain average; lower it if the loss jumps at syncs.
    - ``pseudo_grad_bits`` (2): 4 or 8 rebuild the kept values more finely for 2x or 4x the value
      bytes (positions are most of the payload at 2 bits: 4 bits cost 18% more bytes); 32 sends
      them as float32.
    - ``sync_period`` (``H``, default 30 as Covenant-72B): as for DiLoCo; sparse payloads are so
      small that ``H`` can be chosen for quality, not for bandwidth.
    - ``fragment_sync_delay`` (1) and ``keep_local_progress`` (True): how many inner steps the
      exchange overlaps, and whether the steps taken meanwhile are kept (see above). Raise the delay
      when the link is so slow that one step does not cover the all-gather (the comm statistics'
      wait time says so).
    - ``num_fragments``: stream the sync in fragments (as ``streaming_diloco``), so that one
      fragment's encode and all-gather run behind training at a time.

    Reference: A. Sarfi, B. Thérien, J. Lidin, E. Belilovsky, "Communication Efficient LLM
    Pre-training with SparseLoCo", 2025. The paper quantizes the kept values on a statistical
    (``mean +- k std``) grid and sends positions as integers; the sign-and-magnitude code and the
    Elias-Fano positions here are this package's.

    Args:
        sync_period: inner steps between syncs (default 30).
        outer_lr: the outer SGD's learning rate (default 1.0; no momentum).
        pseudo_grad_bits: 2 (default), 4, 8 or 32 bits per kept value.
        topk_chunk: values per chunk (default ``None``: 4096) with ``topk_form="chunks"``; refused with
            ``"published"``.
        topk_per_chunk: values kept per chunk, or per tile with ``topk_form="published"`` (default 64).
        error_feedback_decay: ``beta`` (default 0.95).
        fragment_sync_delay: inner steps the exchange overlaps (default ``None``: 1, or 0 when the
            schedule allows none).
        keep_local_progress: keep the steps taken while the exchange is in flight (default True).
        num_fragments: fragments synced in turn (default 1: the whole model at once).
        sync_period_unit: ``"steps"`` (default) or ``"samples"`` (per worker; one fragment, no delay).
        pseudo_grad_codec: ``"topk"`` only (any other is refused: use ``DiLoCoStrategy``).
        topk_form: ``"chunks"`` (default) or ``"published"`` (see above).
        topk_tile: with ``topk_form="published"``, the largest side of a tile (default ``None``: 64);
            refused with ``"chunks"``.
        topk_sigmas: with ``topk_form="published"``, the quantizer's width in standard deviations
            (default ``None``: 6); refused with ``"chunks"``.
        topk_schedule: with ``topk_form="published"``, values kept per tile at the first syncs:
            ``None`` (default: ``topk_per_chunk`` at every sync), ``"geometric"``, ``"run"`` or a list
            of ints in ``[1, topk_tile^2]`` (see above).
        small_tensor_numel: tensors of at most this many values go dense in fp32 without error
            feedback (default ``None``: 1024 with ``"chunks"``, 0 with ``"published"``).
        **kwargs: :class:`PeriodicSyncStrategy` / :class:`~lightning_commstrats.strategies.base.CommStrategy`
            arguments (``num_fragments``, ``fragment_sync_delay``, ``small_tensor_numel``, ``backend``,
            ``fault_tolerance``...).

    Example::

        strategy = lightning_commstrats.SparseLoCoStrategy(sync_period=32)
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy)
        published = lightning_commstrats.SparseLoCoStrategy(sync_period=30, topk_form="published")
    """

    strategy_name = "sparseloco"

    def __init__(
        self,
        sync_period: int = 30,
        outer_lr: float = 1.0,
        pseudo_grad_bits: int = 2,
        topk_chunk: int | None = None,
        topk_per_chunk: int = 64,
        error_feedback_decay: float = 0.95,
        num_fragments: int = 1,
        fragment_sync_delay: int | None = None,
        keep_local_progress: bool = True,
        sync_period_unit: str = "steps",
        pseudo_grad_codec: str = "topk",
        topk_form: str = "chunks",
        topk_tile: int | None = None,
        topk_sigmas: float | None = None,
        small_tensor_numel: int | None = None,
        topk_schedule: str | list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if topk_form not in TOPK_FORMS:
            raise ValueError(f"topk_form={topk_form!r} is not supported; choose one of {TOPK_FORMS}")
        published = topk_form == "published"
        if topk_schedule is not None and not published:
            raise ValueError(
                f"topk_schedule={topk_schedule!r} applies to topk_form='published' (values kept per tile),"
                f" not to topk_form={topk_form!r}"
            )
        # each form's own settings: one given to the other form is refused rather than ignored
        given = {"topk_chunk": topk_chunk} if published else {"topk_tile": topk_tile, "topk_sigmas": topk_sigmas}
        for name, value in given.items():
            if value is not None:
                owner = "chunks" if published else "published"
                raise ValueError(
                    f"{name}={value!r} applies to topk_form={owner!r}, not to topk_form={topk_form!r}"
                    f"{' (its tiles are set by topk_tile)' if published else ''}"
                )
        topk_tile = 64 if topk_tile is None else topk_tile
        topk_sigmas = 6.0 if topk_sigmas is None else topk_sigmas
        if topk_chunk is None:
            topk_chunk = topk_tile * topk_tile if published and isinstance(topk_tile, int) else 4096
        if small_tensor_numel is None:  # the published form sends every tensor sparse, with its error feedback
            small_tensor_numel = 0 if published else 1024
        if pseudo_grad_codec != "topk":
            raise ValueError(
                f"SparseLoCoStrategy sends top-k values (pseudo_grad_codec='topk'), got"
                f" pseudo_grad_codec={pseudo_grad_codec!r}; use DiLoCoStrategy for the dense codecs"
            )
        # a CLI passes every argument of the base, unset ones as None: only a value given is refused
        refuse_outer_arguments(
            {k: v for k, v in kwargs.items() if v is not None},
            "SparseLoCoStrategy",
            "outer_lr; the error feedback takes the place of outer momentum",
        )
        kwargs = {
            k: v for k, v in kwargs.items() if k not in ("outer_optimizer", "outer_momentum", "outer_optimizer_kwargs")
        }
        if fragment_sync_delay is None:  # a delay counts steps: none for a schedule in samples
            in_steps = sync_period_unit == "steps"
            fragment_sync_delay = default_delay(sync_period, num_fragments, most=1) if in_steps else 0
        super().__init__(
            sync_period=sync_period,
            sync_period_unit=sync_period_unit,
            outer_optimizer="torch.optim.SGD",
            outer_lr=outer_lr,
            outer_momentum=0.0,
            pseudo_grad_bits=pseudo_grad_bits,
            pseudo_grad_codec="topk",
            topk_chunk=topk_chunk,
            topk_per_chunk=topk_per_chunk,
            error_feedback_decay=error_feedback_decay,
            topk_form=topk_form,
            topk_tile=topk_tile,
            topk_sigmas=topk_sigmas,
            small_tensor_numel=small_tensor_numel,
            num_fragments=num_fragments,
            fragment_sync_delay=fragment_sync_delay,
            keep_local_progress=keep_local_progress,
            **kwargs,
        )
        if published:  # the tile's checks first (an int tile), then the schedule's against it
            check_schedule(topk_schedule, topk_per_chunk, topk_tile * topk_tile)
        self.topk_schedule = topk_schedule
        self.density = DensitySchedule(topk_schedule, topk_per_chunk, topk_tile * topk_tile) if published else None
        self.run_syncs: int | None = None  # the syncs this fit will have, known at its first batch
        self.kept_now = topk_per_chunk  # values kept per tile at the sync being launched
        # syncs launched per fragment: the place in the density schedule (shared state: in checkpoints
        # and in the state a healing replica receives)
        self.density_syncs = [0] * num_fragments

    def sync_index(self, fragment: int = 0) -> int:
        """Which sync of ``fragment`` the one due now is (0: the first): the count of its syncs
        launched so far, which every rank keeps alike, checkpoints hold and healing replicas receive."""
        return self.density_syncs[fragment]

    def _progress_counts(self) -> list[int]:
        """The syncs each fragment launched by now, as a checkpoint without the count implies them (exact
        for a period in steps: fragment ``k`` first syncs ``(k + 1) H / F`` units in, then every ``H``)."""
        done, h, f = self._progress() - self.parallelization_start, self.sync_period, self.num_fragments
        return [max(0, (done - (k + 1) * h // f) // h + 1) if done >= (k + 1) * h // f else 0 for k in range(f)]

    def _set_kept_for(self, index: int) -> None:
        """The values kept per tile at sync ``index`` of the schedule, set on the exchange."""
        if self.density is not None:  # set in this thread, before the exchange's thread reads it
            self.kept_now = self.density.kept(index, self.run_syncs)
            self._set_kept(self._exchange)

    def _set_kept(self, exchange: TensorExchange | None) -> None:
        if exchange is not None and isinstance(exchange.quantized, TiledSparseAllGather):
            exchange.quantized.k = self.kept_now

    @override
    def _make_exchange(self, comm: Communicator) -> TensorExchange:
        exchange = super()._make_exchange(comm)
        self._set_kept(exchange)
        return exchange

    @override
    def _launch(self, fragment: int, background: bool) -> None:
        self._set_kept_for(self.sync_index(fragment))
        # counted before the launch: the state offered to a replica that heals inside this sync holds it
        self.density_syncs[fragment] += 1
        super()._launch(fragment, background)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "density_syncs": list(self.density_syncs)}

    @override
    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        super().load_state_dict(state, rank_state)
        saved = state.get("density_syncs")
        if saved is not None and len(saved) != self.num_fragments:
            raise ValueError(f"it counts the syncs of {len(saved)} fragments and this run has {self.num_fragments}")
        self.density_syncs = [int(n) for n in saved] if saved is not None else self._progress_counts()

    @override
    def replica_state(self, pending: Any | None) -> dict[str, Any]:
        return {**super().replica_state(pending), "density_syncs": list(self.density_syncs)}

    @override
    def adopt(self, state: dict[str, Any]) -> None:
        super().adopt(state)
        if state.get("density_syncs") is not None:
            self.density_syncs = [int(n) for n in state["density_syncs"]]

    @override
    def join_sync(self, state: dict[str, Any]) -> Any:
        pending = super().join_sync(state)
        # the sync it joins keeps what its peers' launch kept (their count includes that launch)
        self._set_kept_for(max(self.density_syncs[pending.fragment] - 1, 0))
        return pending

    @override
    def reset_state(self) -> None:
        super().reset_state()
        self.density_syncs = [0] * self.num_fragments

    @override
    def warn_if_no_sync(self, batch_size: int) -> int | None:
        first = super().warn_if_no_sync(batch_size)
        trainer = self.trainer
        total = getattr(trainer, "estimated_stepping_batches", None) if trainer is not None else None
        if not isinstance(total, (int, float)) or not math.isfinite(total) or total <= 0:
            return first
        per_step = batch_size * getattr(trainer, "accumulate_grad_batches", 1) if self.schedule_counts_samples() else 1
        self.run_syncs = max(0, int(total) * per_step - self.parallelization_start) // self.sync_period
        published = self.topk_form == "published"
        full = self.topk_tile * self.topk_tile if published else self.topk_chunk
        needed = math.ceil(full / self.topk_per_chunk)
        if first is None and self.topk_schedule is None and self.run_syncs < needed:
            unit = "tile" if published else "chunk"
            rank_zero_warn(
                f"{type(self).__name__}: this fit will have {self.run_syncs} syncs ({int(total)} optimizer steps,"
                f" sync_period={self.sync_period} {self.sync_period_unit}); keeping {self.topk_per_chunk} of"
                f" {full} values per {unit}, the error feedback needs about {needed} syncs to send each value"
                " once, and a shorter run leaves most of its progress unsent (it can end worse than the ranks"
                " training alone). Pass topk_form='published' with topk_schedule='run' (dense first syncs,"
                " sparser later), or keep more per chunk (topk_per_chunk), or sync more often (sync_period)."
            )
        return first

    @override
    def setup_scheme(self) -> None:
        super().setup_scheme()
        if self.topk_form == "published":
            shapes = {
                self.param_name(p): local(p).shape for p in self.params if local(p).numel() > self.small_tensor_numel
            }
            lines = thin_tiles(shapes, self.topk_tile, self.topk_per_chunk)
            if lines:
                rank_zero_warn(
                    f"SparseLoCoStrategy(topk_form='published', topk_tile={self.topk_tile}): tiles divide their"
                    " tensor (a side is the largest divisor of its dimension not above topk_tile), so these"
                    " tensors send denser than the rest: " + "; ".join(lines)
                )
