"""The support matrix on real ranks: every supported combination that
:func:`lightning_commstrats.support.covering_cases` yields (every allowed pair of settings at least
once) trains on 2 ranks (4 for two of the cases sharded in two groups) and holds the invariants that
any scheme must hold:

- ranks agree where the scheme says they agree (its ``replicated_tensors``, per replica group);
- validation during fit and saving checkpoints change nothing in training (bit for bit);
- a run resumed from a checkpoint in the middle of a period equals the uninterrupted one bit for bit;
- every rank's float buffers end as the average of the ranks' buffers before the end of fit;
- tied weights stay one tensor; a parameter without gradient (unused, or times 0 in the loss) does
  not move under the gradient schemes;
- no hang: every case ends within its timeout (the harness kills the ranks and fails it).

A few cases run in the quick suite; the whole matrix is slow. ``local_sgd`` runs under ``mpiexec``
(skipped without it); the fault-tolerant replica cases are left to ``test_replica_ranks.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import mpiexec, run_ranks

from lightning_commstrats import support

pytestmark = pytest.mark.multiprocess

WORKER = __import__("pathlib").Path(__file__).parent / "matrix_worker.py"
CASES = support.covering_cases()
RUN = [c for c in CASES if support.case_status(c) == "supported"]
# Sharded in two groups on 4 ranks (groups of 2): the first two such cases; the others use 2 ranks in
# groups of 1 (the machine has two cores).
FOUR = {support.case_id(c) for c in [c for c in RUN if c["shard"] == "fsdp-2groups"][:2]}
# The quick suite's cases (about half a minute on two shared cores): a resumed gradient scheme, a
# periodic scheme with validation and buffers (Fabric's cases run in the slow suite, beside
# tests/multiprocess/test_fabric_ranks.py's quick ones).
QUICK = {
    support.case_id(c)
    for c in [
        next(c for c in RUN if c["resume"] != "off" and c["scheme"] == "allreduce" and c["front"] == "trainer"),
        next(c for c in RUN if c["scheme"] in ("diloco", "bmuf") and c["model"] == "batchnorm"),
    ]
}

# Open defects the matrix found: a case that meets one is expected to fail (not strictly). None now;
# each found so far was fixed (see the CHANGELOG).
KNOWN: list[tuple[Any, str]] = []


def _params(c: dict[str, str]) -> Any:
    cid = support.case_id(c)
    marks = [] if cid in QUICK else [pytest.mark.slow]
    for when, why in KNOWN:
        if when(c):
            marks.append(pytest.mark.xfail(reason=why, strict=False))
    if c["scheme"] == "local_sgd":
        marks.append(pytest.mark.skipif(mpiexec() is None, reason="local_sgd talks MPI: needs mpiexec"))
    return pytest.param(c, id=cid, marks=marks)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, exact: bool = True) -> None:
    assert a.keys() == b.keys(), what
    for key, value in a.items():
        if not value.is_floating_point() or exact:
            assert torch.equal(value, b[key]), f"{what}: {key} differs"
        else:
            torch.testing.assert_close(value, b[key], rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


def _buffer_names(state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in buffers if k in state]


def check(case: dict[str, str], results: list[dict[str, Any]]) -> None:
    main = [r["main"] for r in results]
    # ranks agree where the scheme says they agree
    by_key: dict[int, list[dict[str, Any]]] = {}
    for r in main:
        by_key.setdefault(r["replica_key"], []).append(r)
    for group in by_key.values():
        for other in group[1:]:
            _same(group[0]["replicated"], other["replicated"], "replicated tensors across ranks")
    for r, res in enumerate(main):
        state = res["params"]
        buffers = [k for k in _buffer_names(state, res["buffers_before_end"]) if state[k].is_floating_point()]
        params = {k: v for k, v in state.items() if k not in res["buffers_before_end"]}
        # validation and checkpoints change nothing in training
        if "reference" in results[r]:
            ref = results[r]["reference"]["params"]
            _same(params, {k: ref[k] for k in params}, f"rank {r}: with validation/checkpoints vs without")
            _same({k: state[k] for k in buffers}, {k: ref[k] for k in buffers}, f"rank {r} buffers", exact=False)
        # a resumed run equals the uninterrupted one bit for bit
        if "resumed" in results[r]:
            _same(state, results[r]["resumed"]["params"], f"rank {r}: resumed vs uninterrupted")
        # float buffers end as the exact average of the ranks' before the end of fit
        for key in buffers:
            mean = torch.stack([m["buffers_before_end"][key].float() for m in main]).mean(0)
            torch.testing.assert_close(state[key].float(), mean, rtol=0, atol=1e-6, msg=f"rank {r} buffer {key}")
        if case["model"] == "tied":
            assert torch.equal(state["aux_a.weight"], state["aux_b.weight"]), "tied weights came apart"
        if case["model"] == "no-grad" and case["scheme"] in support.GRADIENT:
            for key in ("idle", "still"):
                assert torch.equal(state[key], res["start"][key]), f"rank {r}: {key} (no gradient) moved"


@pytest.mark.parametrize("case", [_params(c) for c in RUN])
def test_a_supported_combination_holds_the_invariants(case: dict[str, str]) -> None:
    cid = support.case_id(case)
    settings = support.strategy_settings(case, four_ranks=cid in FOUR)
    results = run_ranks(
        {"case": case, "four_ranks": cid in FOUR},
        settings.world_size,
        launcher=settings.launcher,
        timeout=300,
        script=WORKER,
    )
    check(case, results)
