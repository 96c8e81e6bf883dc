"""What ``commstrats-advise`` says first: the answer in one line (:func:`answer_line`), the best few in a
short table (:func:`short_table`), and when nothing fits, what would (:func:`what_would_fit`).

Every figure about a candidate is read from one layout of it, a :class:`Row`: the unsharded one (every
rank holds the whole model), or with ``shard`` the sharded one (FSDP2 inside groups, the scheme between
them). A recommendation's step time, bytes, peak and note (its stall, when the exchange is not all
hidden) all come from the same row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_commstrats.advisor.grid import departure, readable, recommend
from lightning_commstrats.advisor.memory import Memory
from lightning_commstrats.advisor.names import SCHEMES, STRATEGY_CLASSES
from lightning_commstrats.advisor.peak import Peak
from lightning_commstrats.advisor.predict import Candidate

STALL = re.compile(r"not all hidden: ([0-9.e+-]+) s of stall a period")
DEFAULT_ROWS = 8


@dataclass(frozen=True)
class Row:
    """One candidate in one layout, with every figure the command prints about it from that layout alone.

    Attributes:
        candidate: the prediction.
        sharded: the sharded layout (``shard="fsdp"``, ``Candidate.sharded``) rather than every rank whole.
    """

    candidate: Candidate
    sharded: bool = False

    def __post_init__(self) -> None:
        if self.sharded and self.candidate.sharded is None:
            raise ValueError(f"{self.candidate.label} has no sharded layout (it does not run sharded, or no shard)")

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def group(self) -> int | None:
        """The ranks of a group in the sharded layout (``None`` unsharded)."""
        return self.candidate.sharded.group if self.sharded and self.candidate.sharded else None

    @property
    def step_seconds(self) -> float:
        """Predicted seconds per optimizer step in this layout."""
        s = self.candidate.sharded
        return s.step_seconds if self.sharded and s else self.candidate.step_seconds

    @property
    def exchange_seconds(self) -> float:
        """The scheme's exchange on the wire per step: between the groups sharded, over every rank unsharded."""
        s = self.candidate.sharded
        return s.between_seconds if self.sharded and s else self.candidate.comm_seconds

    @property
    def exchange_bytes(self) -> float:
        """Bytes a rank sends in the scheme's exchange per step (between the groups, sharded)."""
        s = self.candidate.sharded
        return s.between_bytes if self.sharded and s else self.candidate.bytes_per_step

    @property
    def inside_seconds(self) -> float:
        """FSDP2's traffic inside the group per step (0 unsharded)."""
        s = self.candidate.sharded
        return s.inside_seconds if self.sharded and s else 0.0

    @property
    def note(self) -> str:
        """What to know before picking it, its stall this layout's."""
        s = self.candidate.sharded
        return s.note if self.sharded and s else self.candidate.note

    @property
    def stall_per_period(self) -> float:
        """Seconds of a periodic exchange's stall a period in this layout (0 when all hidden), as the note says."""
        found = STALL.search(self.note)
        return float(found.group(1)) if found else 0.0

    @property
    def memory(self) -> Memory | None:
        return self.candidate.sharded_memory if self.sharded else self.candidate.memory

    @property
    def peak(self) -> int | None:
        return self.candidate.sharded_peak if self.sharded else self.candidate.peak

    @property
    def peak_parts(self) -> Peak | None:
        return self.candidate.sharded_peak_parts if self.sharded else self.candidate.peak_parts

    @property
    def device_memory(self) -> int | None:
        return self.candidate.device_memory

    def over(self) -> int | None:
        return self.candidate.over(self.sharded)

    def fits(self) -> bool | None:
        return self.candidate.fits(self.sharded)


def rows(candidates: Sequence[Candidate], sharded: bool) -> list[Row]:
    """Each candidate's row in one layout (sharded: those that run sharded)."""
    return [Row(c, sharded) for c in candidates if not sharded or c.sharded is not None]


@dataclass(frozen=True)
class Extras:
    """What a run needs besides the strategy's own settings, for :func:`strategy_call`.

    Attributes:
        checkpointing: every block's activations recomputed in backward.
        bf16_gathers: FSDP2's units gathered in bf16 (``LayeredMixedPrecision``), float32 masters.
    """

    checkpointing: bool = False
    bf16_gathers: bool = False


def _literal(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def strategy_call(row: Row, extras: Extras | None = None) -> str:
    """The Trainer arguments that run ``row``: ``strategy=DiLoCoStrategy(sync_period=8, ..., shard="fsdp",
    group_size=4)``, with the plugins and settings ``extras`` need."""
    extras = extras or Extras()
    c = row.candidate
    args = [f"{k}={_literal(v)}" for k, v in c.settings.items()]
    if row.sharded:
        args += ['shard="fsdp"', f"group_size={row.group}"]
        if extras.checkpointing:
            args.append('shard_policy={"activation_checkpointing": True}')
    text = f"strategy={STRATEGY_CLASSES[c.scheme]}({', '.join(args)})"
    if extras.bf16_gathers:
        text += ", plugins=[LayeredMixedPrecision()]"
    if extras.checkpointing and not row.sharded:
        text += " with torch.utils.checkpoint on every block"
    return text


def figures(row: Row) -> str:
    """``31.8 MB a rank per step between groups · predicted 0.676 s/step · peak 7.27 GiB of 8 GiB a rank``."""
    where = "between groups" if row.sharded else "over every rank"
    text = f"{row.exchange_bytes / 1e6:.3g} MB a rank per step {where} · predicted {row.step_seconds:.3g} s/step"
    if row.peak is not None and row.device_memory is not None:
        text += f" · peak {readable(row.peak)} of {readable(row.device_memory)} a rank"
    elif row.peak is not None:
        text += f" · peak {readable(row.peak)} a rank"
    return text


def answer_line(row: Row, extras: Extras | None = None) -> str:
    """The answer in one line: whether it fits, what to run and its figures, all from ``row``."""
    fits = row.fits()
    verdict = "yes" if fits else "unknown (give --device-memory)" if fits is None else "no"
    return f"fits: {verdict} — run: {strategy_call(row, extras)} · {figures(row)}"


def ordered(laid: Sequence[Row], pick: Row | None) -> list[Row]:
    """The rows as the short table shows them: ``pick`` first, then those that fit, fastest first, then the
    rest closest to fitting first."""

    def key(r: Row) -> tuple[Any, ...]:
        fits = r.fits() is not False
        return (
            not fits,
            r.step_seconds if fits else r.over() or 0,
            r.exchange_bytes,
            SCHEMES.index(r.candidate.scheme),
        )

    rest = sorted((r for r in laid if pick is None or r.candidate is not pick.candidate), key=key)
    return ([pick] if pick is not None else []) + rest


def _optimisation(row: Row) -> str:
    c = row.candidate
    if not c.changes_optimisation:
        return "exact"
    text = "changes it: check quality"
    stall = row.stall_per_period
    if stall:
        text += f"; stall {stall:.3g} s a period"
    return text


def short_table(laid: Sequence[Row], pick: Row | None = None, top: int | None = DEFAULT_ROWS) -> str:
    """The best few rows (``pick`` first, in bold when it fits; at most ``top``) as a markdown table of eight
    columns."""
    shown = ordered(laid, pick)[: top or None]
    sharded = any(r.sharded for r in shown)
    device_memory = next((r.device_memory for r in shown if r.device_memory is not None), None)
    comm = "in-group s/step" if sharded else "wire s/step"
    sent = "MB/step between groups" if sharded else "MB/step a rank"
    memory = f"peak vs {readable(device_memory)}" if device_memory is not None else "peak/rank"
    head = f"| # | scheme | settings | s/step | {comm} | {sent} | {memory} | optimisation |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(shown, 1):
        c = r.candidate
        settings = ", ".join(f"{k}={v}" for k, v in c.settings.items() if k != "sync_period_unit") or "-"
        scheme = f"**{c.scheme}**" if pick is not None and r is pick and r.fits() is not False else c.scheme
        wire = r.inside_seconds if sharded else r.exchange_seconds
        over = r.over()
        if r.peak is None:
            held = "-"
        elif over is None:
            held = readable(r.peak)
        else:
            held = readable(r.peak) + (", fits" if over <= 0 else f", {readable(over)} over")
        lines.append(
            f"| {i} | {scheme} | {settings} | {r.step_seconds:.3g} | {wire:.3g} | {r.exchange_bytes / 1e6:.3g} |"
            f" {held} | {_optimisation(r)} |"
        )
    return "\n".join(lines)


def pick_row(candidates: Sequence[Candidate], tolerance: float, sharded: bool) -> Row | None:
    """The recommended row of a layout (:func:`~lightning_commstrats.advisor.recommend`), ``None`` when
    nothing fits or the layout has no candidate."""
    try:
        return Row(recommend(candidates, tolerance, sharded=sharded), sharded)
    except ValueError:
        return None


def closest(laid: Sequence[Row]) -> Row | None:
    """The row whose peak is the least over its device's memory."""
    known = [r for r in laid if r.over() is not None]
    return min(known, key=lambda r: (r.over(), r.step_seconds, departure(r.candidate)), default=None)


@dataclass(frozen=True)
class Change:
    """One change to the run, tried in the model when nothing fits.

    Attributes:
        flags: the command's flags that make it (``--activation-checkpointing``, ``--batch-size 1``).
        options: what it changes in :func:`~lightning_commstrats.advisor.advise`'s arguments.
        ladder: the name of a family of changes tried in order (smaller batches, larger groups), of which
            only the first that fits is kept.
    """

    flags: str
    options: Mapping[str, Any] = field(default_factory=dict)
    ladder: str = ""
    note: str = ""


@dataclass(frozen=True)
class Fit:
    """A change (or several) that makes a candidate fit, the row that fits and what it needs to run."""

    flags: str
    row: Row
    extras: Extras
    note: str = ""


def what_would_fit(
    evaluate: Callable[[Mapping[str, Any]], tuple[list[Candidate], bool, Extras]],
    changes: Sequence[Change],
    tolerance: float,
    most: int = 4,
) -> tuple[list[Fit], Row | None]:
    """The changes that make a candidate fit, each tried in the model alone (the first that fits of each
    ladder), at most ``most``; when none does alone, all of them at once, added one after the other
    until one fits. Returns the fits, and the closest row with every change made when nothing fits.

    ``evaluate(options)`` predicts every candidate with ``options`` changed and says the layout to read
    (sharded or not) and the extras the run needs."""
    found: list[Fit] = []
    done: set[str] = set()
    for change in changes:
        if change.ladder and change.ladder in done:
            continue
        fit = _fit(evaluate, change.options, change.flags, tolerance, change.note)
        if fit is not None:
            found.append(fit)
            done.add(change.ladder)
        if len(found) >= most:
            break
    single = [c for c in changes if not c.ladder]
    if len(single) > 1 and len(found) < most:  # the changes that keep the batch and the groups, together
        both = _fit_together(evaluate, single, tolerance)
        if both is not None and not any(f.flags in both.flags for f in found):
            found.append(both)
    if found:
        return found, None
    options: dict[str, Any] = {}
    flags: dict[str, tuple[str, str]] = {}
    last: Row | None = None
    for change in changes:
        options.update(change.options)
        flags[change.ladder or change.flags] = (change.flags, change.note)
        note = "; ".join(n for _, n in flags.values() if n)
        fit = _fit(evaluate, options, " ".join(f for f, _ in flags.values()), tolerance, note)
        if fit is not None:
            return [fit], None
    if changes:
        candidates, sharded, _ = evaluate(options)
        last = closest(rows(candidates, sharded))
    return [], last


def _fit_together(
    evaluate: Callable[[Mapping[str, Any]], tuple[list[Candidate], bool, Extras]],
    changes: Sequence[Change],
    tolerance: float,
) -> Fit | None:
    """``changes`` made together, less each one the others fit without (in order), if together they fit."""

    def fit(kept: Sequence[Change]) -> Fit | None:
        options = {k: v for c in kept for k, v in c.options.items()}
        note = "; ".join(c.note for c in kept if c.note)
        return _fit(evaluate, options, " ".join(c.flags for c in kept), tolerance, note)

    kept = list(changes)
    best = fit(kept)
    if best is None:
        return None
    for change in changes:
        rest = [c for c in kept if c is not change]
        trial = fit(rest) if len(rest) > 1 else None
        if trial is not None:
            kept, best = rest, trial
    return best


def _fit(
    evaluate: Callable[[Mapping[str, Any]], tuple[list[Candidate], bool, Extras]],
    options: Mapping[str, Any],
    flags: str,
    tolerance: float,
    note: str = "",
) -> Fit | None:
    candidates, sharded, extras = evaluate(options)
    row = pick_row(candidates, tolerance, sharded)
    return Fit(flags, row, extras, note) if row is not None else None
