"""The advisor's peak memory per rank, phase by phase, against what ranks under a real memory limit did:
``benchmarks/results/fit_limit`` (``diloco`` with AdamW inside, 4 CPU ranks, each in a memory cgroup of 768
MiB, 270 MiB of it taken before the model is built: 498 MiB for training)."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_commstrats import advisor
from lightning_commstrats.models import LanguageModel

REPO = Path(__file__).resolve().parents[1]
FIT_LIMIT = REPO / "benchmarks" / "results" / "fit_limit"
MIB = 2**20
START = 270 * MIB  # what the interpreter, torch and Lightning held in a rank's cgroup before the build
BUDGET = 768 * MIB - START  # the search the process term was fitted on: 498 MiB for training
# The searches run again under other limits after the advisor's figures were set, not used to set them
HELD_OUT = {"budget_640": 640, "budget_1024": 1024}
LAYOUTS = {"unsharded": None, "fsdp 2x2": 2, "fsdp 1x4": 4}


def rung(j: int) -> LanguageModel:
    """The fit_limit ladder's rung ``j`` (benchmarks/fit_limit.py): d_model 32 j, j // 2 blocks, j heads, FFN
    4 x d_model, a tied embedding of 8,192 words, 64 positions; on the meta device (shapes only)."""
    with torch.device("meta"):
        return LanguageModel(
            arch="transformer",
            vocab_size=8192,
            hidden_dim=32 * j,
            num_layers=j // 2,
            num_heads=j,
            ffn_dim=4 * 32 * j,
            max_seq_len=64,
            dropout=0.0,
            tie_weights=True,
            optimizer="adamw",
        )


def predicted(j: int, shard: int | None, budget: int = BUDGET) -> advisor.Candidate:
    """What the advisor says of rung ``j`` as fit_limit trained it: diloco syncing every 2 steps, its outer
    state on the host, AdamW, 4 CPU ranks, 2 x 64 tokens a rank, sharded models built empty."""
    model = rung(j)
    return advisor.predict(
        "diloco",
        {"sync_period": 2},
        model,
        bandwidth=1000,
        compute_seconds=1.0,
        ranks=4,
        shard=shard,
        optimizer="adamw",
        outer_state="host",
        accelerator="cpu",
        empty_init=True,
        device_memory=budget,
        activations=advisor.activation_bytes(model, 2, 64),
    )


def trials(folder: str = "", budget_mib: int = 768) -> list[tuple[str, int, dict]]:
    data = json.loads((FIT_LIMIT / folder / "results.json").read_text())
    assert data["budget_mib"] == budget_mib and data["cgroups"] and not data["glibc_defaults"]
    return [(lay["layout"], int(j), t) for lay in data["layouts"] for j, t in sorted(lay["tried"].items())]


def test_the_fit_limit_ladder_fits_where_it_fitted_and_not_where_the_kernel_killed_it():
    seen = {}
    for layout, j, trial in trials():
        shard = LAYOUTS[layout]
        c = predicted(j, shard)
        peak, fits = (c.sharded_peak, c.fits(sharded=True)) if shard else (c.peak, c.fits())
        if trial["fits"]:
            ranks = trial["ranks"]
            assert {r["numel"] for r in ranks} == {advisor.model_shape(rung(j)).numel}
            measured = max(r["cgroup_peak"] - r["cgroup_start"] for r in ranks)
            # conservative: never below what the kernel counted above the rank's start
            assert measured <= peak <= measured + 20 * MIB, (layout, j, measured / MIB, peak / MIB)
        assert fits is trial["fits"], (layout, j, peak / MIB, trial["fits"])
        seen.setdefault(layout, set()).add(trial["fits"])
    # every layout has its largest fitting rung and the killed one next to it
    assert seen == {layout: {True, False} for layout in LAYOUTS}


@pytest.mark.parametrize("folder", HELD_OUT)
def test_the_verdicts_hold_under_limits_the_figures_were_not_set_on(folder):
    # 640 and 1024 MiB a rank, measured after the process term was fitted at 768: every verdict right
    # (7 and 9 trials); the peaks within -2.4 to +24.4 MiB of the kernel's count (the process grows a
    # little with the model: two 1024 MiB peaks came 0.2 and 2.4 MiB above the prediction)
    budget = HELD_OUT[folder] * MIB - START
    tried = trials(folder, HELD_OUT[folder])
    for layout, j, trial in tried:
        shard = LAYOUTS[layout]
        c = predicted(j, shard, budget)
        peak, fits = (c.sharded_peak, c.fits(sharded=True)) if shard else (c.peak, c.fits())
        assert fits is trial["fits"], (folder, layout, j, peak / MIB, trial["fits"])
        if trial["fits"]:
            measured = max(r["cgroup_peak"] - r["cgroup_start"] for r in trial["ranks"])
            assert measured - 3 * MIB <= peak <= measured + 25 * MIB, (folder, layout, j, measured / MIB, peak / MIB)
    assert {fits for _, _, t in tried for fits in [t["fits"]]} == {True, False}


def test_the_old_factor_said_the_killed_rungs_fit():
    # 1.07 x the tensors held (plus FSDP2's gathers) was the old verdict: 338 MiB for unsharded 13.8M, which
    # the kernel killed over 498 MiB; the phases say 516 MiB
    c = predicted(12, None)
    old = advisor.peak_per_rank(c.memory, overhead=3.2 / 3.0, process=0)
    assert old / MIB == pytest.approx(337.6, abs=0.1) and old < BUDGET < c.peak
    assert c.peak_parts.phase == "sync"


def test_the_phases_by_hand():
    # one group of 4: no exchange across groups, so the sync holds the flat local weights and the
    # pseudo-gradient (8 bytes a local parameter), the outer Nesterov step the same; two groups of 2 add
    # the exchange's float32 buckets (4 more) and gloo's ring scratch on the largest bucket
    model = rung(8)
    shapes = advisor.model_shape(model).shapes
    units = advisor.fsdp_units(model)
    for shard, replicas in ((4, 1), (2, 2)):
        m = advisor.memory_per_rank("diloco", {"sync_period": 2}, shapes, ranks=4, shard=shard, accelerator="cpu")
        local = [-(-s[0] // shard) * math.prod(s[1:]) for s in shapes]
        p = advisor.peak_phases("diloco", {"sync_period": 2}, shapes, m, ranks=4, units=units, activations=10**6)
        sync = dict(p.phases)["sync"]
        if replicas == 1:
            assert sync == 8 * sum(local)
        else:
            buckets = 12 * sum(local)
            assert buckets < sync <= buckets + 4 * sum(local) // replicas
        whole = [shard * n for n in local]
        root = sum(whole[i] for i in units.root)
        largest = max(sum(whole[i] for i in u) for u in units.units)
        gathers = advisor.fsdp_gathers(shapes, units, shard)
        assert (gathers.forward, gathers.backward, gathers.backward_end) == (
            4 * (root + largest),
            4 * (2 * root + 3 * largest),
            12 * root,
        )
        phases = dict(p.phases)
        assert phases["forward"] == 10**6 + gathers.forward
        # the gradients set to None before backward; the larger of them and the activations at a time
        assert phases["backward"] == max(max(10**6, m.gradients) - m.gradients + gathers.backward, gathers.backward_end)
        # AdamW single-tensor on CPU: sqrt(v) and sqrt(v) / c of the largest tensor
        assert phases["optimizer step"] == 2 * 4 * max(local)
        assert p.held == m.host and p.slack == 1.0 and p.process == advisor.HOST_PROCESS_BYTES
        assert p.total == p.held + max(phases.values()) + p.process
    # on a GPU: AdamW's foreach sqrt(v) over every tensor, no host process term, the GPU's factor
    m = advisor.memory_per_rank("allreduce", {}, shapes, ranks=2)
    p = advisor.peak_phases("allreduce", {}, shapes, m, ranks=2)
    assert dict(p.phases)["optimizer step"] == m.parameters and p.process == 0 and p.slack == 1.10
    assert p.total == math.ceil(1.10 * (m.device + max(dict(p.phases).values())))


def test_activations_are_what_autograd_saves_and_the_output():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 8)
            self.up = nn.Linear(8, 32)
            self.down = nn.Linear(32, 100)

        def forward(self, x):
            return self.down(torch.relu(self.up(self.emb(x))))

    # 3 x 5 tokens, in float32: the embedding's output (saved by up), relu's output (saved by relu and by
    # down: once), the logits, their log-softmax (saved by the loss); and the token ids (int64, saved by
    # the embedding), the loss's targets and its total weight
    tokens = 15
    expected = 4 * tokens * (8 + 32 + 100 + 100) + 8 * tokens + 8 * tokens + 4
    assert advisor.activation_bytes(Net(), 3, 5) == expected
    assert advisor.activation_bytes(Net(), 3, 5, loss=False) == 4 * tokens * (8 + 32 + 100) + 8 * tokens
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        advisor.activation_bytes(Net(), 0, 5)


def test_the_allocator_factor_and_the_process_term_are_parameters():
    c = advisor.predict("allreduce", {}, [(1000, 64)], bandwidth=1000, compute_seconds=0.1, ranks=2, accelerator="cpu")
    held = c.peak_parts.held + c.peak_parts.top[1]
    assert c.peak == held + advisor.HOST_PROCESS_BYTES
    # glibc's defaults keep freed blocks: no measured factor holds, give one
    wide = advisor.predict(
        "allreduce",
        {},
        [(1000, 64)],
        bandwidth=1000,
        compute_seconds=0.1,
        ranks=2,
        accelerator="cpu",
        memory_overhead=1.5,
        process_bytes=0,
    )
    assert wide.peak == math.ceil(1.5 * held)
    for bad, match in [
        ({"memory_overhead": 0.9}, "memory_overhead must be a finite number >= 1"),
        ({"activations": -1}, "activations must be a number of bytes >= 0"),
        ({"process_bytes": 1.5}, "process_bytes must be a number of bytes >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            advisor.predict("allreduce", {}, [(1000, 64)], bandwidth=1000, compute_seconds=0.1, ranks=2, **bad)
