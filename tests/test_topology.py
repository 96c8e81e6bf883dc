"""Topology: the ranks' layout validated once, and the answers every component reads from it."""

import pytest

from lightning_commstrats.compression.hierarchical import group_layout
from lightning_commstrats.topology import REPLICATE, SHARD, Topology


def test_groups_across_and_holders_of_a_sharded_layout():
    t = Topology(8, 4, SHARD)
    assert (t.num_groups, t.num_models, t.sharded, t.two_level) == (2, 2, True, False)
    assert t.groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.across() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (t.group_of(6), t.index_of(6), t.holders(6)) == (1, 2, [2, 6])
    assert t.describe() == "8 ranks, shard='fsdp' in 2 group(s) of 4"


def test_a_replicated_layout_averages_every_ranks_model():
    t = Topology(4, 2)
    assert (t.inside, t.num_models, t.two_level) == (REPLICATE, 4, True)
    assert t.holders(3) == [0, 1, 2, 3]
    assert Topology(4).describe() == "4 ranks, unsharded" and not Topology(1, 1).two_level
    # the slow hop's rings are the topology's
    assert group_layout(6, 3) == (Topology(6, 3).groups(), Topology(6, 3).across())


def test_a_strategys_settings_resolve_node_and_no_groups():
    assert Topology.of(8, 4, "node", None).group_size == 4
    assert Topology.of(8, 4, None, None) == Topology(8, 1)
    assert Topology.of(8, 4, None, "fsdp") == Topology(8, 4, SHARD)  # shard='fsdp' defaults to the node
    assert Topology.of(8, 4, 2, "fsdp").num_groups == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((6, 4), "group_size=4 must divide the number of ranks, 6"),
        ((4, 0), "group_size must be a positive int, got 0"),
        ((4, True), "group_size must be a positive int, got True"),
        ((0, 1), "the number of ranks must be a positive int, got 0"),
        ((4, 2, "expert"), r"inside='expert' is not one of \('replicate', 'shard'\)"),
    ],
)
def test_sizes_that_do_not_fit_are_refused_naming_the_setting(args, message):
    with pytest.raises(ValueError, match=message):
        Topology(*args)
