"""SparseLoCo as published (``topk_form="published"``): tiles, top-k, the statistical quantizer and its lookup
against a reference written tile by tile from the paper's description (``tests/sparseloco_reference.py``),
the bytes by hand, one rank, the error feedback's checkpoint state, and the settings refused at construction."""

import math

import pytest
import torch
from sparseloco_reference import compress, simulate, tiles_of

from lightning_commstrats import DiLoCoStrategy, SparseLoCoStrategy
from lightning_commstrats.comm.base import LocalCommunicator
from lightning_commstrats.compression import SparseAllGather, TensorExchange
from lightning_commstrats.compression.sparse_tiles import (
    StatisticalQuantizer,
    TiledSparseAllGather,
    thin_tiles,
    tile_spec,
)

SHAPES = {"emb": (100, 48), "w": (128, 192), "bias": (1024,), "conv": (10, 7, 3), "odd": (13,), "one": ()}


def _grads(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def test_tiles_are_the_largest_divisors_not_above_the_side():
    assert tiles_of((128, 192), 64)[1].tolist()[:3] == [64, 65, 66]  # the second tile: columns 64..127
    spec = tile_spec((10000, 256), 64)
    assert (spec.a, spec.b, spec.numel, spec.tiles) == (50, 64, 3200, 800)
    assert (tile_spec((1024,), 64).a, tile_spec((1024,), 64).b) == (1, 64)
    assert (tile_spec((10007, 256), 64).a, tile_spec((10, 7, 3), 64).b) == (1, 21)  # a prime: one row
    assert tile_spec((), 64).numel == 1
    lines = thin_tiles({"prime": (10007, 256), "emb": (10000, 256), "bias": (10007,)}, 64, 64)
    assert len(lines) == 1 and lines[0].startswith("prime (10007, 256): tiles of 1 x 64 keep 64 of 64 values (100.0%")


@pytest.mark.parametrize(("side", "k", "bits"), [(64, 64, 2), (8, 5, 2), (8, 5, 4), (16, 3, 8), (8, 5, 32)])
def test_one_round_matches_the_reference_tile_by_tile(side, k, bits):
    """One rank, one round: what the exchange sends (its average) and keeps (its error feedback) are the
    reference's: the same kept positions, the same decoded values (the statistics in float64 both, summed
    in another order: equal to a few float32 ulps)."""
    exchange = TiledSparseAllGather(LocalCommunicator(), tile=side, k=k, bits=bits, decay=0.95)
    grads = _grads(side + k + bits)
    out = exchange({n: t.clone() for n, t in grads.items()})
    assert exchange.nonfinite == []
    for name, g in grads.items():
        expected = torch.from_numpy(compress(g.numpy(), side, k, bits))
        assert torch.equal(out[name] != 0, expected != 0), name
        torch.testing.assert_close(out[name], expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(exchange.residuals[name], g - out[name], rtol=0, atol=0)
        tiles = tiles_of(g.shape, side)
        assert int((out[name] != 0).sum()) == sum(min(k, t.size) for t in tiles)
        if bits < 32:  # 2^bits distinct values at most: one lookup per tensor
            assert out[name][out[name] != 0].unique().numel() <= 2**bits


def test_the_quantizer_bins_six_standard_deviations_in_four_and_decodes_bin_means():
    # mean 0, std 1 (n - 1): width 1.5; bins below -2.25, [-2.25, -0.75), [-0.75, 0.75), from 0.75
    values = torch.tensor([-3.0, -1.0, -1.5, 0.0, 0.5, 1.0, 2.0, 2.0])
    values = (values - values.mean()) / values.std()
    q = StatisticalQuantizer(2, 6.0)
    ids, empty = torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.bool)
    codes, levels = q.quantize(values, ids, empty, 1)
    centred = values.double()
    expected = torch.clamp(torch.round(centred / 1.5 + 2), 0, 3)
    assert codes.tolist() == expected.long().tolist()
    for c in range(4):
        if (expected == c).any():
            assert levels[0, c].item() == pytest.approx(float(centred[expected == c].mean()), abs=1e-6)
    # an empty slot is left out of everything and decodes as 0; one value alone decodes as itself
    two, empty = torch.zeros(2, dtype=torch.long), torch.tensor([True, False])
    codes, levels = q.quantize(torch.tensor([0.0, 0.7]), two, empty, 1)
    assert q.decode(codes, two, levels, empty).tolist() == [0.0, pytest.approx(0.7)]


def test_error_feedback_over_rounds_matches_the_reference():
    beta = 0.9
    exchange = TiledSparseAllGather(LocalCommunicator(), tile=8, k=5, bits=2, decay=beta)
    rounds = [_grads(seed) for seed in range(3)]
    expected, residuals = simulate([[r] for r in rounds], side=8, k=5, beta=beta)
    for grads, want in zip(rounds, expected, strict=True):
        out = exchange({n: t.clone() for n, t in grads.items()})
        for name in grads:
            torch.testing.assert_close(out[name], want[name], rtol=1e-5, atol=1e-6)
    for name in SHAPES:
        torch.testing.assert_close(exchange.residuals[name], residuals[0, name], rtol=1e-5, atol=1e-6)


def test_kept_zeros_are_empty_slots_left_out_of_the_statistics():
    """A tile with fewer non-zero values than k keeps only those: no spurious values, and the zeros do
    not pull the mean, the spread or a bin's mean."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # tiles of 64 keeping 16, with 6 values that are not zero in one of them
        exchange = TiledSparseAllGather(LocalCommunicator(), tile=8, k=16)
        w = torch.randn(8, 16, generator=g)
        left = torch.zeros(64)
        left[torch.randperm(64, generator=g)[:6]] = torch.randn(6, generator=g)
        w[:, :8] = left.view(8, 8)
        out = exchange({"w": w.clone()})["w"]
        assert int((out[:, :8] != 0).sum()) == 6
        torch.testing.assert_close(out, torch.from_numpy(compress(w.numpy(), 8, 16)), rtol=1e-6, atol=1e-7)


def test_payload_bytes_by_hand():
    ex = TiledSparseAllGather(LocalCommunicator(), tile=64, k=64, bits=2)
    # a 128 x 192 matrix: 6 tiles of 64 x 64, 64 kept each: 6 low bits (4096 / 64) per position, a
    # vector of 64 + 64 bits per tile, 2 bits per code; 16 bytes of lookup (4 float32)
    per_tile = 64 * 6 // 8 + 128 // 8 + 64 * 2 // 8
    assert per_tile == 80
    assert ex.payload_bytes([(128, 192)]) == 16 + 6 * per_tile
    # a 1024-value bias: 16 runs of 64, every value kept: no positions at all, the codes in order
    assert ex.payload_bytes([(1024,)]) == 16 + 1024 * 2 // 8
    # 100 x 48: tiles of 50 x 48 (2400 values), 64 kept: 5 low bits (2400 / 64 = 37.5), a vector of 64 +
    # (2399 >> 5) + 1 = 139 bits per tile, the two tiles' vectors packed together (278 bits: 35 bytes)
    assert ex.payload_bytes([(100, 48)]) == 16 + math.ceil(128 * 5 / 8) + math.ceil(278 / 8) + 128 * 2 // 8
    # and the payload that travels is that long
    grads = {"a": torch.randn(128, 192), "b": torch.randn(1024), "c": torch.randn(100, 48)}
    sent = []
    comm = LocalCommunicator()
    gather = comm.all_gather
    comm.all_gather = lambda t, tag: sent.append(t.numel()) or gather(t, tag=tag)
    TiledSparseAllGather(comm, tile=64, k=64)(grads)
    assert sent == [ex.payload_bytes([(128, 192), (1024,), (100, 48)])]


def test_one_rank_runs_the_same_topk_and_error_feedback():
    """A quorum of one: the published form still sends its top-k (the average is what it kept) and keeps
    the rest in its error feedback; today's form leaves the tensor whole and keeps nothing."""
    grads = _grads(0)
    published = TensorExchange(LocalCommunicator(), 2, codec="topk", small_tensor_numel=0, topk_form="published")
    mine = {n: t.clone() for n, t in grads.items()}
    assert published.average(mine) == []
    for name, g in grads.items():
        torch.testing.assert_close(mine[name], torch.from_numpy(compress(g.numpy(), 64, 64)), rtol=1e-6, atol=1e-7)
    assert set(published.quantized.residuals) == set(SHAPES)  # every tensor, biases too
    assert not torch.equal(mine["w"], grads["w"])
    chunks = TensorExchange(LocalCommunicator(), 2, codec="topk")
    same = {n: t.clone() for n, t in grads.items()}
    assert chunks.average(same) == [] and all(torch.equal(same[n], grads[n]) for n in grads)
    assert chunks.quantized.residuals == {}


def test_a_non_finite_value_is_reported_and_leaves_the_error_feedback_as_it_was():
    exchange = TiledSparseAllGather(LocalCommunicator(), tile=8, k=4, decay=0.95)
    exchange({"w": torch.randn(8, 16), "v": torch.randn(16)})
    before = {n: r.clone() for n, r in exchange.residuals.items()}
    bad = torch.randn(8, 16)
    bad[3, 3] = math.nan
    out = exchange({"w": bad, "v": torch.randn(16)})
    assert exchange.nonfinite == ["w"] and not torch.isfinite(out["w"]).all()
    assert all(torch.equal(exchange.residuals[n], before[n]) for n in before)


def test_the_error_feedback_state_names_its_form_and_the_other_form_refuses_it():
    published = TensorExchange(LocalCommunicator(), 2, codec="topk", small_tensor_numel=0, topk_form="published")
    published.average({"w": torch.randn(8, 8)})
    state = published.state_dict()
    assert state["codec"] == "topk" and state["form"] == "published" and set(state["residuals"]) == {"w"}
    published.check_state(state, {"w": torch.Size([8, 8])})
    again = TensorExchange(LocalCommunicator(), 2, codec="topk", small_tensor_numel=0, topk_form="published")
    again.load_state_dict(state)
    assert torch.equal(again.quantized.residuals["w"], state["residuals"]["w"])
    chunks = TensorExchange(LocalCommunicator(), 2, codec="topk", topk_chunk=16, topk_per_chunk=4)
    with pytest.raises(ValueError, match="topk_form='published', this run's topk_form is 'chunks'"):
        chunks.check_state(state, {"w": torch.Size([8, 8])})
    chunks.quantized({"w": torch.randn(8, 8)})
    old = {k: v for k, v in chunks.state_dict().items() if k != "form"}  # saved before there were two forms
    chunks.check_state(old, {"w": torch.Size([8, 8])})
    with pytest.raises(ValueError, match="topk_form='chunks', this run's topk_form is 'published'"):
        published.check_state(old, {"w": torch.Size([8, 8])})
    assert isinstance(published.quantized, SparseAllGather)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SparseLoCoStrategy(topk_form="tiles"), "topk_form='tiles' is not supported"),
        (lambda: SparseLoCoStrategy(topk_form="published", topk_chunk=4096), "topk_chunk=4096 applies to"),
        (lambda: SparseLoCoStrategy(topk_tile=64), "topk_tile=64 applies to topk_form='published'"),
        (lambda: SparseLoCoStrategy(topk_sigmas=3.0), "topk_sigmas=3.0 applies to topk_form='published'"),
        (lambda: SparseLoCoStrategy(topk_form="published", topk_tile=0), "topk_tile must be an int >= 1"),
        (lambda: SparseLoCoStrategy(topk_form="published", topk_tile=2.5), "topk_tile must be an int >= 1"),
        (
            lambda: SparseLoCoStrategy(topk_form="published", topk_tile=8, topk_per_chunk=65),
            "topk_per_chunk must be an int in [1, topk_tile^2=64]",
        ),
        (lambda: SparseLoCoStrategy(topk_form="published", topk_per_chunk=0), "topk_per_chunk must be an int in"),
        (lambda: SparseLoCoStrategy(topk_form="published", topk_sigmas=-1), "topk_sigmas must be a number > 0"),
        (lambda: SparseLoCoStrategy(topk_form="published", pseudo_grad_bits=16), "pseudo_grad_bits=16"),
        (lambda: DiLoCoStrategy(pseudo_grad_bits=4, topk_form="published"), "applies to pseudo_grad_codec='topk'"),
    ],
)
def test_bad_settings_are_refused_at_construction_naming_the_setting(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert message in str(info.value)


def test_the_published_preset():
    s = SparseLoCoStrategy(topk_form="published")
    assert (s.topk_form, s.topk_tile, s.topk_per_chunk, s.topk_sigmas, s.small_tensor_numel) == (
        "published",
        64,
        64,
        6.0,
        0,
    )
    assert (s.error_feedback_decay, s.pseudo_grad_bits, s.sync_period) == (0.95, 2, 30)
    assert SparseLoCoStrategy().topk_form == "chunks" and SparseLoCoStrategy().small_tensor_numel == 1024
    assert SparseLoCoStrategy(topk_form="published", small_tensor_numel=1024).small_tensor_numel == 1024
