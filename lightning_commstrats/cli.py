"""The language-model training CLI (``commstrats-lm``, or ``python recipes/train_lm.py``).

A LightningCLI over :class:`~lightning_commstrats.models.LanguageModel` and
:class:`~lightning_commstrats.data.LMDataModule`: subcommands ``fit``, ``validate``, ``test``;
``--config recipes/configs/<file>.yaml``, ``--print_config``, dotted overrides such as
``--trainer.strategy=allreduce --trainer.devices=2``. Every strategy of the package is available
by name. After ``fit``, ``validate`` and ``test`` it prints the perplexity next to the unigram
baseline's (add ``lightning_commstrats.CommStatsMonitor`` to the callbacks for communication figures)
and, with ``LayeredMixedPrecision`` among the plugins, its preset and the steps it skipped.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_commstrats  # noqa: F401 - registers the strategy names
from lightning_commstrats.data import LMDataModule
from lightning_commstrats.models import LanguageModel
from lightning_commstrats.precision import LayeredMixedPrecision


class SaveConfigToRunFolder(SaveConfigCallback):
    """Saves the resolved config beside the logs; a run without a logger has no run folder, and
    writing ``config.yaml`` into the working directory would litter it, so nothing is saved."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.logger is not None:
            super().setup(trainer, pl_module, stage)


class LMCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.order", "model.order")
        parser.link_arguments("data.seq_len", "model.max_seq_len")

    def after_fit(self) -> None:
        self._report("val/ppl", "valid")
        plugin = self.trainer.precision_plugin
        if isinstance(plugin, LayeredMixedPrecision):
            skipped = plugin.scaler.skipped_steps if plugin.scaler else 0
            rank_zero_info(f"[precision] {plugin}: {skipped} steps skipped for overflow")

    def after_validate(self) -> None:
        self._report("val/ppl", "valid")

    def after_test(self) -> None:
        self._report("test/ppl", "test")

    def _report(self, key: str, split: str) -> None:
        metrics = self.trainer.callback_metrics
        if key not in metrics:
            return
        ppl = float(metrics[key])
        unigram = self.datamodule.unigram_perplexity(split)
        rank_zero_info(
            f"[lm] {split} perplexity {ppl:.2f}; unigram baseline {unigram:.2f}"
            f" ({100 * (1 - ppl / unigram):.1f}% below it), vocabulary {self.datamodule.vocab_size}"
        )


def main(args: list[str] | None = None) -> LMCLI:
    return LMCLI(
        LanguageModel,
        LMDataModule,
        args=args,
        seed_everything_default=0,
        save_config_callback=SaveConfigToRunFolder,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": __doc__},
    )


if __name__ == "__main__":
    main()
