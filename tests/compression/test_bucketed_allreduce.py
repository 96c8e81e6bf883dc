"""The fused all-reduce keeps its flat buffers from one step to the next: same storage while the
layout holds, new buffers when it changes, the same averages as a fresh concatenation."""

from __future__ import annotations

import pytest
import torch

from lightning_commstrats.buckets import FlatBuffers, plan_buckets
from lightning_commstrats.comm import Communicator
from lightning_commstrats.compression import BucketedAllReduce


class OnePeer(Communicator):
    """Rank 0 of 2 whose peer holds ``peer`` in every element: the sum is ``x + peer``. Records the
    storage of every buffer handed to the backend."""

    def __init__(self, peer: float = 1.0) -> None:
        super().__init__(rank=0, world_size=2)
        self.peer = peer
        self.storages: list[int] = []

    def _all_reduce(self, tensor, op):
        self.storages.append(tensor.data_ptr())
        tensor.add_(self.peer)

    def _reduce_scatter(self, out, tensor, op):
        raise AssertionError("not used")

    _all_gather = _all_to_all = _broadcast = _reduce_scatter

    def _barrier(self):
        pass


def grads(seed: int, shapes=((16, 8), (8,), (4, 3, 2), (5,))) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def test_buffers_are_reused_across_steps_and_averages_unchanged():
    comm = OnePeer()
    fused = BucketedAllReduce(comm, cap_bytes=200)  # several buckets
    plan_len = len(plan_buckets(grads(0), 200))
    assert plan_len > 1
    kept = None
    for step in range(3):
        tensors = grads(step)
        expected = [(t + 1.0) / 2 for t in tensors]
        fused(tensors, tag="grad")
        for t, e in zip(tensors, expected, strict=True):
            assert torch.equal(t, e)
        # holding the first step's buffers keeps their memory from being handed out again, so a
        # new allocation could not come back at the same address
        kept = kept or fused.buffers("grad")
        assert comm.storages[-plan_len:] == [f.data_ptr() for f in kept.flats]  # nothing concatenated anew
    assert fused.buffers("grad") is kept


def test_buffers_are_rebuilt_when_the_layout_changes():
    comm = OnePeer()
    fused = BucketedAllReduce(comm, cap_bytes=1 << 20)
    fused(grads(0), tag="grad")
    first = fused.buffers("grad")
    fused(grads(1), tag="grad")
    assert fused.buffers("grad") is first
    other = grads(2, shapes=((16, 8), (9,), (4, 3, 2), (5,)))  # one shape differs
    expected = [(t + 1.0) / 2 for t in other]
    fused(other, tag="grad")
    assert fused.buffers("grad") is not first and fused.buffers("grad").flats[0].numel() == 128 + 9 + 24 + 5
    for t, e in zip(other, expected, strict=True):
        assert torch.equal(t, e)
    doubles = [t.double() for t in grads(3)]  # another dtype
    fused(doubles, tag="grad")
    assert fused.buffers("grad").flats[0].dtype == torch.float64


def test_each_tag_keeps_its_own_buffers_and_release_drops_them():
    fused = BucketedAllReduce(OnePeer(), cap_bytes=1 << 20)
    fused(grads(0), tag="grad")
    fused([torch.zeros(3)], tag="buffers")
    grad_buffers = fused.buffers("grad")
    fused(grads(1), tag="grad")
    assert fused.buffers("grad") is grad_buffers and fused.buffers("buffers").flats[0].numel() == 3
    fused.release("grad")
    assert fused.buffers("grad") is None and fused.buffers("buffers") is not None
    fused.release()
    assert fused.buffers("buffers") is None


def test_without_keep_buffers_nothing_is_held():
    fused = BucketedAllReduce(OnePeer(), cap_bytes=1 << 20, keep_buffers=False)
    tensors = grads(0)
    expected = [(t + 1.0) / 2 for t in tensors]
    fused(tensors, tag="weights")
    assert fused.buffers("weights") is None
    for t, e in zip(tensors, expected, strict=True):
        assert torch.equal(t, e)


def test_non_contiguous_tensors_and_an_exchange_that_returns_a_new_tensor():
    fused = BucketedAllReduce(OnePeer(), cap_bytes=1 << 20)
    base = torch.randn(6, 4)
    t = base.t()  # non-contiguous
    u = torch.randn(3)
    expected_t, expected_u = t * 2, u * 2
    fused([t, u], tag="grad", exchange=lambda flat, idx: flat * 2)
    assert torch.equal(t, expected_t) and torch.equal(u, expected_u)
    assert torch.equal(base, expected_t.t())


def test_flat_buffers_never_join_an_autograd_graph():
    w = torch.randn(4, requires_grad=True)
    y = w * 3  # a tensor with history
    buffers = FlatBuffers([y], [[0]])
    flat = buffers.fill(0, [y])
    assert not flat.requires_grad and flat.grad_fn is None
    torch.testing.assert_close(flat, y.detach())


@pytest.mark.parametrize("finite", [True, False])
def test_finite_flags_per_bucket(finite):
    fused = BucketedAllReduce(OnePeer(), cap_bytes=1 << 20)
    tensors = grads(0)
    if not finite:
        tensors[1][0] = float("inf")
    flags: list[torch.Tensor] = []
    fused(tensors, tag="grad", finite_flags=flags)
    assert len(flags) == 1 and bool(flags[0]) is finite
