"""The periodic presets with a fixed outer step (``bmuf``, ``model_averaging``) from the recipes'
CLI: it passes every argument of the signature it follows, the outer optimizer's defaults
included, which the presets take as no choice; a value that is a choice is still refused."""

from __future__ import annotations

import pytest

from lightning_commstrats import BMUFStrategy, ModelAveragingStrategy
from lightning_commstrats.cli import main


@pytest.mark.parametrize(("name", "cls"), [("bmuf", BMUFStrategy), ("model_averaging", ModelAveragingStrategy)])
def test_a_preset_with_its_period_trains_from_the_cli(name, cls):
    args = ["fit", "--config", "lstm_tiny", f"--trainer.strategy={name}", "--trainer.strategy.sync_period=2"]
    cli = main([*args, "--trainer.max_steps=3", "--trainer.limit_val_batches=0"])
    assert isinstance(cli.trainer.strategy, cls) and cli.trainer.strategy.sync_period == 2
    assert cli.trainer.global_step == 3


def test_an_outer_setting_that_is_a_choice_is_still_refused():
    with pytest.raises(ValueError, match="does not take outer_lr"):
        BMUFStrategy(sync_period=4, outer_lr=0.7)
    BMUFStrategy(sync_period=4, outer_lr=1.0, outer_momentum=0.0)  # the defaults: no choice
