"""commstrats-lm: train a language model with any strategy of lightning-commstrats.

A LightningCLI over lightning_commstrats.models.LanguageModel (LSTM, feed-forward
n-gram or decoder-only Transformer, optionally mixture of experts) and
lightning_commstrats.data.LMDataModule (by default the Brown corpus shipped in
the package). Every strategy of the package is available by name.

  commstrats-lm fit --config lstm_demo
  commstrats-lm fit --config lstm_demo --trainer.strategy=bmuf --trainer.devices=4
  commstrats-lm fit --config lstm_demo --trainer.strategy=diloco --trainer.strategy.pseudo_grad_bits=4
  commstrats-lm test --config lstm_demo --ckpt_path <checkpoint>
  mpiexec -n 2 commstrats-lm fit --config lstm_tiny --trainer.devices=2
  commstrats-lm fit --config moe_demo --trainer.strategy.init_args.inner=ep
  commstrats-lm fit --config moe_tiny --model.balance=swipe
  commstrats-lm fit --config lstm_tiny --print_config > my.yaml
  commstrats-lm fit --config my.yaml --trainer.max_steps=100
  commstrats-lm fit --help

--config takes a file or the name of a config shipped with the package (listed
under --config below); an existing file of that name wins. fit --help lists
every argument with its documentation. After fit, validate and test it prints
the perplexity next to the unigram baseline's (after fit, the perplexity of the
model the run ends with: when the fit never validated, a run shortened below
its first validation for one, or that model changed after the last validation,
a periodic scheme's end-of-fit sync for one, it is validated once more); add CommStatsMonitor
(lightning_commstrats.CommStatsMonitor) to the callbacks for communication
figures. With LayeredMixedPrecision among the plugins it prints the preset and
the steps skipped for overflow.

A bad setting is one line naming it, with the nearest settings for one that
does not exist (settings are never abbreviated) and the types allowed for a
value of the wrong type; the exit status is 0 after a run that ended, 2 after
a bad setting, 1 after a failure (with its traceback).

--trainer.strategy takes a registered name (the package's: allreduce,
onebit_sgd, bmuf, diloco... or Lightning's) or a class path. Settings follow
as --trainer.strategy.<setting>, after a name too: a package name followed by
settings stands for its class path (diloco: lightning_commstrats.DiLoCoStrategy),
and --trainer.strategy.help diloco lists its settings. A name nothing registered
is refused with the nearest registered names.

Mixture of experts: --model.num_experts experts in every --model.moe_every-th
Transformer block (--model.top_k, --model.capacity_factor, --model.balance:
aux, capacity, swipe or bias, with --model.bias_update_rate), trained with the
expert_parallel strategy (ep_size x dp_size ranks; inner: dp or ep). Every step logs moe/max_load, moe/mean_load,
moe/balance (max / mean tokens per expert), moe/dropped and moe/aux_loss;
CommStatsMonitor adds comm/tokens_bytes, the all-to-all payload.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch
import torch
import yaml
from jsonargparse import ActionConfigFile, DefaultHelpFormatter, Namespace
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

import lightning_commstrats  # noqa: F401 - registers the strategy names
from lightning_commstrats._cli_errors import parser_settings, short_parse_error, short_setting_error
from lightning_commstrats._registry import is_registered_strategy, strategy_class_path, unknown_strategy_message
from lightning_commstrats.data import LMDataModule
from lightning_commstrats.models import LanguageModel
from lightning_commstrats.precision import LayeredMixedPrecision
from lightning_commstrats.sharding import fix_mmap_threshold
from lightning_commstrats.sharding.process_memory import DEFAULT_MMAP_THRESHOLD

CONFIG_DIR = Path(__file__).parent / "configs"
# A --config value that could name a file; anything else (inline YAML, a URL) goes to jsonargparse as it is.
_FILE_LIKE = re.compile(r"[\w./-]+")


def packaged_configs() -> list[str]:
    """Names of the configs shipped in the package, ``lightning_commstrats/configs/<name>.yaml``."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


def resolve_config(value: str) -> str:
    """The file a ``--config`` value stands for: an existing path as given, else the packaged config of
    that name (``lstm_demo`` or ``lstm_demo.yaml``). Inline YAML is returned unchanged.

    Raises:
        ValueError: if ``value`` is neither an existing file nor a packaged config's name; the message
            lists the packaged names.
    """
    if Path(value).exists() or not _FILE_LIKE.fullmatch(value):
        return value
    name = value.removesuffix(".yaml")
    names = packaged_configs()
    if name in names:
        return str(CONFIG_DIR / f"{name}.yaml")
    raise ValueError(f"no file {value!r} and no packaged config of that name; packaged configs: {', '.join(names)}")


class ConfigFileOrName(ActionConfigFile):
    """``--config``: a YAML file, or the name of a packaged config; may be given several times."""

    def __call__(self, parser, cfg, values, option_string=None) -> None:
        try:
            values = resolve_config(values)
        except ValueError as err:
            # jsonargparse reports a TypeError from a config action as a usage error (exit code 2)
            raise TypeError(f"{option_string}: {err}") from None
        super().__call__(parser, cfg, values, option_string)


STRATEGY = "--trainer.strategy"
_CONFIG = ("-c", "--config")


def _config_strategy(value: str) -> Any:
    """The ``trainer.strategy`` a ``--config`` value sets, or None (none set, or not readable here:
    jsonargparse reports that)."""
    try:
        path = Path(resolve_config(value))
        config = yaml.safe_load(path.read_text() if path.is_file() else value)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    # a config given before the subcommand holds the subcommand's settings under its name
    scopes = [config, *config.values()] if isinstance(config, dict) else []
    for scope in scopes:
        trainer = scope.get("trainer") if isinstance(scope, dict) else None
        if isinstance(trainer, dict) and "strategy" in trainer:
            return trainer["strategy"]
    return None


def _is_class_path(value: str) -> bool:
    module, _, name = value.rpartition(".")
    try:
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    except (ImportError, ValueError):
        return False


def strategy_names_as_class_paths(args: list[str]) -> list[str]:
    """``args`` with the strategy given as jsonargparse needs it to take settings.

    jsonargparse takes ``--trainer.strategy.<setting>`` only after a class path: after a name
    (``--trainer.strategy=diloco``, or ``strategy: diloco`` in a ``--config``) it refuses the
    setting ("Expected a dot import path string: diloco"). A package name that a setting follows
    becomes its class path, ``lightning_commstrats.DiLoCoStrategy`` (inserted before the setting
    when the name came from a config), and ``--trainer.strategy.help diloco`` asks for that class's
    help. A name with no setting after it stays a name, as the Trainer takes it. A class path with
    no setting after it, which jsonargparse would pass on as a string the Trainer refuses, is given
    as ``{"class_path": ...}``.

    Raises:
        ValueError: settings follow a name that is not the package's (the message names the nearest
            registered names, or says to give a class path).
    """
    out = list(args)
    name: str | None = None  # the strategy given last, while no setting has followed it
    where: int | None = None  # its value's index in ``out``; None when a config gave it

    def as_class(value: str) -> str:
        return json.dumps({"class_path": value}) if _is_class_path(value) else value

    def settle() -> None:  # the strategy given last had no setting after it
        if name is not None and where is not None:
            prefix = f"{STRATEGY}=" if out[where].startswith(f"{STRATEGY}=") else ""
            out[where] = prefix + as_class(name)

    i = 0
    while i < len(out):
        key, eq, value = out[i].partition("=")
        has_next = not eq and i + 1 < len(out)
        if key == STRATEGY or (key in _CONFIG and (eq or has_next)):
            given = value if eq else (out[i + 1] if has_next else "")
            strategy = given if key == STRATEGY else _config_strategy(given)
            if key == STRATEGY or strategy is not None:
                settle()
                name = strategy if isinstance(strategy, str) else None
                where = (i if eq else i + 1) if key == STRATEGY and name else None
            i += 1 if eq else 2
            continue
        if key == f"{STRATEGY}.help" and (eq or has_next):
            j = i if eq else i + 1
            path = strategy_class_path(value if eq else out[j])
            if path is not None:
                out[j] = f"{key}={path}" if eq else path
        elif key.startswith(f"{STRATEGY}.") and name is not None:
            path = strategy_class_path(name)
            if path is None and "." not in name:
                if not is_registered_strategy(name):
                    raise ValueError(unknown_strategy_message(STRATEGY, name))
                raise ValueError(
                    f"{key} follows {STRATEGY}={name!r}, which is not a lightning_commstrats strategy: give its"
                    f" class path before the settings ({STRATEGY}=<class path> {key}=...)"
                )
            if path is not None and where is None:
                out.insert(i, f"{STRATEGY}={path}")
                i += 1
            elif path is not None:
                out[where] = f"{STRATEGY}={path}" if out[where].startswith(f"{STRATEGY}=") else path
            name = where = None
        i += 1
    settle()
    return out


def _plain(text: str) -> str:
    """Inline reST of docstrings (ours, Lightning's, torch's) as plain text for the terminal:
    ``code`` and :role:`~a.b.Name` become code and Name, `label <url>`_ becomes label (url)."""
    text = re.sub(r":[\w:]+:`~[\w.]*?(\w+)`", r"\1", text)
    text = re.sub(r":[\w:]+:`([^`<]*?)(?: <[^>]*>)?`", r"\1", text)
    text = re.sub(r"`([^`<]+?) <([^>]+)>`__?", r"\1 (\2)", text)
    return re.sub(r"``(.+?)``", r"\1", text, flags=re.DOTALL)


class HelpFormatter(DefaultHelpFormatter):
    """Keeps indented blocks of a description (example commands) as written, and prints argument help
    without reST markup."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = re.split(r"\n\s*\n", text.strip("\n"))
        filled = [
            textwrap.indent(block, indent)
            if block.startswith(" ")
            else textwrap.fill(
                " ".join(block.split()), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
            )
            for block in blocks
        ]
        return "\n\n".join(filled)

    def _expand_help(self, action: Any) -> str:
        return _plain(super()._expand_help(action))

    def start_section(self, heading: str | None) -> None:
        super().start_section(_plain(heading) if heading else heading)


class LMArgumentParser(LightningArgumentParser):
    """The parser with :class:`HelpFormatter` and short errors; jsonargparse builds the parsers of
    ``--*.help CLASS`` from the type of this one, so they get both too.

    An error is one line naming the setting (:mod:`lightning_commstrats._cli_errors`): a setting that
    does not exist with the nearest ones, a value of the wrong type with the types allowed, then
    where ``--help`` lists every setting; the usage is printed only when it is short (the usage of
    ``fit`` is about 90 lines). Abbreviated settings are refused (argparse would take
    ``--trainer.max_step`` for ``--trainer.max_steps``, and a new setting could change what a
    prefix meant): a misspelled setting is named, never guessed. ``JSONARGPARSE_DEBUG=1`` raises
    jsonargparse's own error instead, with its traceback.
    """

    def __init__(self, *args: Any, formatter_class: type = HelpFormatter, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            # jsonargparse reads the messages of parsers that do not exit (nested types): untouched
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        parser.print_usage(sys.stderr)
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {short_parse_error(message, parser_settings(parser))}\n")
        sys.stderr.write(f"{prog} --help lists every setting\n")
        self.exit(2)

    @override
    def print_usage(self, file: Any = None) -> None:
        usage = self.format_usage()
        if usage.count("\n") <= 4:  # the top level's (subcommands): short and useful
            self._print_message(usage, file)


class SaveConfigToRunFolder(SaveConfigCallback):
    """Saves the resolved config beside the logs; a run without a logger has no run folder, and
    writing ``config.yaml`` into the working directory would litter it, so nothing is saved."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.logger is not None:
            super().setup(trainer, pl_module, stage)


class LastValidation(Callback):
    """Remembers the model the fit's last validation saw: the step, and a checksum of its weights and
    buffers taken while validation still holds them (the periodic schemes validate their global model)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.checksum: tuple[int, float] | None = None

    @staticmethod
    def model_checksum(module: LightningModule) -> tuple[int, float]:
        """Two sums over every parameter and buffer (as float32): of the bit patterns as integers, exact,
        so that any one changed value shows, and of the values in float64. Two passes over the model
        (10 ms for the demo LSTM's 3.1M values on one CPU core), where a hash or a kept copy costs more."""
        sums = []
        for t in [*module.parameters(), *module.buffers()]:
            f = t.detach().float().contiguous()  # no copy for float32 tensors
            sums.append((f.view(torch.int32).sum(dtype=torch.int64), f.sum(dtype=torch.float64)))
        # read once every sum is queued, so that the device is waited for once
        return sum(int(b) for b, _ in sums), sum(float(v) for _, v in sums)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.step = trainer.global_step
            self.checksum = self.model_checksum(pl_module)

    def outdated(self, trainer: Trainer, module: LightningModule) -> bool:
        """Whether the model the fit ends with has no validation of its own: the fit never validated (a
        run shortened below its first validation, such as ``--trainer.max_steps`` below one epoch when
        validation comes at the epoch's end), or its model changed since the last validation (steps
        after it, or a strategy's end of fit: the periodic schemes' final sync). Never with validation
        off (``limit_val_batches=0``). Rank 0 decides for all, so that the ranks cannot split between
        validating again and not."""
        if not trainer.limit_val_batches:
            return False
        if self.step is None or self.checksum is None:
            changed = True
        else:
            changed = self.step != trainer.global_step or self.checksum != self.model_checksum(module)
        return bool(trainer.strategy.broadcast(changed, 0))


def check_model_and_data(arch: str, mode: str, num_experts: int) -> None:
    """Refuse model and data settings that do not go together, before anything is built."""
    if arch == "ffn" and mode != "ngram":
        raise ValueError(f"model.arch='ffn' reads n-gram contexts: it needs data.mode='ngram', got {mode!r}")
    if arch != "ffn" and mode == "ngram":
        raise ValueError(f"data.mode='ngram' feeds the feed-forward LM only (model.arch='ffn'), got {arch!r}")
    if num_experts and mode == "sentences":
        raise ValueError(
            "data.mode='sentences' pads batches, and padded positions would be routed to experts (taking"
            " capacity and shifting the balance), so padding would change the result: use mode='stream'"
            " with model.num_experts > 0"
        )


class LMCLI(LightningCLI):
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # Lightning's own init_parser adds a plain --config; this one also takes packaged names.
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={lightning.pytorch.__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument(
            "-c",
            "--config",
            action=ConfigFileOrName,
            help="A YAML file, or the name of a config shipped with the package: "
            + ", ".join(packaged_configs())
            + ". Given several times, later ones override earlier ones.",
        )
        return parser

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # A package name takes settings after it (strategy_names_as_class_paths); a name nothing
        # registered is a usage error naming the nearest names, not Lightning's generic list.
        if isinstance(args, (dict, Namespace)):
            super().parse_arguments(parser, args)
        else:
            given = sys.argv[1:] if args is None else list(args)
            try:
                argv = strategy_names_as_class_paths(given)
            except ValueError as err:
                parser.error(str(err))
            if args is None:  # the command line itself, as Lightning parses it
                self.config = parser.parse_args(argv)
            else:
                super().parse_arguments(parser, argv)
        subcommand = self.config.get("subcommand")
        strategy = self.config.get(f"{subcommand}.trainer.strategy" if subcommand else "trainer.strategy")
        if isinstance(strategy, str) and not is_registered_strategy(strategy):
            parser.error(unknown_strategy_message(STRATEGY, strategy))

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--fix_mmap_threshold",
            type=bool,
            default=False,
            help="Fix glibc's mmap threshold at 128 KiB in every rank before the model is built, so that"
            " memory freed on the host goes back to the system and the process's peak follows its live"
            " tensors (lightning_commstrats.sharding.fix_mmap_threshold; docs: sharding, what the process"
            " holds). It trades time for memory. Nothing is done where malloc is not glibc's.",
        )
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.order", "model.order")
        parser.link_arguments("data.seq_len", "model.max_seq_len")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        try:
            check_model_and_data(cfg.model.arch, cfg.data.mode, cfg.model.num_experts)
        except ValueError as err:
            self._active_parser().error(str(err), err)
        if cfg.get("fix_mmap_threshold"):  # in every rank's process (each parses its command line), before the build
            # ranks started afresh from this process (start_method spawn or forkserver) do not parse the command
            # line: glibc reads the same setting from their environment at start
            os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(DEFAULT_MMAP_THRESHOLD))
            applied, why = fix_mmap_threshold()
            rank_zero_info(f"[memory] {why}" if applied else f"[memory] mmap threshold not fixed: {why}")

    def instantiate_classes(self) -> None:
        # A value that a constructor refuses (the package's, Lightning's) is a usage error of one line
        # naming the setting, not a traceback through jsonargparse.
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as err:
            cfg = self.config[self.subcommand] if self.subcommand else self.config
            self._active_parser().error(short_setting_error(err, cfg), err)

    def _active_parser(self) -> LightningArgumentParser:
        """The subcommand's parser (its name in errors: ``commstrats-lm fit``), else the top level's."""
        return getattr(self, "_subcommand_parsers", {}).get(self.subcommand, self.parser)

    def before_fit(self) -> None:
        self._last_validation = LastValidation()
        self.trainer.callbacks.append(self._last_validation)

    def after_fit(self) -> None:
        plugin = self.trainer.precision_plugin
        if isinstance(plugin, LayeredMixedPrecision):
            skipped = plugin.scaler.skipped_steps if plugin.scaler else 0
            rank_zero_info(f"[precision] {plugin}: {skipped} steps skipped for overflow")
        # The perplexity printed is the model the run ends with, however the run was shortened.
        if self._last_validation.outdated(self.trainer, self.model):
            fit_metrics = dict(self.trainer.callback_metrics)
            with warnings.catch_warnings():
                # it shards the data as the fit's validations did, on purpose: the same set is measured
                warnings.filterwarnings("ignore", "Using `DistributedSampler` with the dataloaders")
                self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
            for key, value in fit_metrics.items():  # the fit's other figures (train/loss...) stay readable
                self.trainer.callback_metrics.setdefault(key, value)
        self._report("val/ppl", "valid")

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
            f" ({compare_to_baseline(ppl, unigram)}), vocabulary {self.datamodule.vocab_size}"
        )


def compare_to_baseline(ppl: float, baseline: float) -> str:
    """``"12.3% below it"`` or, for a model worse than the baseline, ``"45.6% above it"``."""
    share = 100 * (ppl / baseline - 1)
    return f"{abs(share):.1f}% below it" if share <= 0 else f"{share:.1f}% above it"


def main(args: list[str] | None = None) -> LMCLI:
    """Parse ``args`` (default: the command line), build the run and run the subcommand; returns the
    :class:`LMCLI`, whose ``trainer``, ``model`` and ``datamodule`` stay readable. A bad setting exits
    (``SystemExit`` with code 2) after printing one line that names it. The console command is
    :func:`console_main`."""
    return LMCLI(
        LanguageModel,
        LMDataModule,
        args=args,
        seed_everything_default=0,
        save_config_callback=SaveConfigToRunFolder,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": __doc__},  # plain text: --help prints it
        parser_class=LMArgumentParser,
    )


def console_main() -> int:
    """``commstrats-lm``: :func:`main` on the command line; the exit status is 0 when the subcommand
    ran to its end, 2 on a bad setting, and 1 with the traceback when the run failed (a Python
    exception), so that ``&&``, CI and job schedulers read it."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(console_main())
