"""What the communication figures mean on real ranks: ``comm_seconds`` is the time the training
loop waited for communication, checked against a run whose waiting is known (one rank sleeps after
each batch, so the other waits that long in the next gradient all-reduce), and a background
exchange's seconds on the wire are background seconds, not waiting."""

from __future__ import annotations

import re

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

SLEEP = 0.25
STEPS = 8


def _share(summary: str) -> int:
    found = re.search(r"\((\d+)% of wall time\)", summary)
    assert found, summary
    return int(found.group(1))


def test_the_waiting_of_a_rank_whose_peer_is_late_is_what_the_peer_slept():
    scenario = {"strategy": "allreduce", "max_steps": STEPS, "slow_rank": [1, SLEEP]}
    r0, r1 = (r["known"] for r in run_ranks({"scenarios": {"known": scenario}}, 2))
    # rank 1 sleeps after each batch: rank 0 waits for it in the next batch's gradient all-reduce
    # (STEPS - 1 times; after the last batch no collective follows)
    known = (STEPS - 1) * SLEEP
    waited0, waited1 = r0["stats"]["comm_seconds"], r1["stats"]["comm_seconds"]
    print(f"rank 0 waited {waited0:.3f} s (known {known:.3f} s), rank 1 {waited1:.3f} s")
    assert 0.85 * known <= waited0 <= known + 0.6
    # the sleeping rank never waits: its flag rounds overlapped its batches and its sleep
    assert waited1 < 0.25 * known
    for r in (r0, r1):  # the summary's share is the waiting over the wall time of the same figures
        s = r["stats"]
        assert abs(_share(r["summary"]) - 100 * s["comm_seconds"] / s["wall_seconds"]) <= 0.5 + 1e-9
        assert s["compute_seconds"] == pytest.approx(s["wall_seconds"] - s["comm_seconds"])
        assert s["control/comm_seconds"] < 0.1 * known
    assert r0["stats"]["grad/comm_seconds"] >= 0.85 * known


def test_a_background_exchange_on_the_wire_is_not_waiting():
    # both ranks compute 0.2 s per batch; rank 1 is 0.15 s late to every fragment exchange, which
    # runs in the background for 2 batches (0.4 s): rank 0's exchange thread waits for it, its
    # training loop does not
    kwargs = {"sync_period": 8, "num_fragments": 2, "fragment_sync_delay": 2, "pseudo_grad_bits": 32}
    scenario = {
        "strategy": "streaming_diloco",
        "kwargs": kwargs,
        "max_steps": 14,
        "slow_rank": [-1, 0.2],
        "slow_exchange": [1, 0.15],
    }
    r0 = run_ranks({"scenarios": {"bg": scenario}}, 2)[0]["bg"]
    s = r0["stats"]
    # (fragment, launched at, applied at): launched in the background at steps 4, 8 and 12; the end
    # of fit syncs both fragments at once, on the loop's thread, where rank 0 waits for rank 1
    history = [tuple(h) for h in r0["sync_history"]]
    background = [h for h in history if h[1] < h[2]]
    at_end = [h for h in history if h[1] == h[2]]
    assert (len(background), len(at_end)) == (3, 2), history
    print(f"rank 0: waited {s['comm_seconds']:.3f} s, background {s['background_seconds']:.3f} s; {history}")
    # how long rank 0's thread waits depends on which rank launched first: at least half of it
    assert s["weights/background_seconds"] >= 0.5 * 0.15 * len(background)
    assert s["background_seconds"] >= s["weights/background_seconds"]
    # the waiting is the end-of-fit syncs' alone: the background ones overlapped the batches
    assert 0.5 * 0.15 * len(at_end) <= s["comm_seconds"] <= 0.15 * len(at_end) + 0.15
    assert "background exchanges" in r0["summary"]
