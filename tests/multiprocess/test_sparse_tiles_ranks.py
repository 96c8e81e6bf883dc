"""SparseLoCo as published (``topk_form="published"``) on real ranks: every average against the reference
simulated here for all ranks (``tests/sparseloco_reference.py``: tiles, top-k, the statistical quantizer's
bin means, decayed error feedback, the mean in rank order), the same weights on every rank, the bytes by
hand, and a checkpoint taken while an exchange is in flight resumed to the uninterrupted run's weights."""

import pytest
import torch
from harness import run_ranks
from sparseloco_reference import simulate

pytestmark = pytest.mark.multiprocess

TILE, K, BETA = 8, 4, 0.9
PUBLISHED = {
    "sync_period": 4,
    "topk_form": "published",
    "topk_tile": TILE,
    "topk_per_chunk": K,
    "error_feedback_decay": BETA,
}


def _flat(named):
    return torch.cat([t.reshape(-1) for t in named.values()])


def test_published_averages_weights_and_bytes_on_three_ranks():
    scenarios = {
        "blocking": {
            "strategy": "sparseloco",
            "devices": 3,
            "kwargs": {**PUBLISHED, "fragment_sync_delay": 0},
            "record_exchange": True,
            "state_trace": True,
        },
        "streamed": {
            "strategy": "sparseloco",
            "devices": 3,
            "kwargs": {**PUBLISHED, "num_fragments": 2, "fragment_sync_delay": 1},
            "record_exchange": True,
        },
    }
    world = 3
    results = run_ranks({"scenarios": scenarios}, world)
    for name in scenarios:  # the same weights on every rank after the syncs
        for res in results[1:]:
            for key, value in res[name]["params"].items():
                assert torch.equal(value, results[0][name]["params"][key]), (name, key)

    for name in scenarios:
        recorded = [r[name]["exchanges"] for r in results]
        # blocking: syncs after steps 4 and 8; streamed: fragment 0 at 2 and 6, fragment 1 at 4 and 8, and
        # fragment 0 once more at the end of fit (the recorded step is read in the exchange's thread, later)
        assert len(recorded[0]) == (2 if name == "blocking" else 5)
        if name == "blocking":
            assert [e["step"] for e in recorded[0]] == [4, 8]
        by_fragment: dict[tuple[str, ...], list[int]] = {}
        for k, e in enumerate(recorded[0]):
            by_fragment.setdefault(tuple(e["mine"]), []).append(k)
        for ks in by_fragment.values():
            syncs = [[recorded[r][k]["mine"] for r in range(world)] for k in ks]
            expected, _ = simulate(syncs, side=TILE, k=K, beta=BETA)
            for j, k in enumerate(ks):
                for rank in range(world):
                    for key, value in recorded[rank][k]["avg"].items():  # every tensor sparse, biases too
                        assert torch.equal(value != 0, expected[j][key] != 0), (name, k, key)
                        torch.testing.assert_close(value, expected[j][key], rtol=1e-5, atol=1e-7)
                    assert torch.equal(_flat(recorded[rank][k]["avg"]), _flat(recorded[0][k]["avg"]))
                dense_mean = torch.stack([_flat(recorded[r][k]["mine"]) for r in range(world)]).mean(0)
                assert not torch.allclose(_flat(expected[j]), dense_mean)  # really sparse

    # the outer step: plain SGD at lr 1, global = global - average
    states = results[0]["blocking"]["states"]
    exchanges = results[0]["blocking"]["exchanges"]
    before = torch.cat(states[2]["state"]["outer"]["weights"])
    after = torch.cat(states[3]["state"]["outer"]["weights"])
    assert torch.equal(after, before - _flat(exchanges[0]["avg"]))

    # bytes by hand, per sync and rank. Tiles of up to 8 x 8 keeping 4: layer.0.weight [16, 32] is 8
    # tiles of 64 values (4 low bits per position, as 64 / 4 = 2^4: 32 x 4 bits = 16 bytes; a vector of
    # 4 + 3 + 1 = 8 bits per tile: 8 bytes); layer.0.bias [16] 2 runs of 8 (1 low bit: 1 byte; 2
    # vectors of 4 + 3 + 1 bits: 2 bytes); layer.2.weight [2, 16] 2 tiles of 2 x 8 (2 low bits: 2
    # bytes; 2 vectors of 4 + 3 + 1: 2 bytes); layer.2.bias [2] one run of 2, kept whole (no
    # positions). 32 + 8 + 8 + 2 = 50 codes of 2 bits: 13 bytes. A lookup of 4 float32 per tensor: 64
    # bytes. 64 + 24 + 3 + 4 + 13 = 108; a ring all-gather sends the two
    # other ranks' payloads; nothing dense (every tensor sparse), no gradient traffic.
    payload = 64 + (16 + 8) + (1 + 2) + (2 + 2) + 13
    for res in results:
        stats = res["blocking"]["stats"]
        assert stats["weights_sparse/bytes_sent"] == 2 * (world - 1) * payload
        assert stats.get("weights/bytes_sent", 0) == 0
        assert stats.get("grad/bytes_sent", 0) == 0


def test_published_resumes_from_a_checkpoint_taken_with_an_exchange_in_flight():
    # 32 steps per epoch on 2 ranks: the checkpoint after step 32 is at an epoch's end (a mid-epoch resume
    # would train on other batches). The default overlap: the exchange launched after step 32 lands after
    # step 33, so the checkpoint holds it in flight, every rank's error feedback (every tensor's) and the
    # weights it was launched from
    kw = {**PUBLISHED, "fragment_sync_delay": 1}
    scenarios = {
        "straight": {"strategy": "sparseloco", "kwargs": kw, "max_steps": 40, "ckpt_every": 32},
        "resumed": {"strategy": "sparseloco", "kwargs": kw, "max_steps": 40, "resume": ["straight", 32]},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        saved = res["straight"]["checkpoint"]["mine"]
        assert saved["exchange"]["form"] == "published" and saved["launched"] is not None
        residuals = saved["exchange"]["residuals"]
        assert set(residuals) == {"layer.0.weight", "layer.0.bias", "layer.2.weight", "layer.2.bias"}
        assert all(bool(r.abs().sum() > 0) for r in residuals.values())
        for key, value in res["resumed"]["params"].items():  # bit for bit
            assert torch.equal(value, res["straight"]["params"][key]), key
    mine, theirs = (r["straight"]["checkpoint"]["mine"]["exchange"]["residuals"] for r in results)
    assert not torch.equal(mine["layer.0.weight"], theirs["layer.0.weight"])  # rank-local
