"""Where ``commstrats-advise`` reads the model from: a training config (``--config``), a model by name
(``--model``: a packaged config, a LitGPT configuration, a Hugging Face configuration, or a
``module:Class``), or a JSON file of parameter shapes (``--shapes``). Every model is built on the meta
device: shapes only, no memory, no initialisation."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from lightning_commstrats.advisor.fsdp import FsdpUnits
    from lightning_commstrats.cost_model import ModelShape

LITGPT_HINT = "pip install litgpt (or this package's [litgpt] extra: pip install 'lightning-commstrats[litgpt]')"
HF_HINT = "pip install transformers (or this package's [hf] extra)"


def model_from_config(value: str) -> tuple[ModelShape, int]:
    """The parameter shapes of the model a training config describes (a packaged config's name or
    a YAML file), built on the meta device (no memory, no data), and the token ids in one rank's
    minibatch. The vocabulary is the config's ``data.max_vocab_size`` (the cap; a corpus with fewer
    distinct words gets a smaller one)."""
    from lightning_commstrats.advisor.inputs import model_shape

    module, tokens = module_from_config(value)
    return model_shape(module.net), tokens


def module_from_config(value: str) -> tuple[nn.Module, int]:
    """The ``LanguageModel`` a training config describes, on the meta device, and the token ids in one
    rank's minibatch (see :func:`model_from_config`)."""
    import torch

    from lightning_commstrats.models import LanguageModel

    model_args, data = _config(value)
    model_args.update(vocab_size=data["max_vocab_size"], order=data["order"], max_seq_len=data["seq_len"])
    with torch.device("meta"):
        module = LanguageModel(**model_args)
    ngram = model_args.get("arch", "lstm") == "ffn"
    tokens = data["batch_size"] * (data["order"] if ngram else data["seq_len"] + 1)
    return module, tokens


def batch_from_config(value: str) -> tuple[int, int]:
    """A rank's minibatch of a training config as its model's forward takes it: ``(sequences, token ids
    per sequence)`` (the n-gram model's context of ``order - 1`` words, else ``seq_len`` tokens)."""
    model_args, data = _config(value)
    ngram = model_args.get("arch", "lstm") == "ffn"
    return data["batch_size"], data["order"] - 1 if ngram else data["seq_len"]


def _config(value: str) -> tuple[dict, dict]:
    import yaml

    from lightning_commstrats.cli import resolve_config
    from lightning_commstrats.data import LMDataModule

    path = Path(resolve_config(value))
    if not path.is_file():
        raise ValueError(f"--config: {value!r} is not a file or a packaged config")
    config = yaml.safe_load(path.read_text()) or {}
    data_defaults = {
        name: p.default for name, p in inspect.signature(LMDataModule.__init__).parameters.items() if name != "self"
    }
    return dict(config.get("model") or {}), {**data_defaults, **(config.get("data") or {})}


def optimizer_from_config(value: str) -> str:
    """The inner optimizer a training config's model uses, as :func:`memory_per_rank` names it."""
    import yaml

    from lightning_commstrats.cli import resolve_config

    config = yaml.safe_load(Path(resolve_config(value)).read_text()) or {}
    model = config.get("model") or {}
    name = model.get("optimizer", "adam")  # LanguageModel's default
    if name == "sgd":
        return "sgd_momentum" if model.get("momentum", 0) else "sgd"
    return name


def model_from_json(path: str, vocab_size: int = 0, vocab_width: int = 0) -> ModelShape:
    """Parameter shapes from a JSON file: a list of shapes, or an object with ``shapes`` (or the
    race's ``param_shapes``) and optionally ``vocab_size`` and ``vocab_width``."""
    from lightning_commstrats.advisor.inputs import model_shape

    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        shapes = data.get("shapes", data.get("param_shapes"))
        if shapes is None:
            raise ValueError(f"--shapes: {path} has no 'shapes' list")
        vocab_size = vocab_size or int(data.get("vocab_size", 0))
        vocab_width = vocab_width or int(data.get("vocab_width", 0))
    else:
        shapes = data
    return model_shape(shapes, vocab_size, vocab_width)


def units_from_json(path: str) -> FsdpUnits | None:
    """The FSDP2 units a shapes file gives: ``{"units": [[tensor indices], ...], "root": [...]}`` (the
    indices into its ``shapes``; ``root`` defaults to the tensors no unit names); ``None`` without."""
    from lightning_commstrats.advisor.fsdp import FsdpUnits

    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "units" not in data:
        return None
    try:
        units = tuple(tuple(int(i) for i in u) for u in data["units"])
        named = {i for u in units for i in u}
        count = len(data.get("shapes", data.get("param_shapes", ())))
        root = tuple(int(i) for i in data.get("root", [i for i in range(count) if i not in named]))
    except (TypeError, ValueError) as err:
        raise ValueError(f"--shapes: {path}'s 'units' must be lists of tensor indices: {err}") from None
    return FsdpUnits(units, root)


def is_packaged_config(value: str) -> bool:
    """Whether ``value`` names a packaged training config (``lstm_demo``) or is a YAML file."""
    if value.endswith((".yaml", ".yml")) and Path(value).is_file():
        return True
    from lightning_commstrats.cli import packaged_configs

    return value.removesuffix(".yaml") in packaged_configs()


def module_from_name(value: str) -> nn.Module:
    """The model ``--model`` names, built on the meta device (no memory):

    - ``package.module:Name`` or ``path/to/file.py:Name``: ``Name`` is a ``torch.nn.Module`` class built
      with no arguments (a Hugging Face class, whose constructor wants a configuration, gets its
      ``config_class()``'s defaults), or a function that returns a module, called with none;
    - ``hf:NAME``: a Hugging Face model from its configuration (``AutoConfig.from_pretrained(NAME)``: a
      name in the local cache or on the hub, or a folder with a ``config.json``), ``AutoModelForCausalLM``;
    - anything else: a LitGPT configuration's name (``litgpt.Config.from_name``: ``pythia-160m``,
      ``Llama-3.1-8B``), LitGPT's ``GPT`` (needs LitGPT installed).

    Raises:
        ValueError: naming what is missing (the module, the name in it, the package to install).
    """
    import torch

    if value.startswith("hf:"):
        return _huggingface(value[3:])
    if ":" in value:
        target, _, name = value.rpartition(":")
        obj = getattr(_import(target), name, None)
        if obj is None:
            raise ValueError(f"--model {value!r}: {target} has no {name!r}")
        with torch.device("meta"):
            return _build(obj, value)
    return _litgpt(value)


def _import(target: str) -> Any:
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"--model: no file {target!r}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--model: {target!r} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(target)
    except ImportError as err:
        raise ValueError(f"--model: cannot import {target!r}: {err}") from None


def _build(obj: Any, value: str) -> nn.Module:
    from torch import nn

    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise ValueError(f"--model {value!r}: give a torch.nn.Module class or a function that returns a module")
    config_class = getattr(obj, "config_class", None) if isinstance(obj, type) else None  # a Hugging Face model
    try:
        built = obj(config_class()) if config_class is not None else obj()
    except TypeError as err:
        raise ValueError(f"--model {value!r} cannot be built with no arguments: {err}") from None
    if not isinstance(built, nn.Module):
        raise ValueError(f"--model {value!r} gave a {type(built).__name__}, not a torch.nn.Module")
    return built


def _litgpt(name: str) -> nn.Module:
    import torch

    if importlib.util.find_spec("litgpt") is None:
        raise ValueError(
            f"--model {name!r} is not a packaged config, a module:Class or hf:NAME; as a LitGPT configuration"
            f" it needs LitGPT: {LITGPT_HINT}"
        )
    from litgpt import GPT, Config

    try:
        config = Config.from_name(name)
    except ValueError as err:
        raise ValueError(f"--model {name!r}: not a LitGPT configuration ({err})") from None
    with torch.device("meta"):
        return GPT(config)


def _huggingface(name: str) -> nn.Module:
    import torch

    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"--model hf:{name}: a Hugging Face model needs transformers: {HF_HINT}")
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model hf:{name}: no configuration found ({err})") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
