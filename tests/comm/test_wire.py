import math

import pytest

from lightning_commstrats.comm import wire


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("numel", [1000, 1001, 1])
def test_all_reduce_bytes_is_the_ring_formula(numel, world_size):
    chunk = math.ceil(numel / world_size)
    assert wire.all_reduce_bytes(numel, 4, world_size) == 2 * (world_size - 1) * chunk * 4
    if numel % world_size == 0:
        assert wire.all_reduce_bytes(numel, 4, world_size) == 2 * (world_size - 1) * numel * 4 // world_size


def test_ring_all_reduce_per_rank_volume_is_nearly_constant_in_world_size():
    k = 2**20
    volumes = [wire.all_reduce_bytes(k, 4, n) for n in (2, 4, 8)]
    assert volumes == [4 * k, 6 * k, 7 * k]  # 2(N-1)/N * 4K bytes: bounded by 2 x the buffer


def test_one_rank_sends_nothing():
    assert wire.all_reduce_bytes(10, 4, 1) == 0
    assert wire.reduce_scatter_bytes(10, 4, 1) == 0
    assert wire.all_gather_bytes(10, 4, 1) == 0
    assert wire.broadcast_bytes(10, 4, 0, 0, 1) == 0


def test_reduce_scatter_plus_all_gather_is_all_reduce():
    for n in (2, 3, 4, 8):
        k = 96
        assert wire.reduce_scatter_bytes(k, 2, n) + wire.all_gather_bytes(k // n, 2, n) == wire.all_reduce_bytes(
            k, 2, n
        )


@pytest.mark.parametrize("world_size", range(1, 10))
@pytest.mark.parametrize("src", [0, 3])
def test_binomial_broadcast_delivers_each_rank_exactly_once(world_size, src):
    src = src % world_size
    children = [wire.binomial_children(r, src, world_size) for r in range(world_size)]
    assert sum(children) == world_size - 1
    assert children[src] == math.ceil(math.log2(world_size)) if world_size > 1 else children[src] == 0


def test_all_to_all_counts_only_what_leaves_the_rank():
    assert wire.all_to_all_bytes([3, 0, 5, 2], 4, rank=2) == (3 + 0 + 2) * 4
    with pytest.raises(ValueError, match="rank"):
        wire.all_to_all_bytes([1, 2], 4, rank=2)
