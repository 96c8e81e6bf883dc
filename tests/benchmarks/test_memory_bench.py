"""``benchmarks/memory.py``: the budget arithmetic by hand, and the table's core on 4 real ranks with a
tiny Transformer (diloco unsharded and sharded 4-way: a quarter of every kind per rank)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import memory

MiB = 2**20


def test_blocks_within_a_budget_by_hand():
    # one block 300 MiB, two 400 MiB: 200 MiB of embeddings and the rest, 100 MiB a block
    got = memory.blocks_within(1024 * MiB, 300 * MiB, 400 * MiB)
    assert got == {"blocks": 8, "base": 200 * MiB, "per_block": 100 * MiB, "predicted": 1000 * MiB}
    with pytest.raises(ValueError, match="fits no block"):
        memory.blocks_within(250 * MiB, 300 * MiB, 400 * MiB)
    with pytest.raises(ValueError, match="grow"):
        memory.blocks_within(1024 * MiB, 300 * MiB, 300 * MiB)


def test_budget_table_reports_the_parameter_ratio():
    def layout(blocks, numel, per_kind):
        return {
            "blocks": blocks,
            "base": 4 * per_kind,
            "per_block": per_kind,
            "predicted": 4 * per_kind * (blocks + 1),
            "numel": numel,
            "bytes": dict.fromkeys(memory.KINDS, per_kind),
            "total": 4 * per_kind,
            "losses": [9.0, 8.0],
            "rss_peak": 10 * MiB,
            "rss_peak_setup": 8 * MiB,
            "rss_at_last": 9 * MiB,
            "seconds": 1.0,
        }

    result = {
        "budget": 1024 * MiB,
        "d_model": 512,
        "layouts": {"unsharded": layout(2, 10e6, 100 * MiB), "sharded 4-way": layout(8, 40e6, 25 * MiB)},
        "numel_ratio": 4.0,
    }
    text = memory.format_budget(result)
    assert "4.00x" in text and "9.000 -> 8.000 (2 steps)" in text and "| sharded 4-way | 8 | 40.0M |" in text


@pytest.mark.multiprocess
@pytest.mark.slow  # 15 s: the quick suite's budget (the advisor's memory tests count shards on real ranks)
def test_diloco_sharded_four_ways_holds_a_quarter_of_every_kind_per_rank(monkeypatch):
    monkeypatch.setitem(memory.SIZES, "tiny", (64, 2, 2))  # every dimension divisible by 4: no padding
    rows = memory.measure_table(["tiny"], ["diloco"], ["unsharded", "fsdp 1x4"], steps=2, log=lambda *_: None)
    full, sharded = rows
    assert (full["layout"], sharded["layout"]) == ("unsharded", "fsdp 1x4")
    params = full["numel"] * 4  # fp32
    assert full["bytes"]["parameters"] == params and full["bytes"]["gradients"] == params
    assert full["bytes"]["optimizer"] >= 2 * params  # AdamW's two moments (and its step counters)
    assert full["bytes"]["scheme"] == 2 * params  # the global model and the outer Nesterov momentum
    for kind in ("parameters", "gradients", "scheme"):
        assert sharded["bytes"][kind] == full["bytes"][kind] // 4
    assert sharded["ratio"] == pytest.approx(0.25, abs=0.01) and full["ratio"] == 1.0
    table = memory.format_table(rows)
    assert table.count("\n") == 3 and "| tiny (" in table and "| diloco | fsdp 1x4 |" in table
