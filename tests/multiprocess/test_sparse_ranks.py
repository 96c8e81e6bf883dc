"""SparseLoCo on real ranks: every sparse average against SparseLoCo's equations simulated here for all ranks
(top-k per chunk, sign-and-magnitude codes, decayed error feedback, the sum in rank order), the outer step
without momentum, the bytes by hand, and the streamed, delayed form."""

import math

import numpy as np
import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

CHUNK, K, BETA = 64, 8, 0.9


def quantized(values: np.ndarray) -> np.ndarray:
    """2 bits: the sign, and whether the magnitude is in the upper half of [least, largest] kept
    magnitude; rebuilt at that half's centre (float32 throughout, one rounding per operation)."""
    mags = np.abs(values).astype(np.float32)
    lo, hi = mags.min(), mags.max()
    step = np.float32(np.float32(hi - lo) / np.float32(2))
    inv = np.float32(1.0) / step if step > 0 else np.float32(0.0)
    level = np.clip(np.floor(np.float32(mags - lo) * inv), 0, 1).astype(np.float32)
    rebuilt = np.float32((level + np.float32(0.5)) * step) + lo
    return np.where(values < 0, -rebuilt, rebuilt).astype(np.float32)


def sent(e: torch.Tensor) -> torch.Tensor:
    """What a rank sends of its buffer ``e``: per chunk of CHUNK values (the last zero-padded), the K
    largest magnitudes, quantized; zeros elsewhere."""
    flat = np.zeros(-(-e.numel() // CHUNK) * CHUNK, dtype=np.float32)
    flat[: e.numel()] = e.reshape(-1).numpy()
    out = np.zeros_like(flat)
    for c in range(flat.size // CHUNK):
        row = flat[c * CHUNK : (c + 1) * CHUNK]
        kept = np.sort(np.argsort(-np.abs(row), kind="stable")[:K])
        out[c * CHUNK + kept] = quantized(row[kept])
    return torch.from_numpy(out[: e.numel()]).view(e.shape)


def simulate(syncs: list[list[dict[str, torch.Tensor]]]) -> list[dict[str, torch.Tensor]]:
    """``syncs[k][r]``: rank r's pseudo-gradient at sync k. Matrices: e = BETA e + G; s = Q(topk(e));
    e -= s; the average is ((0 + s_0) + s_1 + ...) / N. Tensors of at most 16 values: the plain mean."""
    n = len(syncs[0])
    residual: dict[tuple[int, str], torch.Tensor] = {}
    out = []
    for by_rank in syncs:
        avg = {}
        for name, first in by_rank[0].items():
            if first.numel() <= 16:  # small_tensor_numel: dense
                avg[name] = sum(g[name] for g in by_rank) / n
                continue
            total = torch.zeros_like(first)
            for r in range(n):
                e = residual.get((r, name), torch.zeros_like(first)) * BETA + by_rank[r][name]
                s = sent(e)
                residual[r, name] = e - s
                total = total + s
            avg[name] = total / n
        out.append(avg)
    return out


def _flat(named):
    return torch.cat([t.reshape(-1) for t in named.values()])


def test_sparseloco_averages_bytes_and_outer_step_on_three_ranks():
    sparse = {"sync_period": 4, "topk_chunk": CHUNK, "topk_per_chunk": K, "error_feedback_decay": BETA}
    scenarios = {
        "sparse": {
            "strategy": "sparseloco",
            "devices": 3,
            "kwargs": {**sparse, "small_tensor_numel": 16, "fragment_sync_delay": 0},
            "record_exchange": True,
            "state_trace": True,
        },
        "streamed": {
            "strategy": "sparseloco",
            "devices": 3,
            "kwargs": {**sparse, "small_tensor_numel": 16, "num_fragments": 2, "fragment_sync_delay": 1},
            "record_exchange": True,
            "state_trace": True,
        },
    }
    world = 3
    results = run_ranks({"scenarios": scenarios}, world)
    for name in scenarios:
        for res in results[1:]:
            for key, value in res[name]["params"].items():
                assert torch.equal(value, results[0][name]["params"][key]), (name, key)

    # every average: SparseLoCo's equations for all ranks, bit for bit, the same on every rank
    for name in scenarios:
        recorded = [r[name]["exchanges"] for r in results]
        calls = len(recorded[0])
        # 8 steps: syncs after steps 4 and 8; streamed, fragment 0 at 2 and 6, fragment 1 at 4 and 8, and
        # fragment 0 once more at the end of fit (it trained after its last sync)
        steps = [e["step"] for e in recorded[0]]
        assert steps == ([4, 8] if name == "sparse" else [2, 4, 6, 8, 8]), steps
        by_fragment: dict[tuple[str, ...], list[int]] = {}
        for k in range(calls):
            by_fragment.setdefault(tuple(recorded[0][k]["mine"]), []).append(k)
        for ks in by_fragment.values():
            expected = simulate([[recorded[r][k]["mine"] for r in range(world)] for k in ks])
            for j, k in enumerate(ks):
                for rank in range(world):
                    for key, value in recorded[rank][k]["avg"].items():
                        if value.numel() <= 16:  # the fp32 all-reduce: gloo's order of summation, not ours
                            torch.testing.assert_close(value, expected[j][key], atol=1e-6, rtol=0)
                        else:
                            assert torch.equal(value, expected[j][key]), (name, k, key)
                dense_mean = torch.stack([_flat(recorded[r][k]["mine"]) for r in range(world)]).mean(0)
                assert not torch.equal(_flat(expected[j]), dense_mean)  # really sparse

    # the outer step: plain SGD at lr 1 without momentum, global = global - average
    states = results[0]["sparse"]["states"]
    exchanges = results[0]["sparse"]["exchanges"]
    before = torch.cat(states[2]["state"]["outer"]["weights"])
    after = torch.cat(states[3]["state"]["outer"]["weights"])
    assert exchanges[0]["step"] == 4
    assert torch.equal(after, before - _flat(exchanges[0]["avg"]))

    # bytes by hand, per sync: layer.0.weight [16, 32] is 8 chunks of 64, layer.2.weight [2, 16] one
    # padded chunk; a chunk's payload is 8 bytes of scales, 8 positions in Elias-Fano (3 low bits
    # each, as 64 / 8 = 2^3: 3 bytes; a vector of 8 + 8 bits: 2 bytes) and 8 codes of 2 bits (2
    # bytes); a ring all-gather sends the two other ranks' payloads: 2 x 135.
    # The 18 bias values go in an fp32 ring all-reduce: 2 (N-1) ceil(18/3) x 4 bytes.
    for res in results:
        stats = res["sparse"]["stats"]
        assert stats["weights_sparse/bytes_sent"] == 2 * (world - 1) * 9 * (8 + 3 + 2 + 2)
        assert stats["weights/bytes_sent"] == 2 * 2 * (world - 1) * math.ceil(18 / world) * 4
        assert stats.get("grad/bytes_sent", 0) == 0
