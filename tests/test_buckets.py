import pytest
import torch

from lightning_commstrats.buckets import flatten, plan_buckets, unflatten_into


def test_buckets_respect_cap_dtype_and_order():
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(30), torch.zeros(5)]
    plan = plan_buckets(ts, cap_bytes=80)
    assert plan == [[0, 1], [2], [3], [4]]
    assert sorted(i for b in plan for i in b) == list(range(len(ts)))
    for b in plan:
        assert len({ts[i].dtype for i in b}) == 1


def test_flatten_round_trip():
    ts = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 1, 2)]
    flat = flatten(ts)
    targets = [torch.empty_like(t) for t in ts]
    unflatten_into(flat, targets)
    for a, b in zip(ts, targets, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="flat buffer has"):
        unflatten_into(torch.zeros(100), targets)


def test_cap_must_be_positive():
    with pytest.raises(ValueError, match="bucket cap"):
        plan_buckets([torch.zeros(1)], 0)
