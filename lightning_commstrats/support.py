"""What the package supports in combination: the single source of the support matrix.

The axes a real run combines (the scheme, sharding, the slow hop's bits, mixed precision, batch-size
callbacks, validation during fit, checkpoint and resume, fault-tolerant replicas, the front end, the
model's peculiarities, gradient accumulation), their values, and the rules that say which
combinations the package refuses, with the reason. The refusals mirror the checks that the
strategies and callbacks make when they are built or set up (``tests/test_support.py`` builds every
refused combination and checks that it raises with a message naming both settings); the covering
cases (:func:`covering_cases`) are run on real ranks by ``tests/multiprocess/test_matrix_ranks.py``;
``docs/support.md`` is this module's output (``python -m lightning_commstrats.support``). The three
cannot disagree: they read the same rules.

A combination is one of:

- ``supported``: it trains, and the matrix checks it on real ranks against invariants that hold for
  any scheme (ranks agree where the scheme says they agree, validation and checkpoint saving change
  nothing, a resumed run equals the uninterrupted one bit for bit, buffers equal their average, a
  parameter with a zero gradient does not move under a gradient scheme, every run ends in time);
- ``refused``: the package raises ``ValueError`` when the strategy is built or the fit is set up;
- ``not applicable``: the combination has no meaning (a Trainer callback under Fabric's own loop).
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AXES",
    "AXIS_DOC",
    "RULES",
    "Rule",
    "allowed_pairs",
    "case_status",
    "covering_cases",
    "matching_rules",
    "render_markdown",
    "strategy_settings",
]

Case = dict[str, str]

PERIODIC = ("model_averaging", "bmuf", "local_sgd", "diloco", "streaming_diloco", "sparseloco")
GRADIENT = ("allreduce", "onebit_sgd", "sampled_vocab", "expert_parallel", "onebit_adam", "zero_one_adam")
SHARDS = ("fsdp-1group", "fsdp-2groups")


def _scheme_names() -> tuple[str, ...]:
    from lightning_commstrats._registry import package_strategy_names

    return tuple(package_strategy_names())


# Every axis with its values; the first value is the default a case takes when nothing asks otherwise.
AXES: dict[str, tuple[str, ...]] = {
    "scheme": _scheme_names(),
    "shard": ("none", *SHARDS),
    "slow_hop_bits": ("32", "8"),
    "precision": ("off", "layered-bf16"),
    "batching": ("none", "AutoAdjust", "GradientNoiseScale"),
    "validation": ("off", "during-fit"),
    "resume": ("off", "mid-period"),
    "replicas": ("off", "fault_tolerance"),
    "front": ("trainer", "fabric"),
    "model": ("plain", "batchnorm", "tied", "no-grad"),
    "accumulate": ("1", "2"),
}

AXIS_DOC: dict[str, str] = {
    "scheme": "every registered strategy name",
    "shard": '`shard=None`; `shard="fsdp"` with one group (`group_size` = the ranks); with two groups',
    "slow_hop_bits": "bits on the hop between groups (`group_size` set: two groups, or the sharded run's groups)",
    "precision": '`LayeredMixedPrecision("layered", dtype="bf16")` or none',
    "batching": "`AutoAdjust` or `GradientNoiseScale` as a callback, or neither",
    "validation": "validation every few batches during fit (Fabric: an evaluation in `global_model()`)",
    "resume": "a checkpoint in the middle of a period, and a second run resumed from it",
    "replicas": "`fault_tolerance` (torchft replicas, a Lighthouse)",
    "front": "the Trainer or Fabric (`FabricStrategy`)",
    "model": "a plain model; one with a BatchNorm (buffers); two layers sharing one weight; parameters without "
    "gradient (one unused, one with an exact zero gradient)",
    "accumulate": "`accumulate_grad_batches` (Fabric: backward on two batches per optimizer step)",
}


@dataclass(frozen=True)
class Rule:
    """Combinations that match ``when`` (every axis named takes one of its values) are ``status``.

    ``status`` is ``"refused"`` (the package raises ``ValueError`` at ``where``: ``"construction"``
    of the strategy or ``"setup"`` of the fit; the message names both settings) or
    ``"not applicable"``.
    """

    when: Mapping[str, tuple[str, ...]]
    status: str
    where: str
    reason: str
    raised_by: str = ""

    def matches(self, case: Mapping[str, str]) -> bool:
        """Whether ``case`` (possibly partial: an axis it lacks does not match) falls under the rule."""
        return all(axis in case and case[axis] in values for axis, values in self.when.items())

    def could_match(self, case: Mapping[str, str]) -> bool:
        """Whether some completion of the partial ``case`` falls under the rule."""
        return all(case[axis] in values for axis, values in self.when.items() if axis in case)


def _not(axis: str, *values: str) -> tuple[str, ...]:
    return tuple(v for v in AXES[axis] if v not in values)


RULES: tuple[Rule, ...] = (
    Rule(
        {
            "scheme": (*_not("scheme", "allreduce", "onebit_sgd", "expert_parallel", *PERIODIC), "local_sgd"),
            "shard": SHARDS,
        },
        "refused",
        "construction",
        "sharding with FSDP2 is supported by allreduce, onebit_sgd, expert_parallel and the periodic schemes that "
        "exchange over torch.distributed; local_sgd talks MPI",
        "sharding.layout.check_shard",
    ),
    Rule(
        {"scheme": (*_not("scheme", *PERIODIC), "local_sgd"), "replicas": ("fault_tolerance",)},
        "refused",
        "construction",
        "only the periodic schemes survive replicas that die and rejoin; a scheme that exchanges every step "
        "needs every rank at every step (local_sgd: an MPI job ends with its first dead rank)",
        "CommStrategy.__init__, LocalSGDStrategy.__init__",
    ),
    Rule(
        {"scheme": ("parameter_server",), "slow_hop_bits": _not("slow_hop_bits", "32")},
        "refused",
        "construction",
        "the parameter server has no exchange between groups of ranks",
        "ParameterServerStrategy.__init__",
    ),
    Rule(
        {"batching": ("AutoAdjust",), "shard": SHARDS},
        "refused",
        "setup",
        "putting sharded parameters and optimizer state back after a trial is not supported",
        "batching.auto_adjust.check_rollback",
    ),
    Rule(
        {"batching": ("AutoAdjust",), "replicas": ("fault_tolerance",)},
        "refused",
        "setup",
        "a trial's syncs are committed steps of the torchft quorum",
        "batching.auto_adjust.check_rollback",
    ),
    Rule(
        {"batching": ("AutoAdjust",), "accumulate": ("2",)},
        "refused",
        "setup",
        "the batch AutoAdjust sizes is the one of an optimizer step",
        "AutoAdjust.setup",
    ),
    Rule(
        {"batching": ("GradientNoiseScale",), "scheme": (*PERIODIC, "parameter_server", "expert_parallel")},
        "refused",
        "setup",
        "the scheme never holds each rank's own whole gradient and its average in one step (periodic schemes and "
        "the parameter server exchange weights; expert_parallel's experts live on other ranks)",
        "GradientNoiseScale.setup",
    ),
    Rule(
        {"batching": ("GradientNoiseScale",), "shard": SHARDS},
        "refused",
        "setup",
        "a rank holds a slice of the gradient, not its own whole gradient",
        "GradientNoiseScale.setup",
    ),
    Rule(
        {"front": ("fabric",), "batching": ("AutoAdjust", "GradientNoiseScale")},
        "not applicable",
        "",
        "a Trainer callback: Fabric runs the user's own loop",
    ),
    Rule(
        {"front": ("fabric",), "precision": ("layered-bf16",)},
        "not applicable",
        "",
        "a Trainer precision plugin: Fabric takes its own precision=",
    ),
)

# Supported combinations that the matrix leaves to a test of their own (too costly to run per case).
ELSEWHERE: dict[str, tuple[Mapping[str, tuple[str, ...]], str]] = {
    "replicas": (
        {"replicas": ("fault_tolerance",)},
        "torchft replicas need a Lighthouse and a process group per replica: run by "
        "tests/multiprocess/test_replica_ranks.py and test_fault_tolerance_ranks.py, not by the matrix",
    ),
}

# Setting words a refusal's message must hold, per axis (for the scheme: its name or class name).
SETTING_WORDS: dict[str, tuple[str, ...]] = {
    "shard": ("shard=",),
    "slow_hop_bits": ("slow_hop_bits",),
    "replicas": ("fault_tolerance",),
    "accumulate": ("accumulate_grad_batches",),
    "precision": ("LayeredMixedPrecision", "precision"),
}


def setting_words(axis: str, value: str) -> tuple[str, ...]:
    """Words of which a message naming the setting ``axis=value`` holds at least one."""
    if axis == "scheme":
        from lightning_commstrats._registry import strategy_class_path

        path = strategy_class_path(value)
        return (value, path.rsplit(".", 1)[1]) if path else (value,)
    if axis == "batching":
        return (value,)
    return SETTING_WORDS[axis]


def matching_rules(case: Mapping[str, str]) -> list[Rule]:
    """The rules under which the (complete) ``case`` falls."""
    return [rule for rule in RULES if rule.matches(case)]


def case_status(case: Mapping[str, str]) -> str:
    """``"refused"``, ``"not applicable"``, ``"elsewhere"`` (supported, run by a test of its own) or
    ``"supported"``; a refusal wins over the rest."""
    rules = matching_rules(case)
    if any(r.status == "refused" for r in rules):
        return "refused"
    if rules:
        return "not applicable"
    if any(all(case[a] in v for a, v in when.items()) for when, _ in ELSEWHERE.values()):
        return "elsewhere"
    return "supported"


def _allowed(case: Mapping[str, str]) -> bool:
    """Whether the partial ``case`` can still be completed into a combination that is not refused
    nor not applicable (every rule's axes are at most two or three: a search over the rest is short)."""
    if any(rule.matches(case) for rule in RULES):
        return False
    free = [a for a in AXES if a not in case]
    relevant = [r for r in RULES if r.could_match(case)]
    if not relevant:
        return True
    axes = [a for a in free if any(a in r.when for r in relevant)]

    def search(i: int, partial: dict[str, str]) -> bool:
        if any(r.matches(partial) for r in relevant):
            return False
        if i == len(axes):
            return True
        return any(search(i + 1, {**partial, axes[i]: v}) for v in AXES[axes[i]])

    return search(0, dict(case))


Pair = tuple[str, str, str, str]  # (axis, value, axis, value), the axes in AXES order


def all_pairs() -> list[Pair]:
    """Every pair of values of two different axes."""
    names = list(AXES)
    return [(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1 :] for va in AXES[a] for vb in AXES[b]]


def allowed_pairs() -> list[Pair]:
    """The pairs that some combination neither refused nor not applicable holds."""
    return list(_allowed_pairs())


@functools.cache
def _allowed_pairs() -> tuple[Pair, ...]:
    return tuple(p for p in all_pairs() if _allowed({p[0]: p[1], p[2]: p[3]}))


def _pairs_of(case: Mapping[str, str]) -> Iterator[Pair]:
    names = [a for a in AXES if a in case]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            yield (a, case[a], b, case[b])


def covering_cases() -> list[Case]:
    """Combinations, none refused nor not applicable, that hold every allowed pair at least once.

    Greedy and deterministic (AETG's idea without its random tries): each new case starts from the
    first pair no case holds yet, then fills the other axes in order, each with the value that holds
    the most uncovered pairs with the values chosen so far (the first such value on a tie) and
    leaves the case completable."""
    return [dict(c) for c in _covering_cases()]


@functools.cache
def _covering_cases() -> tuple[Case, ...]:
    elsewhere = [when for when, _ in ELSEWHERE.values()]

    def away(pair: Pair) -> bool:  # a pair of a combination that runs in a test of its own
        return any(
            (pair[0] in w and pair[1] in w[pair[0]]) or (pair[2] in w and pair[3] in w[pair[2]]) for w in elsewhere
        )

    order = sorted(allowed_pairs(), key=away)  # the matrix's own cases first, holding every other pair
    uncovered = set(order)
    cases: list[Case] = []
    while uncovered:
        seed = next(p for p in order if p in uncovered)
        a, va, b, vb = seed
        case: Case = {a: va, b: vb}
        for axis in AXES:
            if axis in case:
                continue
            best, gain = None, -1
            for value in AXES[axis]:
                if not away(seed) and any(axis in w and value in w[axis] for w in elsewhere):
                    continue
                trial = {**case, axis: value}
                if not _allowed(trial):
                    continue
                g = sum(1 for p in _pairs_of(trial) if p in uncovered and axis in (p[0], p[2]))
                if g > gain:
                    best, gain = value, g
            assert best is not None, (case, axis)
            case[axis] = best
        case = {axis: case[axis] for axis in AXES}
        uncovered.difference_update(_pairs_of(case))
        cases.append(case)
    return tuple(cases)


def pair_coverage(cases: Iterable[Mapping[str, str]]) -> tuple[int, int]:
    """(allowed pairs held by ``cases``, allowed pairs)."""
    allowed = set(allowed_pairs())
    held = {p for case in cases for p in _pairs_of(case)}
    return len(allowed & held), len(allowed)


def refused_examples() -> list[tuple[Rule, Case]]:
    """For every refusal rule and every pair of values it names, one combination: the defaults with
    those values (the other axes at the first value that keeps the case clear of the other rules)."""
    out = []
    for rule in RULES:
        if rule.status != "refused":
            continue
        axes = list(rule.when)
        for values in itertools.product(*(rule.when[a] for a in axes)):
            case: Case = dict(zip(axes, values, strict=True))
            for axis in AXES:
                if axis in case:
                    continue
                case[axis] = next(
                    (v for v in AXES[axis] if not any(r.matches({**case, axis: v}) for r in RULES if r is not rule)),
                    AXES[axis][0],
                )
            out.append((rule, {axis: case[axis] for axis in AXES}))
    return out


# ---------------------------------------------------------------------- a case as settings


@dataclass
class Settings:
    """What a case means in arguments: the strategy's name and keyword arguments, the ranks, the
    model's kind and the rest of the run."""

    scheme: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    world_size: int = 2
    launcher: str = "env"
    model: str = "mlp"  # the base model: mlp, lm (sampled_vocab) or moe (expert_parallel)
    model_kwargs: dict[str, Any] = field(default_factory=dict)


SCHEME_KWARGS: dict[str, dict[str, Any]] = {
    "model_averaging": {"sync_period": 4, "sync_period_unit": "steps"},
    "bmuf": {"sync_period": 4, "sync_period_unit": "steps"},
    "local_sgd": {"sync_period": 4},
    "diloco": {"sync_period": 4},
    "streaming_diloco": {"sync_period": 4, "num_fragments": 2},
    "sparseloco": {"sync_period": 4},
    "onebit_sgd": {"small_tensor_numel": 64},
    "onebit_adam": {"freeze_step": 3, "small_tensor_numel": 64},
    "zero_one_adam": {"var_freeze_step": 3, "small_tensor_numel": 64},
    "sampled_vocab": {"alpha": 3, "beta": 2, "word_counts": "data"},
    "expert_parallel": {"ep_size": 2},
    "parameter_server": {},
    "allreduce": {},
}


def strategy_settings(case: Mapping[str, str], four_ranks: bool = False) -> Settings:
    """The arguments of ``case``: ``four_ranks`` runs ``shard="fsdp"`` with two groups as 4 ranks in
    two groups of 2 (otherwise 2 ranks in two groups of 1)."""
    scheme = case["scheme"]
    kwargs: dict[str, Any] = dict(SCHEME_KWARGS.get(scheme, {}))
    world = 2
    if case["shard"] != "none":
        kwargs["shard"] = "fsdp"
        kwargs["shard_policy"] = {"min_unit_numel": 1}
        if case["shard"] == "fsdp-2groups":
            world = 4 if four_ranks else 2
            kwargs["group_size"] = world // 2
        else:
            kwargs["group_size"] = world
    bits = int(case["slow_hop_bits"])
    if bits != 32:
        kwargs["slow_hop_bits"] = bits
        if case["shard"] == "none":
            kwargs["group_size"] = 1  # two groups of one rank: the whole average crosses the slow hop
    if case["replicas"] == "fault_tolerance":
        kwargs["fault_tolerance"] = {"lighthouse": "http://127.0.0.1:29510", "replica_id": "a"}
    if scheme == "expert_parallel":
        if case["shard"] == "none":
            kwargs["ep_size"] = world
        else:  # FSDP2 over the layout's inner dimension, which sets the groups: dp x ep = groups x size
            size = kwargs.pop("group_size")
            kwargs.update(ep_size=size, inner="ep") if size > 1 else kwargs.update(ep_size=world, inner="dp")
    model = {"sampled_vocab": "lm", "expert_parallel": "moe"}.get(scheme, "mlp")
    model_kwargs: dict[str, Any] = {}
    if scheme in ("onebit_adam", "zero_one_adam", "sparseloco") and model == "mlp":
        model_kwargs = {"optimizer": "adam", "lr": 0.01}
    return Settings(
        scheme=scheme,
        kwargs=kwargs,
        world_size=world,
        launcher="mpiexec" if scheme == "local_sgd" else "env",
        model=model,
        model_kwargs=model_kwargs,
    )


def case_id(case: Mapping[str, str]) -> str:
    """A short readable name: the values that differ from the defaults."""
    parts = [case["scheme"]] + [f"{a}={v}" for a, v in case.items() if a != "scheme" and v != AXES[a][0]]
    return ",".join(parts)


# ---------------------------------------------------------------------- the docs page


def _pair_status(a: str, va: str, b: str, vb: str) -> str:
    """``ok``: some supported combination holds the pair; ``R``: every combination holding it is
    refused; ``n/a``: not applicable."""
    if _allowed({a: va, b: vb}):
        return "ok"
    direct = [r for r in RULES if r.matches({a: va, b: vb})]
    if direct and all(r.status == "not applicable" for r in direct):
        return "n/a"
    return "R"


def render_markdown() -> str:
    """The ``docs/support.md`` page."""
    cases = covering_cases()
    held, allowed = pair_coverage(cases)
    values = sum(len(v) for v in AXES.values())
    lines = [
        "# Support matrix",
        "",
        "<!-- generated by `python -m lightning_commstrats.support`: edit lightning_commstrats/support.py -->",
        "",
        "Which settings combine. This page, the refusals and the matrix test are one source,",
        "`lightning_commstrats/support.py`: a refused combination raises `ValueError` when the strategy is",
        "built or the fit is set up, with a message naming both settings (`tests/test_support.py` builds",
        "every one), and the supported ones are run on real ranks (`tests/multiprocess/test_matrix_ranks.py`).",
        "",
        "## Axes",
        "",
        "| axis | values | what |",
        "|---|---|---|",
    ]
    for axis, vals in AXES.items():
        lines.append(f"| `{axis}` | {', '.join(f'`{v}`' for v in vals)} | {AXIS_DOC[axis]} |")
    lines += [
        "",
        f"{len(AXES)} axes, {values} values. The matrix runs {len(cases)} combinations chosen so that every pair of",
        f"values that some supported combination holds is in at least one of them ({held} of {allowed} pairs).",
        "",
        "## Refused and not applicable",
        "",
        "| settings | status | where | why |",
        "|---|---|---|---|",
    ]
    for rule in RULES:
        settings = "; ".join(f"`{a}` in {', '.join(f'`{v}`' for v in vals)}" for a, vals in rule.when.items())
        where = f"{rule.where} ({rule.raised_by})" if rule.where else ""
        lines.append(f"| {settings} | {rule.status} | {where} | {rule.reason} |")
    for when, why in ELSEWHERE.values():
        settings = "; ".join(f"`{a}` = `{v[0]}`" for a, v in when.items())
        lines.append(f"| {settings} | supported, run elsewhere | | {why} |")
    lines += [
        "",
        "`local_sgd` talks MPI only: its combinations run under `mpiexec`.",
        "",
        "## Each scheme against each other setting",
        "",
        "`ok`: supported (with the other settings at values that the rules above allow); `R`: refused;"
        " `n/a`: not applicable.",
        "",
    ]
    others = [a for a in AXES if a != "scheme"]
    header = [f"{a}={v}" for a in others for v in AXES[a] if v != AXES[a][0]]
    lines.append("| scheme | " + " | ".join(f"`{h}`" for h in header) + " |")
    lines.append("|---" * (len(header) + 1) + "|")
    for scheme in AXES["scheme"]:
        row = [_pair_status("scheme", scheme, a, v) for a in others for v in AXES[a] if v != AXES[a][0]]
        lines.append(f"| `{scheme}` | " + " | ".join(row) + " |")
    lines += ["", "## Other pairs", "", "Pairs of the other axes that are not plainly supported:", ""]
    others_pairs = [
        (a, va, b, vb, _pair_status(a, va, b, vb))
        for (a, va, b, vb) in all_pairs()
        if "scheme" not in (a, b) and va != AXES[a][0] and vb != AXES[b][0]
    ]
    lines += ["| setting | setting | status |", "|---|---|---|"]
    for a, va, b, vb, status in others_pairs:
        if status != "ok":
            lines.append(f"| `{a}={va}` | `{b}={vb}` | {status} |")
    lines += ["", "## The cases the matrix runs", "", "| # | case | status |", "|---|---|---|"]
    for i, case in enumerate(cases):
        lines.append(f"| {i} | `{case_id(case)}` | {case_status(case)} |")
    return "\n".join(lines) + "\n"


DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "support.md"


def main(argv: list[str] | None = None) -> int:
    """Write ``docs/support.md`` (``--check``: exit 1 when the committed page differs)."""
    argv = sys.argv[1:] if argv is None else argv
    page = render_markdown()
    if "--check" in argv:
        same = DOCS_PAGE.exists() and DOCS_PAGE.read_text() == page
        print(
            "docs/support.md is up to date"
            if same
            else "docs/support.md differs: run python -m lightning_commstrats.support"
        )
        return 0 if same else 1
    if "--stdout" in argv:
        sys.stdout.write(page)
        return 0
    DOCS_PAGE.write_text(page)
    print(f"wrote {DOCS_PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
