"""``benchmarks/fit_limit.py``: the ladder's parameter count, the search's boundary, and the cgroup limit
that kills a rank over the budget."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import fit_limit  # noqa: E402

MIB = 1 << 20


@pytest.mark.parametrize("rung", [4, 11])
def test_rung_params_counts_what_the_model_holds(rung):
    from lightning_commstrats.models import LanguageModel

    model = LanguageModel(**fit_limit.model_args(rung))
    assert sum(p.numel() for p in model.parameters()) == fit_limit.rung_params(rung)


@pytest.mark.parametrize("layout", list(fit_limit.LAYOUTS))
@pytest.mark.parametrize("bytes_per_param", [20, 41, 90])
def test_search_stops_between_the_largest_fit_and_the_smallest_kill(monkeypatch, layout, bytes_per_param):
    """A fake rank: 270 MiB to start, then ``bytes_per_param`` per parameter (and a little more on larger
    models, as activations add), killed above the budget."""
    budget, start = 768 * MIB, 270 * MIB
    calls = []

    def peak(k):
        return start + bytes_per_param * fit_limit.rung_params(k) * (1 + k / 200)

    def fake_trial(k, layout, budget, cgroups, fix, timeout):
        calls.append(k)
        p = int(peak(k))
        if p > budget:
            return {"fits": False, "killed": [0, 1, 2, 3], "cgroup_peaks": [budget] * 4, "seconds": 0.0}
        rank = {"cgroup_start": start, "rss": {"start": start, "peak": p}, "losses": [1.0, 0.5]}
        return {"fits": True, "ranks": [rank] * 4, "cgroup_peaks": [p] * 4, "hwm": [p] * 4, "seconds": 0.0}

    monkeypatch.setattr(fit_limit, "trial", fake_trial)
    found = fit_limit.search(layout, budget, True, True, 1.0, lambda *a: None)
    fitting = [k for k in fit_limit.LADDER if peak(k) <= budget]
    assert found["largest"] == fitting[-1]
    assert found["smallest_over"] == fitting[-1] + 1
    assert len(calls) <= 6, calls  # extrapolation and bisection, not a walk up the ladder


@pytest.mark.slow
def test_a_rank_over_the_budget_is_killed_by_the_kernel():
    """200 MiB is less than the interpreter with torch and Lightning: every rank is OOM-killed."""
    why = fit_limit.check_cgroups(200 * MIB)
    if why is not None:
        pytest.skip(f"no memory cgroup here: {why}")
    result = fit_limit.trial(4, "unsharded", 200 * MIB, True, True, 300.0)
    assert result["fits"] is False
    assert result["killed"] == [0, 1, 2, 3]
    assert max(result["cgroup_peaks"]) <= 200 * MIB
    assert not fit_limit.Limits(200 * MIB, 4).top.exists()  # the cgroups were removed
