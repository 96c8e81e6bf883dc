"""What the advisor says first: the answer in one line, every figure of a recommendation from one row (the
stall of the sharded layout is the sharded layout's), the short table, activation checkpointing, what would
fit when nothing does, a model named on the command line, and the Python API's names as the command's."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from lightning_commstrats import advisor
from lightning_commstrats.advisor.answer import Row, rows

REPO = Path(__file__).resolve().parents[1]
# (1000, 64) and (256, 64) matrices, a bias of 64: 80448 values; each matrix a unit of FSDP2
SHAPES = [(1000, 64), (64,), (256, 64)]
UNITS = {"units": [[0, 1], [2]], "root": []}
COMPUTE = 0.01
# 2 groups of 4: a fast link inside, a slow one between; the 4-bit exchange of the unsharded layout (every
# rank, the whole model) does not hide behind one 10 ms step, the sharded one's (a quarter, over 2 groups) does
SITE = {"ranks": 8, "shard": 4, "link_inside": 10_000, "link_between": 10, "compute_seconds": COMPUTE}
STREAMING = (
    "streaming_diloco",
    {"sync_period": 8, "num_fragments": 2, "fragment_sync_delay": 1, "pseudo_grad_bits": 4},
)
ANSWER = re.compile(
    r"^fits: yes — run: strategy=(?P<cls>\w+Strategy)\((?P<args>.*)\) · (?P<mb>[\d.e+-]+) MB a rank per step"
    r" (?P<where>between groups|over every rank) · predicted (?P<step>[\d.e+-]+) s/step"
    r" · peak (?P<peak>[\d.]+ [KMG]iB) of (?P<device>[\d.]+ [KMG]iB) a rank$"
)


def _shapes_file(tmp_path: Path) -> Path:
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"shapes": SHAPES, **UNITS}))
    return path


def _site(**kwargs):
    units = advisor.FsdpUnits(((0, 1), (2,)), ())
    return advisor.advise(SHAPES, units=units, **{**SITE, **kwargs})


def test_every_figure_of_a_row_comes_from_its_own_layout():
    found = _site(schemes=[STREAMING, ("diloco", {"sync_period": 8, "pseudo_grad_bits": 4}), ("allreduce", {})])
    streaming = next(c for c in found if c.scheme == "streaming_diloco")
    whole, sharded = Row(streaming, False), Row(streaming, True)
    # every rank whole: the fragments' exchange over 8 ranks at 10 Mbit/s stalls; sharded it is hidden
    assert whole.stall_per_period > 0 and sharded.stall_per_period == 0
    for c in found:
        for r in (Row(c, False), *((Row(c, True),) if c.sharded else ())):
            if c.scheme != "streaming_diloco":
                continue
            # the stall the note says is what the row's step holds on top of compute (and FSDP2's traffic)
            period = c.settings["sync_period"]
            assert r.stall_per_period == pytest.approx((r.step_seconds - COMPUTE - r.inside_seconds) * period, rel=2e-3)
    # the command's recommendations read each layout's row: the sharded one says no stall
    s = streaming.sharded
    assert s.note != streaming.note and "stall" not in s.note and "stall" in streaming.note
    assert sharded.step_seconds == s.step_seconds and sharded.exchange_bytes == s.between_bytes
    assert sharded.peak == streaming.sharded_peak and whole.peak == streaming.peak


def test_the_sharded_recommendation_says_its_own_stall(tmp_path, capsys):
    base = ["--shapes", str(_shapes_file(tmp_path)), "--compute-seconds", str(COMPUTE), "--ranks", "8", "--shard", "4"]
    links = ["--link-inside", "10000", "--link-between", "10", "--schemes", "streaming_diloco", "--full"]
    assert advisor.main([*base, *links]) == 0
    out = capsys.readouterr().out
    (sharded,) = [line for line in out.splitlines() if line.startswith("Recommended, sharded")]
    (whole,) = [line for line in out.splitlines() if line.startswith("Recommended:")]
    label = re.search(r"\*\*(.*?)\*\*", sharded).group(1)
    settings = dict(kv.split("=") for kv in label[len("streaming_diloco(") : -1].split(", "))
    c = advisor.predict(
        "streaming_diloco",
        {k: int(v) for k, v in settings.items()},
        SHAPES,
        units=advisor.FsdpUnits(((0, 1), (2,)), ()),
        **SITE,
    )
    # the sharded line's step and note are the sharded row's, not the unsharded one's
    assert f"predicted {c.sharded.step_seconds:.4g} s/step" in sharded
    assert f"({c.sharded.note})" in sharded and f"({c.note})" not in sharded
    stall = Row(c, True).stall_per_period
    said = re.search(r"([0-9.e+-]+) s of stall a period", sharded)
    assert (float(said.group(1)) if said else 0.0) == pytest.approx(stall, rel=2e-3)
    assert "stall" not in whole or whole != sharded


def test_the_answer_is_one_line_with_the_figures_of_the_recommended_row(tmp_path, capsys):
    args = ["--shapes", str(_shapes_file(tmp_path)), "--compute-seconds", str(COMPUTE), "--ranks", "8"]
    site = ["--shard", "4", "--link-inside", "10000", "--link-between", "10", "--device-memory", "2MiB"]
    assert advisor.main([*args, *site, "--activations", "100KiB", "--optimizer", "sgd"]) == 0
    lines = capsys.readouterr().out.splitlines()
    found = _site(device_memory="2MiB", activations=100 * 1024, optimizer="sgd")
    pick = Row(advisor.recommend(found, sharded=True), True)
    m = ANSWER.match(lines[0])
    assert m is not None, lines[0]
    assert m["cls"] == advisor.strategy_call(pick).split("(")[0].removeprefix("strategy=")
    assert m["args"].endswith('shard="fsdp", group_size=4') and m["where"] == "between groups"
    assert float(m["mb"]) == pytest.approx(pick.exchange_bytes / 1e6, rel=5e-3)
    assert float(m["step"]) == pytest.approx(pick.step_seconds, rel=5e-3)
    assert m["peak"] == advisor.readable(pick.peak) and m["device"] == "2 MiB"
    # then a short table: at most 8 rows of 8 columns, the recommendation first, the rest by the sharded step
    table = [line for line in lines if line.startswith("|")]
    assert len(table) - 2 <= 8 and all(line.count("|") == 9 for line in table)
    assert table[2].split("|")[2].strip() == f"**{pick.candidate.scheme}**"
    steps = [float(line.split("|")[4]) for line in table[3:]]
    fitting = [s for s, line in zip(steps, table[3:], strict=True) if ", fits" in line]
    assert fitting == sorted(fitting)


def test_with_shard_the_candidates_are_ranked_by_the_sharded_figures():
    found = _site(schemes=["allreduce", "diloco", "onebit_adam"])
    sharded = [c.sharded.step_seconds for c in found if c.sharded]
    assert sharded == sorted(sharded)
    assert all(c.sharded is None for c in found[len(sharded) :])  # what does not run sharded comes last
    assert [r.step_seconds for r in rows(found, True)] == sorted(sharded)


class TinyLM(nn.Module):
    """An embedding, three blocks of two 256 x 256 layers (each block a unit of the default shard policy) and
    an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 256)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU()) for _ in range(3)
        )
        self.head = nn.Linear(256, 100)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_activation_checkpointing_keeps_each_blocks_input_and_one_block():
    tokens, a = 15, 15 * 256 * 4  # 3 x 5 tokens; one float32 activation of a block
    full = advisor.activation_bytes(TinyLM(), 3, 5)
    # each block saves its input and its two ReLUs' outputs (the second is the next block's input): the
    # embedding's output and 6 more; outside them the token ids, the logits, their log-softmax and the loss's
    outside = 8 * tokens + 4 * tokens * 100 * 2 + 8 * tokens + 4
    assert full == outside + 7 * a
    # checkpointed: the 3 blocks' inputs, and one block's own two outputs while it is recomputed
    assert advisor.activation_bytes(TinyLM(), 3, 5, checkpointing=True) == outside + 3 * a + 2 * a
    # in bf16 (FSDP2's mixed precision) the blocks' activations and the logits are half; the log-softmax of
    # the float32 copy the loss takes is not
    half = advisor.activation_bytes(TinyLM(), 3, 5, dtype="bfloat16")
    assert half == 8 * tokens + 2 * tokens * 100 + 4 * tokens * 100 + 8 * tokens + 4 + 7 * a // 2


def test_fused_attention_keeps_no_attention_weights():
    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 32)

        def forward(self, x):
            q = self.emb(x).view(x.shape[0], x.shape[1], 2, 16).transpose(1, 2)
            return nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum(1)

    b, t = 2, 64
    math_ = advisor.activation_bytes(Attend(), b, t, loss=False)
    fused = advisor.activation_bytes(Attend(), b, t, loss=False, attention="fused")
    # fused: the embedding's ids, q (k and v are q), the output and the float32 log-sum-exp of each row
    assert fused == 8 * b * t + 4 * b * t * 32 + 4 * b * t * 32 + 4 * b * 2 * t + 4 * b * t * 16
    assert math_ > fused + 4 * b * 2 * t * t  # the reference keeps the t x t weights of each head


def test_when_nothing_fits_it_says_what_would(capsys):
    model = f"{Path(__file__)}:TinyLM"
    base = ["--model", model, "--batch-size", "8", "--seq-len", "64", "--bandwidth", "100", "--ranks", "2"]
    base += ["--compute-seconds", "0.1", "--schemes", "allreduce", "--optimizer", "sgd"]
    peak = {}
    for ac in (False, True):
        (c,) = advisor.advise(
            TinyLM(), bandwidth=100, compute_seconds=0.1, ranks=2, schemes=[("allreduce", {})], optimizer="sgd",
            batch_size=8, seq_len=64, activation_checkpointing=ac,
        )  # fmt: skip
        peak[ac] = c.peak
    device = (peak[False] + peak[True]) // 2  # fits checkpointed, not without
    assert advisor.main([*base, "--device-memory", f"{device}B"]) == 1
    out = capsys.readouterr().out
    first, second = out.splitlines()[:2]
    assert first.startswith(f"fits: no — nothing fits {advisor.readable(device)} a rank (closest: allreduce, peak")
    assert "fits with `--activation-checkpointing`" in first
    assert second.startswith("  - `--activation-checkpointing` (compute 0.133 s a step: every block's forward again)")
    assert f"peak {advisor.readable(peak[True])} of" in second
    # and a smaller micro-batch fits too: the largest that does
    assert re.search(r"`--batch-size [1-4]`", first)
    # with the flag it fits: the answer in one line, the activations measured checkpointed
    assert advisor.main([*base, "--device-memory", f"{device}B", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fits: yes — run: strategy=AllReduceStrategy() with torch.utils.checkpoint on every block")
    assert "measured on meta, checkpointed" in out


def test_a_model_named_on_the_command_line(tmp_path, capsys, monkeypatch):
    args = ["--bandwidth", "100", "--compute-seconds", "0.1", "--ranks", "2", "--schemes", "allreduce"]
    # module:Class, built on the meta device; a packaged config's name as --config gives it
    assert advisor.main(["--model", f"{Path(__file__)}:TinyLM", *args]) == 0
    out = capsys.readouterr().out
    numel = sum(p.numel() for p in TinyLM().parameters())
    assert f"# Advice: {numel:,} parameters" in out and "activations not counted" in out
    assert advisor.main(["--model", "lstm_tiny", *args]) == 0
    by_model = capsys.readouterr().out
    assert advisor.main(["--config", "lstm_tiny", *args]) == 0
    assert by_model == capsys.readouterr().out
    # a function that returns a module, and a Hugging Face-like class built from its config class's defaults
    module = tmp_path / "my_models.py"
    module.write_text(
        "from torch import nn\n"
        "class Config:\n    width = 12\n"
        "class HFLike(nn.Module):\n    config_class = Config\n"
        "    def __init__(self, config):\n        super().__init__()\n        self.w = nn.Linear(config.width, 3)\n"
        "def build():\n    return nn.Linear(5, 7)\n"
    )
    assert advisor.module_from_name(f"{module}:build").weight.is_meta
    assert advisor.module_from_name(f"{module}:HFLike").w.weight.shape == (3, 12)
    with pytest.raises(ValueError, match="has no 'nope'"):
        advisor.module_from_name(f"{module}:nope")
    # a LitGPT configuration's name without LitGPT: what to install
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "litgpt" else real(name, *a))
    with pytest.raises(SystemExit):
        advisor.main(["--model", "pythia-160m", *args])
    assert "as a LitGPT configuration it needs LitGPT: pip install litgpt" in capsys.readouterr().err
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    with pytest.raises(ValueError, match="pip install transformers"):
        advisor.module_from_name("hf:gpt2")


def test_the_python_api_takes_the_commands_names_and_the_old_ones_for_a_release():
    new = advisor.advise(
        SHAPES, bandwidth=100, compute_seconds=0.1, ranks=4, schemes=["allreduce"], memory_overhead=1.2
    )
    with pytest.warns(DeprecationWarning, match=r"advise\(bandwidth_bits=...\) is deprecated .* use bandwidth="):
        old = advisor.advise(SHAPES, bandwidth_bits=100e6, compute_seconds=0.1, ranks=4, candidates=["allreduce"])
    assert [(c.step_seconds, c.bytes_per_step) for c in old] == [(c.step_seconds, c.bytes_per_step) for c in new]
    with pytest.warns(DeprecationWarning, match=r"candidates=.*use schemes="):
        advisor.advise(SHAPES, bandwidth=100, compute_seconds=0.1, ranks=4, candidates=["allreduce"])
    with pytest.warns(DeprecationWarning, match="use link_between="):
        advisor.predict("allreduce", {}, SHAPES, link_between_bits=1e8, compute_seconds=0.1, ranks=4)
    with pytest.warns(DeprecationWarning, match="use memory_overhead="):
        advisor.predict("allreduce", {}, SHAPES, bandwidth=100, compute_seconds=0.1, ranks=4, overhead=1.5)
    with pytest.raises(TypeError, match="both bandwidth_bits= and its new name bandwidth="):
        advisor.advise(SHAPES, bandwidth=100, bandwidth_bits=1e8, compute_seconds=0.1, ranks=4)
    # the activations measured from the module's batch, as the command's --batch-size and --seq-len
    (c,) = advisor.advise(
        TinyLM(), bandwidth=100, compute_seconds=0.1, ranks=2, schemes=[("allreduce", {})], batch_size=3, seq_len=5
    )
    acts = advisor.activation_bytes(TinyLM(), 3, 5, attention="fused")
    assert dict(c.peak_parts.phases)["forward"] == acts


def test_the_names_the_command_needs_without_torch_match_the_package():
    from lightning_commstrats.advisor import names
    from lightning_commstrats.outer import OUTER_STATES
    from lightning_commstrats.strategies import STRATEGIES

    registered = {c.strategy_name: c.__name__ for c in STRATEGIES}
    assert {s: registered[s] for s in names.SCHEMES} == names.STRATEGY_CLASSES
    assert names.OUTER_STATES == OUTER_STATES


def test_help_imports_no_torch_from_the_advisor(tmp_path):
    # the package's own __init__ imports Lightning; the advisor's part of --help must not add torch
    stub = tmp_path / "lightning_commstrats"
    stub.mkdir()
    (stub / "__init__.py").write_text("")
    (stub / "advisor").symlink_to(REPO / "lightning_commstrats" / "advisor")
    code = (
        "import sys\nfrom lightning_commstrats.advisor import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "--activation-checkpointing" in done.stdout and "--model MODEL" in done.stdout


def test_the_strategy_call_is_python_that_builds_the_strategy():
    found = _site(schemes=[("bmuf", {"sync_period": 8, "sync_period_unit": "steps"})])
    text = advisor.strategy_call(Row(found[0], True))
    assert text == 'strategy=BMUFStrategy(sync_period=8, sync_period_unit="steps", shard="fsdp", group_size=4)'
    import lightning_commstrats

    strategy = eval(text.removeprefix("strategy="), vars(lightning_commstrats))
    assert strategy.sync_period == 8 and strategy.group_size == 4
    assert math.isfinite(Row(found[0], True).step_seconds)
