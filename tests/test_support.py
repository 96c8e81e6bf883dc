"""The support matrix's source (lightning_commstrats/support.py) against the package: the covering cases
hold every allowed pair of settings; every refused combination raises when the strategy is built or
the fit set up, with a message naming both settings; every supported one is accepted there; the
docs page is the module's output."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_commstrats import support
from lightning_commstrats.fabric import scheme_class

CASES = support.covering_cases()


def test_the_cases_hold_every_allowed_pair_and_none_is_refused():
    held, allowed = support.pair_coverage(CASES)
    assert held == allowed > 0
    assert all(support.case_status(c) in ("supported", "elsewhere") for c in CASES)
    # the cases the matrix runs hold every allowed pair that is not left to a test of its own
    run = [c for c in CASES if support.case_status(c) == "supported"]
    pairs = {p for c in run for p in support._pairs_of(c)}
    away = [p for p in support.allowed_pairs() if "fault_tolerance" in (p[1], p[3])]
    assert set(support.allowed_pairs()) - set(away) <= pairs
    assert support.covering_cases() == CASES  # deterministic


def test_the_axes_name_every_registered_scheme():
    from lightning_commstrats._registry import package_strategy_names

    assert support.AXES["scheme"] == tuple(package_strategy_names())


def build_and_set_up(case: dict[str, str]) -> None:
    """Build the case's strategy and run the setup checks of its callbacks (what ``Trainer.fit``
    calls before any rank trains)."""
    from lightning_commstrats import AutoAdjust, GradientNoiseScale

    settings = support.strategy_settings(case)
    kwargs: dict[str, Any] = dict(settings.kwargs)
    kwargs.pop("word_counts", None)
    strategy = scheme_class(settings.scheme)(**kwargs)
    trainer = SimpleNamespace(
        strategy=strategy, world_size=settings.world_size, accumulate_grad_batches=int(case["accumulate"])
    )
    module = SimpleNamespace(automatic_optimization=True)
    if case["batching"] == "AutoAdjust":
        AutoAdjust().setup(trainer, module, "fit")
    elif case["batching"] == "GradientNoiseScale":
        GradientNoiseScale().setup(trainer, module, "fit")


@pytest.mark.parametrize(
    ("rule", "case"),
    [
        pytest.param(r, c, id=support.case_id({a: c[a] for a in ("scheme", *r.when)}))
        for r, c in support.refused_examples()
    ],
)
def test_a_refused_combination_raises_naming_both_settings(rule: support.Rule, case: dict[str, str]):
    assert support.matching_rules(case) == [rule]
    with pytest.raises(ValueError) as info:
        build_and_set_up(case)
    message = str(info.value)
    for axis in rule.when:
        words = support.setting_words(axis, case[axis])
        assert any(w in message for w in words), f"the message does not name {axis}={case[axis]}: {message}"


@pytest.mark.parametrize("case", [pytest.param(c, id=support.case_id(c)) for c in CASES])
def test_a_supported_combination_is_accepted_when_built_and_set_up(case: dict[str, str]):
    build_and_set_up(case)


def test_the_docs_page_is_the_generated_one():
    page = support.DOCS_PAGE.read_text()
    assert page == support.render_markdown(), "run python -m lightning_commstrats.support"
