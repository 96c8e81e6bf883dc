"""How many values travel: the density schedule's kept counts at given syncs, the published form's payload
as the count changes (bytes by hand), the dense statistical codec against a reference written here from
the quantizer's description (flat, per tensor, no tiles), and the settings refused at construction."""

import math
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from sparseloco_reference import dense_reference, simulate

from lightning_commstrats import DiLoCoStrategy, SparseLoCoStrategy
from lightning_commstrats.comm.base import LocalCommunicator
from lightning_commstrats.compression import TensorExchange
from lightning_commstrats.compression.density import DensitySchedule, StatisticalAllGather
from lightning_commstrats.compression.sparse_tiles import TiledSparseAllGather

SHAPES = {"emb": (100, 48), "w": (128, 192), "bias": (1024,), "odd": (13,)}


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def test_the_named_schedules_kept_counts_at_given_syncs():
    geometric = DensitySchedule("geometric", 64, 4096)
    assert [geometric.kept(p) for p in range(6)] == [4096, 1024, 256, 64, 64, 64]
    assert geometric.kept(10_000) == 64 and geometric.dense_syncs() == 3
    run = DensitySchedule("run", 64, 4096)
    # a run of 36 syncs: three steps above 64, each held 36 // (4 * 3) = 3 syncs (the first quarter of the run)
    assert [run.kept(p, 36) for p in range(11)] == [4096] * 3 + [1024] * 3 + [256] * 3 + [64] * 2
    assert [run.kept(p, 12) for p in range(4)] == [4096, 1024, 256, 64]  # 12 syncs: as geometric
    assert run.kept(5, None) == 64 and run.dense_syncs(36) == 9
    assert [run.kept(p, 1200) for p in (0, 99, 100, 199, 200, 299, 300)] == [4096, 4096, 1024, 1024, 256, 256, 64]
    explicit = DensitySchedule([4096, 512, 512], 64, 4096)
    assert [explicit.kept(p) for p in range(5)] == [4096, 512, 512, 64, 64] and explicit.dense_syncs() == 3
    assert [DensitySchedule(None, 64, 4096).kept(p) for p in range(3)] == [64, 64, 64]
    assert [DensitySchedule("geometric", 10, 64).kept(p) for p in range(4)] == [64, 16, 10, 10]


def test_a_changing_kept_count_sends_what_the_reference_keeps_and_is_charged_its_bytes():
    """One rank, three rounds at 4096, 1024 and 64 kept per 64 x 64 tile: the averages and the error
    feedback are the reference's, and each round's payload is its own size, counted by hand."""
    comm = LocalCommunicator()
    sent: list[int] = []
    gather = comm.all_gather
    comm.all_gather = lambda t, tag: sent.append(t.numel()) or gather(t, tag=tag)
    exchange = TiledSparseAllGather(comm, tile=64, k=64, decay=0.95)
    ks = [4096, 1024, 64]
    rounds = [_grads(s) for s in range(3)]
    out = []
    for k, grads in zip(ks, rounds, strict=True):
        exchange.k = k
        out.append(exchange({n: t.clone() for n, t in grads.items()}))
    expected, residuals = simulate([[g] for g in rounds], side=64, k=ks, beta=0.95)
    for j in range(3):
        for name in SHAPES:
            torch.testing.assert_close(out[j][name], expected[j][name], rtol=1e-5, atol=1e-6)
    for name in SHAPES:
        torch.testing.assert_close(exchange.residuals[name], residuals[0, name], rtol=1e-5, atol=1e-6)
    # by hand: 4 tensors, a lookup of 4 float32 each (64 bytes). emb 100 x 48: 2 tiles of 50 x 48 (2400
    # values); w 128 x 192: 6 tiles of 64 x 64; bias: 16 runs of 64; odd: one run of 13.
    # 4096 kept: every tile whole, no positions; 4800 + 24576 + 1024 + 13 = 30413 codes of 2 bits
    dense = 64 + math.ceil(30413 * 2 / 8)
    # 1024 kept: emb keeps 1024 of 2400 (1 low bit: 2400 / 1024 = 2.3; a vector of 1024 + (2399 >> 1) + 1 =
    # 2224 bits per tile), w 1024 of 4096 (2 low bits; 1024 + (4095 >> 2) + 1 = 2048 bits per tile); bias
    # and odd whole. Codes: 2 * 1024 + 6 * 1024 + 1024 + 13
    emb = math.ceil(2 * 1024 * 1 / 8) + math.ceil(2 * 2224 / 8)
    w = math.ceil(6 * 1024 * 2 / 8) + math.ceil(6 * 2048 / 8)
    mid = 64 + emb + w + math.ceil((2 * 1024 + 6 * 1024 + 1024 + 13) * 2 / 8)
    # 64 kept: emb 5 low bits (2400 / 64 = 37.5; 64 + (2399 >> 5) + 1 = 139 bits per tile), w 6 low bits
    # (64 + 63 + 1 = 128 bits per tile), bias keeps its runs whole (64 of 64), odd whole
    emb = math.ceil(2 * 64 * 5 / 8) + math.ceil(2 * 139 / 8)
    w = math.ceil(6 * 64 * 6 / 8) + math.ceil(6 * 128 / 8)
    sparse = 64 + emb + w + math.ceil((2 * 64 + 6 * 64 + 1024 + 13) * 2 / 8)
    assert sent == [dense, mid, sparse]
    assert [exchange.payload_bytes(list(SHAPES.values())) for exchange.k in ks] == sent
    assert comm.stats.bytes_sent == 0  # one rank: nothing crosses a wire (the sizes are what would)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_dense_statistical_codec_matches_the_flat_reference_over_rounds(bits):
    """Every value of every tensor sent on the tensor's statistical grid: the average (one rank) is the
    flat reference's, and the error feedback ``e = 0.95 e + G, e -= Q(e)`` carries over three rounds."""
    exchange = StatisticalAllGather(LocalCommunicator(), bits=bits, decay=0.95)
    e = {n: np.zeros(s, dtype=np.float32) for n, s in SHAPES.items()}
    for r in range(3):
        grads = _grads(10 + r)
        out = exchange({n: t.clone() for n, t in grads.items()})
        for name, g in grads.items():
            acc = e[name] * np.float32(0.95) + g.numpy() if r else g.numpy().copy()
            q = dense_reference(acc, bits)
            e[name] = acc - q
            torch.testing.assert_close(out[name], torch.from_numpy(q), rtol=1e-5, atol=1e-6)
            assert out[name].unique().numel() <= 2**bits
            torch.testing.assert_close(exchange.residuals[name], torch.from_numpy(e[name]), rtol=1e-5, atol=1e-6)


def test_the_dense_statistical_codec_sends_two_bits_a_value_and_a_lookup_per_tensor():
    comm = LocalCommunicator()
    sent: list[int] = []
    gather = comm.all_gather
    comm.all_gather = lambda t, tag: sent.append(t.numel()) or gather(t, tag=tag)
    StatisticalAllGather(comm)(_grads(0))
    # 4 tensors x 4 float32 = 64 bytes; 4800 + 24576 + 1024 + 13 = 30413 values x 2 bits = 7603.25 bytes
    assert sent == [64 + 7604]
    # in the exchange: tensors of at most small_tensor_numel values go in fp32 all-reduces
    ex = TensorExchange(LocalCommunicator(), 2, codec="statistical", small_tensor_numel=1024, error_feedback_decay=0.95)
    assert isinstance(ex.quantized, StatisticalAllGather) and ex.quantized.decay == 0.95
    assert (
        ex.quantizes(torch.zeros(100, 48)) and ex.quantizes(torch.zeros(2048)) and not ex.quantizes(torch.zeros(1024))
    )
    state = StatisticalAllGather(LocalCommunicator())
    state({"w": torch.randn(8, 8)})
    published = TensorExchange(LocalCommunicator(), 2, codec="topk", topk_form="published")
    with pytest.raises(ValueError, match="topk_form='statistical', this run's topk_form is 'published'"):
        published.check_state(state.state_dict(), {"w": torch.Size([8, 8])})


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SparseLoCoStrategy(topk_schedule="run"), "topk_schedule='run' applies to topk_form='published'"),
        (lambda: SparseLoCoStrategy(topk_form="published", topk_schedule="fast"), "topk_schedule='fast' is not"),
        (
            lambda: SparseLoCoStrategy(topk_form="published", topk_schedule=[4096, 0]),
            "topk_schedule must be None, one of ('geometric', 'run'), or a non-empty list of ints in [1, 4096]",
        ),
        (lambda: SparseLoCoStrategy(topk_form="published", topk_tile=8, topk_schedule=[65]), "ints in [1, 64]"),
        (lambda: SparseLoCoStrategy(topk_form="published", topk_schedule=[]), "a non-empty list"),
        (lambda: SparseLoCoStrategy(topk_form="published", topk_schedule=512), "a non-empty list"),
        (lambda: DiLoCoStrategy(pseudo_grad_codec="statistical", pseudo_grad_bits=32), "'statistical' sends every"),
        (lambda: DiLoCoStrategy(pseudo_grad_codec="statistical", pseudo_grad_bits=16), "got pseudo_grad_bits=16"),
        (
            lambda: DiLoCoStrategy(pseudo_grad_bits=4, error_feedback_decay=0.9),
            "applies to pseudo_grad_codec='topk' or",
        ),
        (lambda: SparseLoCoStrategy(pseudo_grad_codec="statistical"), "use DiLoCoStrategy for the dense codecs"),
    ],
)
def test_bad_settings_are_refused_at_construction_naming_the_setting(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert message in str(info.value)


def _fit(strategy, steps):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
    return [str(w.message) for w in caught if "syncs" in str(w.message)]


def test_a_run_too_short_for_sparse_error_feedback_is_warned_naming_its_syncs():
    short = _fit(SparseLoCoStrategy(sync_period=4, fragment_sync_delay=0), 12)
    assert len(short) == 1 and "this fit will have 3 syncs (12 optimizer steps, sync_period=4 steps)" in short[0]
    assert "keeping 64 of 4096 values per chunk, the error feedback needs about 64 syncs" in short[0]
    assert "topk_schedule='run'" in short[0]
    published = _fit(SparseLoCoStrategy(sync_period=4, topk_form="published", topk_tile=8, topk_per_chunk=4), 12)
    assert len(published) == 1 and "keeping 4 of 64 values per tile, the error feedback needs about 16" in published[0]
    scheduled = SparseLoCoStrategy(
        sync_period=4, topk_form="published", topk_tile=8, topk_per_chunk=4, topk_schedule="run"
    )
    assert _fit(scheduled, 12) == [] and scheduled.run_syncs == 3
    long_enough = SparseLoCoStrategy(sync_period=1, topk_form="published", topk_tile=8, topk_per_chunk=4)
    assert _fit(long_enough, 16) == []


def test_the_schedule_counts_each_fragments_syncs_and_a_checkpoint_without_the_count_implies_it():
    strategy = SparseLoCoStrategy(
        sync_period=8,
        num_fragments=2,
        fragment_sync_delay=0,
        topk_schedule="geometric",
        topk_form="published",
        topk_tile=8,
        topk_per_chunk=4,
    )
    assert strategy.density_syncs == [0, 0]
    # fragment 0 syncs 4 steps in, then every 8; fragment 1 8 steps in: by step 20, 3 and 2 syncs launched
    strategy.optimizer_steps = 20
    assert strategy._progress_counts() == [3, 2]
    strategy.optimizer_steps = 3
    assert strategy._progress_counts() == [0, 0]
    assert strategy.state_dict()["density_syncs"] == [0, 0]
