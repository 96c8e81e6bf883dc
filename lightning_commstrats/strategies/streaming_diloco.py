"""``streaming_diloco``: DiLoCo with the model synced in fragments, each exchange overlapped with inner steps
(Douillard et al. 2025)."""

from __future__ import annotations

from typing import Any

from lightning_commstrats.strategies.diloco import DiLoCoStrategy
from lightning_commstrats.strategies.periodic_settings import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM


class StreamingDiLoCoStrategy(DiLoCoStrategy):
    """Streaming DiLoCo: fragments of the model take turns to sync, each exchange hidden behind compute.

    Stores what ``diloco`` stores, per fragment (global copy, outer momentum, block start), plus an
    exchange in flight (its averaged pseudo-gradient and the step it lands at): a checkpoint taken
    while a fragment is on the wire resumes exactly.

    The algorithm:

    1. the parameters are cut into ``num_fragments`` fragments (contiguous in registration order,
       about equal in size, so a fragment is a few consecutive layers);
    2. fragment ``f`` syncs every ``sync_period`` inner steps, at offset ``(f + 1) H / F``: the
       fragments take turns, one every ``H / F`` steps;
    3. at its turn, the fragment's pseudo-gradient ``G_f = w_f - w_local_f`` starts its exchange in
       a background thread, on a communication channel of its own (a second gloo/NCCL process group
       or a duplicated MPI communicator), quantized to ``pseudo_grad_bits`` (``pseudo_grad_codec``)
       with error feedback, while the inner optimizer keeps training;
    4. ``fragment_sync_delay`` (``tau``) steps later the averaged ``G_f`` is waited for, the outer
       optimizer steps ``w_f``, and the local fragment becomes
       ``alpha * w_local_f + (1 - alpha) * w_f`` (``fragment_update_alpha``).

    Bytes per step equal ``diloco``'s at the same period and bits, but the peak is one fragment
    (``1/F`` of the model) in flight at a time, and the exchange overlaps ``tau`` inner steps.

    Hyperparameters:

    - ``num_fragments`` (``F``): more fragments lower the peak bandwidth and the bytes in flight;
      each fragment is still synced every ``H`` steps. The paper found quality flat in ``F``.
    - ``fragment_sync_delay`` (``tau``): how many inner steps the exchange has to complete. It must
      cover the exchange's wire time (fragment bytes / link rate) to hide it fully; larger ``tau``
      means the update lands on weights that moved on (the paper: up to 5 steps at ``H=100`` cost
      little). Must be < ``H / F``, so one fragment at most is in flight.
    - ``fragment_update_alpha``: 0 (default) replaces the local fragment by the global one and
      loses the ``tau`` local steps on that fragment; the paper's 0.5 keeps half of them;
      ``keep_local_progress=True`` (with alpha 0) keeps all of them, applied on top of the new
      global fragment.
    - ``pseudo_grad_bits`` and ``pseudo_grad_codec``: 4 bits by default, as the paper, but by
      default not the paper's codec: ``"uniform"`` sends 16 evenly spaced levels between two
      float32 scales per row (``lo``, ``hi`` = the row's ``mean +- 2.7 std`` clipped to its
      ``[min, max]``; a value is sent as its bin, rebuilt as the bin's centre). The paper sends
      E3M0, a 4-bit float (1 sign, 3 exponent, 0 mantissa bits): ``pseudo_grad_codec="e3m0"``, here
      ``+-scale * 2^e`` for ``e`` in -6..0 and zero on one float32 scale per row (its largest
      magnitude; the paper does not say how it scales). ``benchmarks/results/codec_quality/``
      compares the two. 8 or 2 bits also work (uniform only).
    - ``sync_period``, ``outer_lr``, ``outer_momentum``, ``outer_optimizer``: as ``diloco`` (0.7 and
      0.5 by default, each fragment's outer step as DiLoCo's; the paper's outer momentum is 0.9).

    The phase: a fragment's exchange starts at its turn (when its block of ``H`` inner steps ends)
    and lands ``tau`` steps later. torchft starts it ``tau`` steps before the turn and lands it at
    the turn; the two are the same algorithm shifted by ``tau`` steps (this strategy's weights equal
    torchft's bit for bit once torchft's fragment counter is shifted by the delay). This package
    starts at the turn on purpose: the turn is then when the block ends whatever ``tau`` is, so
    changing the delay moves only when a result lands, never which steps a pseudo-gradient covers,
    and with ``keep_local_progress=True`` every block holds exactly ``H`` steps of every rank's
    progress. ``benchmarks/compare.py`` runs both at 32 bits side by side to measure what the shift
    costs at equal samples.

    The end of fit: the exchange in flight lands (its outer step), then each other fragment's progress
    since its turn (its part block, averaged over the ranks) is added to the global model as it is,
    without an outer step, and every rank ends with that model. The fragment in flight lands as at any
    landing: with ``fragment_update_alpha=0`` and without ``keep_local_progress`` the local steps taken
    on it since its launch (at most ``fragment_sync_delay``) are replaced by the landed global
    fragment and are not merged (``tests/multiprocess/test_reference_ranks.py`` measures them against the
    reference); ``keep_local_progress=True`` keeps them. An outer step there would add the outer
    momentum's extrapolation once more with no training after it (measured: 149.4 perplexity on the
    Brown LSTM where the landed global model had 148.6, the merge 147.4).

    The schedule counts optimizer steps (``sync_period_unit="steps"``). Fragments are contiguous
    runs of parameters; the paper's strided assignment (layer ``i`` to fragment ``i mod F``) is
    not offered.

    Reference: A. Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
    Distributed Free Lunch", 2025.

    Args:
        sync_period: inner steps between two syncs of the same fragment (default 100).
        num_fragments: fragments of the model (default 4; at most the number of parameter tensors).
        fragment_sync_delay: inner steps an exchange overlaps (0 blocks). Default ``None``: 5, or
            less when the schedule allows less (the largest delay below ``sync_period /
            num_fragments``, so that one fragment at most is in flight).
        fragment_update_alpha: mixing weight of the local fragment, in [0, 1] (default 0).
        pseudo_grad_bits: 32, 16, 8, 4 (default) or 2.
        pseudo_grad_codec: ``"uniform"`` (default) or ``"e3m0"`` (the paper's, with ``pseudo_grad_bits=4``).
        outer_optimizer, outer_lr, outer_momentum, outer_optimizer_kwargs, parallelization_start, reset_sgd_momentum:
            as :class:`DiLoCoStrategy`.
        **kwargs: :class:`~lightning_commstrats.strategies.base.CommStrategy` arguments.

    Example::

        strategy = lightning_commstrats.StreamingDiLoCoStrategy(sync_period=32, num_fragments=4, fragment_sync_delay=2)
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy)
    """

    strategy_name = "streaming_diloco"

    def __init__(
        self,
        sync_period: int = 100,
        num_fragments: int = 4,
        fragment_sync_delay: int | None = None,
        fragment_update_alpha: float = 0.0,
        pseudo_grad_bits: int = 4,
        pseudo_grad_codec: str = "uniform",
        outer_optimizer: Any = None,
        outer_lr: float = DILOCO_OUTER_LR,
        outer_momentum: float = DILOCO_OUTER_MOMENTUM,
        outer_optimizer_kwargs: dict[str, Any] | None = None,
        parallelization_start: int = 0,
        reset_sgd_momentum: bool = False,
        **kwargs: Any,
    ) -> None:
        unit = kwargs.pop("sync_period_unit", "steps")
        if unit != "steps":
            raise ValueError(f"streaming_diloco counts optimizer steps; sync_period_unit={unit!r} is not allowed")
        if fragment_sync_delay is None:
            fragment_sync_delay = default_delay(sync_period, num_fragments)
        super().__init__(
            sync_period=sync_period,
            sync_period_unit="steps",
            outer_optimizer=outer_optimizer,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            outer_optimizer_kwargs=outer_optimizer_kwargs,
            pseudo_grad_bits=pseudo_grad_bits,
            pseudo_grad_codec=pseudo_grad_codec,
            parallelization_start=parallelization_start,
            reset_sgd_momentum=reset_sgd_momentum,
            num_fragments=num_fragments,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            **kwargs,
        )


def default_delay(sync_period: Any, num_fragments: Any, most: int = 5) -> int:
    """``most`` steps, or the largest delay the schedule allows (below ``sync_period /
    num_fragments``); bad values are left for the base's checks (0 here)."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (sync_period, num_fragments))
    if not ints:
        return 0
    return max(min(most, -(-sync_period // num_fragments) - 1), 0)
