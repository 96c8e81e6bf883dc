"""Defaults that work for the run in front of them: streaming's delay fits any schedule."""

import pytest

from lightning_commstrats import StreamingDiLoCoStrategy


@pytest.mark.parametrize(
    ("sync_period", "num_fragments", "delay"),
    [(100, 4, 5), (10, 2, 4), (10, 4, 2), (8, 4, 1), (4, 4, 0), (3, 2, 1), (9, 3, 2)],
)
def test_the_default_delay_is_five_or_the_largest_the_schedule_allows(sync_period, num_fragments, delay):
    s = StreamingDiLoCoStrategy(sync_period=sync_period, num_fragments=num_fragments)
    assert s.fragment_sync_delay == delay
    # one fragment at most in flight: delay < sync_period / num_fragments, written out
    assert delay * num_fragments < sync_period
    if delay < 5:  # and it is the largest such delay
        assert (delay + 1) * num_fragments >= sync_period


def test_a_delay_given_is_still_checked():
    with pytest.raises(ValueError, match="fragment_sync_delay=5 must be < sync_period / num_fragments"):
        StreamingDiLoCoStrategy(sync_period=10, num_fragments=2, fragment_sync_delay=5)
