"""A density schedule and the dense statistical codec on real ranks: every average against references
simulated here for all ranks (the schedule: ``tests/sparseloco_reference.py`` with a kept count per sync;
the dense codec: the flat reference of ``tests/compression/test_density.py``), the same weights on every
rank bit for bit, the bytes of a payload whose size changes from sync to sync counted by hand, and a
checkpoint taken mid-schedule resumed to the uninterrupted run's weights."""

import numpy as np
import pytest
import torch
from harness import run_ranks
from sparseloco_reference import dense_reference, simulate

pytestmark = pytest.mark.multiprocess

TILE, K, BETA = 8, 4, 0.9
SCHEDULED = {
    "sync_period": 4,
    "topk_form": "published",
    "topk_tile": TILE,
    "topk_per_chunk": K,
    "error_feedback_decay": BETA,
    "topk_schedule": [64, 16],
    "fragment_sync_delay": 0,
}
STATISTICAL = {
    "sync_period": 4,
    "pseudo_grad_codec": "statistical",
    "pseudo_grad_bits": 2,
    "error_feedback_decay": BETA,
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "small_tensor_numel": 0,
}


def _flat(named):
    return torch.cat([t.reshape(-1) for t in named.values()])


def test_a_schedule_and_the_dense_codec_average_as_the_references_and_bytes_match_by_hand():
    scenarios = {
        "scheduled": {"strategy": "sparseloco", "kwargs": SCHEDULED, "max_steps": 12, "record_exchange": True},
        "statistical": {"strategy": "diloco", "kwargs": STATISTICAL, "max_steps": 12, "record_exchange": True},
    }
    world = 2
    results = run_ranks({"scenarios": scenarios}, world)
    for name in scenarios:  # the same weights on every rank
        for res in results[1:]:
            for key, value in res[name]["params"].items():
                assert torch.equal(value, results[0][name]["params"][key]), (name, key)

    # the schedule: 64 kept per 8 x 8 tile (all), then 16, then 4, at the syncs after steps 4, 8, 12
    recorded = [r["scheduled"]["exchanges"] for r in results]
    assert [e["step"] for e in recorded[0]] == [4, 8, 12]
    syncs = [[recorded[r][j]["mine"] for r in range(world)] for j in range(3)]
    expected, _ = simulate(syncs, side=TILE, k=[64, 16, 4], beta=BETA)
    for j in range(3):
        for rank in range(world):
            for key, value in recorded[rank][j]["avg"].items():
                torch.testing.assert_close(value, expected[j][key], rtol=1e-5, atol=1e-7)
            assert torch.equal(_flat(recorded[rank][j]["avg"]), _flat(recorded[0][j]["avg"]))
    kept = [int((_flat(recorded[0][j]["avg"]) != 0).sum()) for j in range(3)]
    assert kept[0] > kept[1] > kept[2]  # dense, then sparser
    # bytes by hand, per rank (a ring all-gather of 2 ranks sends the other rank one payload per sync).
    # layer.0.weight [16, 32]: 8 tiles of 8 x 8; layer.0.bias [16]: 2 runs of 8; layer.2.weight [2, 16]: 2
    # tiles of 2 x 8; layer.2.bias [2]: one run of 2. A lookup of 4 float32 per tensor: 64 bytes.
    # Sync 1, 64 kept: every tile whole, no positions; 512 + 16 + 32 + 2 = 562 codes of 2 bits: 141 bytes.
    first = 64 + 141
    # Sync 2, 16 kept: layer.0.weight keeps 16 of 64 (2 low bits: 8 x 16 x 2 bits = 32 bytes; a vector of
    # 16 + (63 >> 2) + 1 = 32 bits per tile: 32 bytes); the runs of 8 and tiles of 16 and the run of 2
    # whole. 128 + 16 + 32 + 2 = 178 codes: 45 bytes.
    second = 64 + 32 + 32 + 45
    # Sync 3, 4 kept: layer.0.weight 4 low bits (16 bytes) and vectors of 4 + 3 + 1 bits (8 bytes);
    # layer.0.bias 1 low bit (1 byte), vectors of 4 + 3 + 1 (2 bytes); layer.2.weight 2 low bits (2
    # bytes), vectors of 4 + 3 + 1 (2 bytes); layer.2.bias whole. 32 + 8 + 8 + 2 = 50 codes: 13 bytes.
    third = 64 + (16 + 8) + (1 + 2) + (2 + 2) + 13
    for res in results:
        stats = res["scheduled"]["stats"]
        assert stats["weights_sparse/bytes_sent"] == (world - 1) * (first + second + third) == 205 + 173 + 108
        assert stats.get("weights/bytes_sent", 0) == 0

    # the dense codec: every value in 2 bits on its tensor's grid, e = 0.9 e + G, e -= Q(e); the mean in rank order
    recorded = [r["statistical"]["exchanges"] for r in results]
    assert len(recorded[0]) == 3
    e: dict[tuple[int, str], np.ndarray] = {}
    for j in range(3):
        for key in recorded[0][j]["mine"]:
            total = None
            for r in range(world):
                g = recorded[r][j]["mine"][key].numpy()
                acc = e[r, key] * np.float32(BETA) + g if (r, key) in e else g.copy()
                q = dense_reference(acc)
                e[r, key] = acc - q
                total = q if total is None else total + q
            want = torch.from_numpy(total / np.float32(world))
            for r in range(world):
                torch.testing.assert_close(recorded[r][j]["avg"][key], want, rtol=1e-5, atol=1e-7)
    for res in results:  # 4 tensors: 64 bytes of lookups; 562 codes of 2 bits: 141 bytes; per sync
        stats = res["statistical"]["stats"]
        assert stats["weights_statistical/bytes_sent"] == (world - 1) * 3 * (64 + 141)
        assert stats.get("weights/bytes_sent", 0) == 0


@pytest.mark.slow
def test_a_run_resumed_mid_schedule_ends_bit_for_bit_as_the_uninterrupted_one():
    # 32 steps per epoch on 2 ranks: a checkpoint after step 32 (an epoch's end), then 8 more steps. The
    # schedule is still dense at the sync after step 32 (its place comes from the step count, which the
    # checkpoint holds), and sparse at the one after step 36.
    kw = {**SCHEDULED, "topk_schedule": [64] * 8 + [16, 8], "fragment_sync_delay": 1}
    scenarios = {
        "straight": {"strategy": "sparseloco", "kwargs": kw, "max_steps": 44, "ckpt_every": 32},
        "resumed": {"strategy": "sparseloco", "kwargs": kw, "max_steps": 44, "resume": ["straight", 32]},
    }
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        for key, value in res["resumed"]["params"].items():
            assert torch.equal(value, res["straight"]["params"][key]), key
        straight, resumed = res["straight"]["stats"], res["resumed"]["stats"]
        assert resumed["weights_sparse/bytes_sent"] < straight["weights_sparse/bytes_sent"]


# samples (the unit the defect was in) quick; steps in the slow suite (the quick suite's budget)
@pytest.mark.parametrize("unit", ["samples", pytest.param("steps", marks=pytest.mark.slow)])
def test_the_kth_sync_keeps_the_kth_density_whatever_the_period_unit(unit):
    # batches of 4: a period of 10 samples puts the syncs after steps 3, 6, 9 (12, 24, 36 samples), a
    # period of 3 steps at the same steps. The schedule [64, 16] then 4 must give those three syncs
    # 64, 16 and 4 values per tile: the bytes of each sync, counted by hand in the test above.
    period = {"samples": 10, "steps": 3}[unit]
    kw = {**SCHEDULED, "sync_period": period, "sync_period_unit": unit}
    scenarios = {unit: {"strategy": "sparseloco", "kwargs": kw, "max_steps": 9, "trace": True}}
    results = run_ranks({"scenarios": scenarios}, 2)
    for res in results:
        assert [h[1] for h in res[unit]["sync_history"]] == [3, 6, 9]
        per_step = [int(s.get("weights_sparse/bytes_sent", 0)) for s in res[unit]["step_bytes"]]
        # per sync (one other rank receives each payload): 64 kept, 16 kept, 4 kept
        assert [per_step[2], per_step[5], per_step[8]] == [205, 173, 108], per_step
        assert sum(per_step) == 205 + 173 + 108
