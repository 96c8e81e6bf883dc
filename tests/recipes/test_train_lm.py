"""The LM recipe's real CLI on the tiny config, in process (1 rank) and as a 2-rank launch."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_commstrats import LayeredMixedPrecision
from lightning_commstrats.cli import CONFIG_DIR, main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
TINY = "lstm_tiny"  # a packaged config, by name


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_opens_with_its_command(config, capsys):
    first = config.read_text().splitlines()[0]
    assert first == f"# commstrats-lm fit --config {config.stem}"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    assert "class_path: lightning_commstrats.CommStatsMonitor" in capsys.readouterr().out


def test_tiny_moe_fit_logs_routing_metrics():
    cli = main(["fit", "--config", "moe_tiny", "--model.balance=swipe"])
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["val/ppl"])
    assert float(metrics["moe/balance"]) == 1.0 and float(metrics["moe/dropped"]) == 0.0  # SWIPE: exact shares
    assert float(metrics["moe/aux_loss"]) > 0


def test_tiny_moe_fit_with_bias_balancing():
    cli = main(["fit", "--config", "moe_tiny", "--model.balance=bias", "--model.bias_update_rate=0.01"])
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["val/ppl"]) and float(metrics["moe/dropped"]) == 0.0
    assert cli.model.aux_loss_weight == 0.0
    (layer,) = cli.model.net.moe_layers()
    # six optimizer steps of +-0.01 (or 0) per expert
    assert layer.expert_bias.any() and layer.expert_bias.abs().max() <= 0.06 + 1e-6


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["--model.arch=ffn", "--data.mode=ngram", "--data.order=3"],
        ["--model.arch=transformer", "--model.num_heads=2", "--data.tokenizer=bpe"],
        ["--data.mode=sentences", "--data.bucket_by_length=true"],
    ],
    ids=["lstm", "ffn", "transformer-bpe", "lstm-sentences"],
)
def test_tiny_fit_then_test_one_rank(overrides):
    cli = main(["fit", "--config", TINY, *overrides])
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["val/ppl"]) and metrics["val/ppl"] > 1
    assert cli.trainer.global_step == 6
    assert cli.trainer.strategy.comm_stats.steps == 6
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size  # linked from the data


def test_layered_config_selects_the_plugin_and_the_preset_by_name(caplog):
    config = "transformer_layered"
    small = ["--trainer.devices=1", "--trainer.max_steps=3", "--trainer.limit_val_batches=2", "--data.batch_size=4"]
    small += ["--trainer.val_check_interval=3"]
    model = ["--model.hidden_dim=16", "--model.ffn_dim=32", "--model.num_heads=2", "--data.max_vocab_size=500"]
    for preset, masters in (("layered", torch.float32), ("O3", torch.bfloat16)):
        with caplog.at_level(logging.INFO):
            cli = main(["fit", "--config", config, *small, *model, f"--trainer.plugins.init_args.preset={preset}"])
        plugin = cli.trainer.precision_plugin
        assert isinstance(plugin, LayeredMixedPrecision) and plugin.preset == preset and plugin.half == "bf16"
        assert {p.dtype for p in cli.model.parameters()} == {masters}
        assert torch.isfinite(cli.trainer.callback_metrics["val/ppl"])
        assert f"[precision] LayeredMixedPrecision(preset='{preset}', dtype='bf16'" in caplog.text


def test_same_seed_same_losses():
    runs = []
    for _ in range(2):
        cli = main(["fit", "--config", TINY, "--trainer.max_steps=4"])
        runs.append(
            (float(cli.trainer.callback_metrics["train/loss"]), [p.detach().clone() for p in cli.model.parameters()])
        )
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.multiprocess
def test_tiny_fit_two_ranks_through_the_script():
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "train_lm.py"), "fit", "--config", TINY, "--trainer.devices=2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[lm] valid perplexity" in out
    summary = next(line for line in out.splitlines() if line.startswith("[comm] steps 6"))
    assert "grad" in summary and " 0.000 MB (" not in summary


@pytest.mark.slow
def test_demo_lstm_one_epoch_one_rank_beats_the_unigram_model_by_30_percent():
    demo = "lstm_demo"
    cli = main(["fit", "--config", demo, "--trainer.devices=1", "--trainer.enable_progress_bar=false"])
    ppl = float(cli.trainer.callback_metrics["val/ppl"])
    unigram = cli.datamodule.unigram_perplexity("valid")
    print(f"demo LSTM after one epoch on 1 rank: valid perplexity {ppl:.2f}, unigram {unigram:.2f}")
    assert ppl <= 0.7 * unigram


def test_a_corpus_that_already_has_unk_trains_below_the_unigram_model(tmp_path):
    """Penn Treebank / WikiText style: rare words replaced by the literal ``<unk>`` beforehand."""
    import collections
    import gzip

    from lightning_commstrats.data import BROWN_DIR

    def read(name, n):
        with gzip.open(BROWN_DIR / f"{name}.txt.gz", "rt") as f:
            return [next(f).split() for _ in range(n)]

    train, valid = read("train", 3000), read("valid", 300)
    counts = collections.Counter(w for line in train for w in line)
    known = {w for w, c in counts.items() if c >= 3}
    corpus = tmp_path / "ptb_style"
    corpus.mkdir()
    for name, lines in (("train", train), ("valid", valid), ("test", valid)):
        text = "\n".join(" ".join(w if w in known else "<unk>" for w in line) for line in lines)
        (corpus / f"{name}.txt").write_text(text + "\n")
    assert "<unk>" in (corpus / "train.txt").read_text()
    cli = main(
        [
            "fit",
            "--config",
            TINY,
            f"--data.data_dir={corpus}",
            f"--data.cache_dir={tmp_path / 'cache'}",
            "--trainer.max_steps=200",
            "--trainer.val_check_interval=200",
            "--data.batch_size=16",
            "--model.lr=0.01",
            "--trainer.limit_val_batches=20",
        ]
    )
    ppl = float(cli.trainer.callback_metrics["val/ppl"])
    unigram = cli.datamodule.unigram_perplexity("valid")
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size == len(cli.datamodule.tokenizer.get_vocab())
    print(f"<unk> corpus: valid perplexity {ppl:.1f}, unigram {unigram:.1f}")
    assert ppl < unigram, (ppl, unigram)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_moe_sites_config_keeps_tokens_inside_the_groups_and_prints_the_traffic_apart():
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    small = ["--trainer.max_steps=6", "--trainer.val_check_interval=6", "--trainer.limit_val_batches=2"]
    small += ["--data.batch_size=8", "--trainer.strategy.init_args.sync_period=3", "--fix_mmap_threshold=true"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "train_lm.py"), "fit", "--config", "moe_sites", *small],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[lm] valid perplexity" in out
    summary = next(line for line in out.splitlines() if line.startswith("[comm] steps 6"))
    for kind in ("fsdp_gather", "tokens", "weights"):  # inside the groups, and across them
        assert f" {kind} " in summary, summary
    assert "of it FSDP2's inside the groups" in summary
    assert "peak RSS" in next(line for line in out.splitlines() if line.startswith("[memory] rank 0"))
    # every rank's peak, the largest and the smallest named (rank 0 is not always the largest)
    over = next(line for line in out.splitlines() if line.startswith("[memory] peak RSS over 4 ranks: largest"))
    assert re.search(r"largest [\d.]+ [MG]iB \(rank \d\), smallest [\d.]+ [MG]iB \(rank \d\)", over), over
    if sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
        assert "[memory] glibc" in out and "mmap threshold fixed at 131072 bytes" in out
