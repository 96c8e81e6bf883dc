"""What the LM recipe prints when fit ends: the figures of the run as it ended, after the strategy's own
end of fit (a periodic scheme's final sync), checked against the final model and the strategy's
counters read independently; and the recipe run unchanged against Lightning's ``ddp``."""

import itertools
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from lightning_commstrats.cli import main
from lightning_commstrats.data import LMDataModule
from lightning_commstrats.data.corpus import IGNORE_INDEX
from lightning_commstrats.models import LanguageModel

REPO = Path(__file__).resolve().parents[2]
TINY = "lstm_tiny"  # 6 steps, validation every 3, 3 validation batches of 8 sequences per rank
DILOCO = ["--trainer.strategy=lightning_commstrats.DiLoCoStrategy", "--trainer.strategy.init_args.sync_period=4"]
LM_LINE = re.compile(r"\[lm\] valid perplexity ([\d.]+); unigram baseline ([\d.]+) \((-?[\d.]+)% (below|above) it\)")


def perplexity(model: torch.nn.Module, batches: list) -> float:
    """exp of the mean next-token cross-entropy over every target position of ``batches``, in float64."""
    nll, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for x, y in batches:
            logits = model(x).double()
            nll += F.cross_entropy(
                logits.flatten(0, -2), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            ).item()
            count += int((y != IGNORE_INDEX).sum())
    return math.exp(nll / count)


def first_batches(loader: DataLoader, n: int) -> list:
    return list(itertools.islice(loader, n))


def check_lm_line(text: str, expected_ppl: float) -> None:
    (line,) = LM_LINE.findall(text)
    ppl, unigram, share, side = float(line[0]), float(line[1]), float(line[2]), line[3]
    assert ppl == pytest.approx(expected_ppl, abs=0.006), line
    # the tiny model is far worse than the unigram model: the line says so in words
    assert side == ("above" if ppl > unigram else "below")
    assert share == pytest.approx(100 * abs(ppl / unigram - 1), abs=0.06)  # a distance: never negative


@pytest.mark.parametrize(
    ("strategy", "steps", "validations_after_fit"),
    [
        ([], 6, 0),  # allreduce, validated at step 6, nothing changes after: no validation more
        ([], 7, 1),  # a step after the last validation
        (DILOCO, 6, 1),  # synced at step 4, validated at 6 (the global model of step 4), synced at the end
    ],
    ids=["allreduce-validated-last", "allreduce-step-after", "diloco-final-sync"],
)
def test_fit_prints_the_perplexity_of_the_model_it_ends_with(
    strategy, steps, validations_after_fit, tmp_path, caplog, monkeypatch
):
    calls = []
    validate = pl.Trainer.validate
    monkeypatch.setattr(pl.Trainer, "validate", lambda *a, **k: calls.append(1) or validate(*a, **k))
    with caplog.at_level(logging.INFO):
        cli = main(["fit", "--config", TINY, *strategy, f"--trainer.max_steps={steps}"])
    # the model the run ends with, saved and read back as a user would
    cli.trainer.save_checkpoint(tmp_path / "final.ckpt")
    final = LanguageModel.load_from_checkpoint(tmp_path / "final.ckpt", map_location="cpu")
    batches = first_batches(cli.datamodule.val_dataloader(), cli.trainer.limit_val_batches)
    check_lm_line(caplog.text, perplexity(final, batches))
    assert len(calls) == validations_after_fit
    assert "train/loss" in cli.trainer.callback_metrics  # the fit's figures stay beside the final validation's


def _launch(args: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "train_lm.py"), "fit", "--config", TINY, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.multiprocess
def test_two_rank_periodic_run_prints_figures_after_the_final_sync(tmp_path):
    probe, stats = tmp_path / "probe", tmp_path / "stats"
    callbacks = [
        {"class_path": "lightning_commstrats.CommStatsMonitor", "init_args": {"save_dir": str(stats)}},
        {"class_path": "final_state_probe.FinalStateProbe", "init_args": {"out": str(probe)}},
    ]
    out = _launch([*DILOCO, "--trainer.devices=2", f"--trainer.callbacks={json.dumps(callbacks)}"])

    # comm: the printed summary and the saved figures are the strategy's counters once fit is over
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in range(2)]
    for r, record in enumerate(ranks):
        saved = json.loads((stats / f"comm_stats.rank{r}.json").read_text())
        assert saved["bytes_sent"] == record["after"]["bytes_sent"] and saved["calls"] == record["after"]["calls"]
        assert record["after"]["bytes_sent"] > record["before"]["bytes_sent"]  # the final sync sent bytes
    after = ranks[0]["after"]
    (summary,) = [line for line in out.splitlines() if line.startswith("[comm] steps")]
    assert summary.startswith(f"[comm] steps 6: sent {after['bytes_sent'] / 1e6:.3f} MB (")
    assert f" in {after['calls']} calls;" in summary

    # perplexity: the final model on the batches the two ranks validate (Lightning's DistributedSampler)
    saved = torch.load(probe / "model.pt")
    datamodule = LMDataModule(max_vocab_size=2000, seq_len=20, batch_size=8)  # lstm_tiny's data
    datamodule.prepare_data()
    datamodule.setup("validate")
    valid = datamodule.val_dataloader().dataset
    batches = []
    for rank in range(2):
        sampler = DistributedSampler(valid, num_replicas=2, rank=rank, shuffle=False)
        batches += first_batches(DataLoader(valid, batch_size=8, sampler=sampler), 3)
    model = LanguageModel(**{k: v for k, v in saved["hparams"].items() if not k.startswith("_")})  # not the CLI's
    model.load_state_dict(saved["state_dict"])
    check_lm_line(out, perplexity(model, batches))


@pytest.mark.multiprocess
def test_a_packaged_config_runs_against_lightning_ddp():
    out = _launch(["--trainer.strategy=ddp", "--trainer.devices=2"])
    assert out.count("DDPStrategy does not count its communication") == 1  # one warning, rank 0's
    (summary,) = [line for line in out.splitlines() if line.startswith("[comm] steps")]
    assert re.fullmatch(
        r"\[comm\] steps 6: wall [\d.]+s \([\d.]+ s/step\); bytes not known \(DDPStrategy .*\)", summary
    )
    assert len(LM_LINE.findall(out)) == 1


@pytest.mark.parametrize(
    ("args", "validations_after_fit"),
    [
        # validation at the epoch's end, as in lstm_demo; 4 steps are far below one epoch of Brown
        (["--trainer.val_check_interval=1.0", "--trainer.max_steps=4"], 1),
        (["--trainer.max_steps=2"], 1),  # below lstm_tiny's first validation (every 3 steps)
    ],
    ids=["below-one-epoch", "below-first-interval"],
)
def test_a_run_shortened_below_its_first_validation_prints_the_final_perplexity(
    args, validations_after_fit, tmp_path, caplog, monkeypatch
):
    calls = []
    validate = pl.Trainer.validate
    monkeypatch.setattr(pl.Trainer, "validate", lambda *a, **k: calls.append(1) or validate(*a, **k))
    with caplog.at_level(logging.INFO):
        cli = main(["fit", "--config", TINY, *args])
    assert cli.trainer.global_step < cli.trainer.num_training_batches
    cli.trainer.save_checkpoint(tmp_path / "final.ckpt")
    final = LanguageModel.load_from_checkpoint(tmp_path / "final.ckpt", map_location="cpu")
    batches = first_batches(cli.datamodule.val_dataloader(), cli.trainer.limit_val_batches)
    check_lm_line(caplog.text, perplexity(final, batches))
    assert len(calls) == validations_after_fit


def test_with_validation_off_nothing_is_validated_after_fit(caplog, monkeypatch):
    calls = []
    validate = pl.Trainer.validate
    monkeypatch.setattr(pl.Trainer, "validate", lambda *a, **k: calls.append(1) or validate(*a, **k))
    with caplog.at_level(logging.INFO):
        main(["fit", "--config", TINY, "--trainer.max_steps=2", "--trainer.limit_val_batches=0"])
    assert calls == [] and not LM_LINE.findall(caplog.text)
