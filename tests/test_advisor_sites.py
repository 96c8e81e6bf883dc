"""The advisor for sites: the link inside a group and the link between groups apart, the sharded layout's
in-group traffic (FSDP2's, counted against what FSDP2 sends) and cross-group traffic each priced on its
own link, the peak memory per rank against a device's memory, and memory a person can read."""

from pathlib import Path

import pytest

from lightning_commstrats import advisor

REPO = Path(__file__).resolve().parents[1]
# (1000, 64) and (256, 64) matrices, a bias of 64: 80448 values
SHAPES = [(1000, 64), (64,), (256, 64)]


@pytest.mark.multiprocess
def test_in_group_bytes_equal_what_fsdp2_sends_on_two_ranks():
    from harness import run_ranks

    cases = {
        "default": {"reshard": None},
        "all": {"reshard": True},
        "keep": {"reshard": False},
        "mixed": {"reshard": None, "mixed": True},
    }
    ranks = run_ranks({"cases": cases}, 2, script=REPO / "tests" / "multiprocess" / "fsdp_traffic_worker.py")
    shapes = [tuple(s) for s in ranks[0]["shapes"]]
    units = ranks[0]["units"]
    # blocks.0 (a 9 x 9 Linear), blocks.1.0 (9 -> 7), blocks.1.1 (7 -> 9) are units; blocks.1 holds
    # nothing of its own; the tied 13 x 9 embedding stays with the root
    assert sorted(units.units) == [(1, 2), (3, 4), (5, 6)] and units.root == (0,)
    for name, case in cases.items():
        for rank in ranks:
            seen = rank[name]
            # a ring all-gather sends the g - 1 other parts of what each rank hands it; a ring
            # reduce-scatter (g - 1) / g of its whole input
            gathered = sum(seen["all_gather"])
            reduced = sum(seen["reduce_scatter"]) // 2
            predicted = advisor.fsdp_traffic(
                shapes,
                units,
                2,
                gather_bytes=2 if case.get("mixed") else 4,
                reduce_bytes=4,
                reshard_after_forward=case["reshard"],
            )
            assert (predicted.all_gather, predicted.reduce_scatter) == (gathered, reduced), name


def test_in_group_bytes_by_hand():
    # groups of 4: (1000, 64) -> 250 rows a rank, (64,) -> 16, (256, 64) -> 64 rows: 16000 + 16 + 4096
    local = 16000 + 16 + 4096
    units = advisor.FsdpUnits(units=((0, 1), (2,)), root=())
    t = advisor.fsdp_traffic(SHAPES, units, 4)
    # forward and backward all-gathers of every unit, 3 parts sent each; one reduce-scatter
    assert (t.all_gather, t.reduce_scatter) == (2 * 3 * local * 4, 3 * local * 4)
    # the root is not gathered again in backward under the default; it is with reshard_after_forward=True
    rooted = advisor.FsdpUnits(units=((2,),), root=(0, 1))
    assert advisor.fsdp_traffic(SHAPES, rooted, 4).all_gather == 3 * (local + 4096) * 4
    assert advisor.fsdp_traffic(SHAPES, rooted, 4, reshard_after_forward=True).all_gather == 2 * 3 * local * 4
    # padding: 7 rows over 4 ranks are 2 a rank
    assert advisor.fsdp_traffic([(7, 3)], advisor.FsdpUnits(((0,),), ()), 4).reduce_scatter == 3 * 2 * 3 * 4
    with pytest.raises(ValueError, match="units must name every one of the model's 3"):
        advisor.fsdp_traffic(SHAPES, advisor.FsdpUnits(((0,),), ()), 4)
