"""Short errors for the recipe CLI's settings (``commstrats-lm``).

jsonargparse reports a setting it does not know as the whole usage (about 90 lines) and a bad value
as a nested report of every type it tried; a value that a constructor refuses reaches the user as
a traceback. The functions here turn each into one line that names the setting as the user typed
it (``--trainer.max_steps=abc: expected int``), with the nearest settings for a misspelled one
(``--model.lrr is not a setting; did you mean --model.lr?``). They read jsonargparse's messages
(4.27 to 4.53 word them alike); a message they do not recognise is kept, less its ``Given value``
dumps.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import textwrap
from collections.abc import Iterable
from typing import Any

_PARSER_KEY = re.compile(r'Parser key "([^"]+)":\s*(.*)', re.DOTALL)
_CLASS_PROBLEM = re.compile(
    r"Problem with given class_path '([^']+)':\s*\n(.*?)(?=\n\s*Given value type:|\Z)", re.DOTALL
)
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_NOT_IN_CONFIG = re.compile(r"does not accept (?:option|nested key) '([^']+)'")
_UNRECOGNIZED = re.compile(r"^unrecognized arguments: (.*)$", re.DOTALL)
_EXPECTED = re.compile(r"^\s*(?:- )?Expected an? (.+?)(?:\. Got value: (.*))?$", re.MULTILINE)
_GIVEN = re.compile(r"^\s*Given value: (.*)$", re.MULTILINE)
_GIVEN_CLASS = re.compile(r"Given value: Namespace\(class_path='([^']+)'")
_DUMPS = re.compile(r"^\s*(Given value type|Given value|Subtypes):.*$\n?", re.MULTILINE)


def nearest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``candidates`` closest to ``name``, the closest first: those within 0.1 of the best
    :class:`difflib.SequenceMatcher` ratio, and at least 0.6 (``--trainer.max_step`` finds
    ``--trainer.max_steps`` alone, not ``--trainer.min_steps`` beside it)."""
    score = {c: difflib.SequenceMatcher(None, name, c).ratio() for c in dict.fromkeys(candidates)}
    best = max(score.values(), default=0.0)
    close = [c for c in score if score[c] >= max(0.6, best - 0.1)]
    return sorted(close, key=lambda c: -score[c])[:n]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """``"; did you mean --a or --b?"`` for the nearest of ``candidates``, or ``""``."""
    close = nearest(name, candidates)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def parser_settings(parser: argparse.ArgumentParser) -> list[str]:
    """The long option strings of ``parser`` (``--trainer.max_steps``...), without the help actions."""
    return [
        option
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and not action.dest.endswith(".help")
        for option in action.option_strings
        if option.startswith("--")
    ]


def class_settings(class_path: str) -> list[str]:
    """The settings jsonargparse takes for the class at ``class_path`` (its ``init_args``); ``[]`` if
    that class cannot be read."""
    from jsonargparse import ArgumentParser

    module, _, name = class_path.rpartition(".")
    try:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(getattr(importlib.import_module(module), name))
    except Exception:  # only suggestions are lost
        return []
    return [a.dest for a in parser._actions if a.dest != "help" and not a.dest.endswith(".help")]


def describe_types(expected: Iterable[str]) -> str:
    """jsonargparse's ``Expected a ...`` alternatives in words: ``int or null``, ``one of 'a', 'b'``."""
    words: list[str] = []
    literals: list[str] = []  # the values of every Literal alternative, as one list
    for text in expected:
        found = re.fullmatch(r"<class '(?:[\w.]+\.)?(\w+)'>", text)
        if found:
            word = "null" if found.group(1) == "NoneType" else found.group(1)
        elif text.startswith("typing.Literal["):
            literals += [v.strip() for v in text.removeprefix("typing.Literal[").removesuffix("]").split(",")]
            continue
        elif text.startswith("dot import path string"):
            word = "a class name or import path"
        elif text.startswith("path but"):  # the config-file alternative of a class argument
            continue
        else:
            word = text.replace("typing.", "")
        if word not in words:
            words.append(word)
    if literals:
        words.insert(0, "one of " + ", ".join(dict.fromkeys(literals)))
    return " or ".join(words) if words else "another value"


def unknown_setting(given: str, candidates: Iterable[str], where: str = "") -> str:
    """``--model.lrr is not a setting; did you mean --model.lr?``"""
    return f"{given} is not a setting{where}{did_you_mean(given, candidates)}"


def _value(body: str) -> str:
    got = [value for _, value in _EXPECTED.findall(body) if value]
    if got:
        return got[0]
    given = _GIVEN.search(body)
    return given.group(1) if given else "?"


def _explain_key(key: str, body: str, class_path: str | None = None) -> str:
    """One line for jsonargparse's report on the setting ``key`` (``trainer.max_steps``)."""
    nested = _CLASS_PROBLEM.search(body)
    if nested:
        class_path, inner = nested.groups()
        found = _PARSER_KEY.search(inner)
        if found:
            return _explain_key(f"{key}.{found.group(1)}", found.group(2), class_path)
        found = _NOT_ACCEPTED.search(inner)
        if found:
            close = nearest(found.group(1), class_settings(class_path))  # the names alone: no shared prefix
            hint = f"; did you mean {' or '.join(f'--{key}.{name}' for name in close)}?" if close else ""
            return (
                f"--{key}.{found.group(1)} is not a setting of {class_path}{hint}"
                f" (--{key}.help {class_path} lists them)"
            )
        return f"--{key} ({class_path}): {' '.join(textwrap.dedent(inner).split())}"
    expected = [text for text, _ in _EXPECTED.findall(body)]
    of = f" ({class_path})" if class_path else ""
    if expected:
        return f"--{key}={_value(body)}: expected {describe_types(expected)}{of}"
    return f"--{key}{of}: {' '.join(_DUMPS.sub('', body).split())}"


def short_parse_error(message: str, settings: Iterable[str]) -> str:
    """One line for a jsonargparse parse error: a setting it does not know (with the nearest of
    ``settings``, the parser's option strings) or a value of the wrong type (naming the types it
    takes). Other messages are kept, less the ``Given value`` dumps."""
    settings = list(settings)
    found = _UNRECOGNIZED.match(message)
    if found:
        given = [arg.split("=", 1)[0] for arg in found.group(1).split() if arg.startswith("-")]
        if given:
            return "; ".join(unknown_setting(arg, settings) for arg in given)
    found = _NOT_IN_CONFIG.search(message)
    if found:
        key = found.group(1)
        return unknown_setting(key, [s.removeprefix("--") for s in settings], " (in a config)")
    found = _PARSER_KEY.match(message)
    if found:
        return _explain_key(*found.groups())
    return _DUMPS.sub("", message).strip()


def component_of(error: BaseException) -> str | None:
    """The setting whose object raised ``error`` while the CLI built the run: the jsonargparse action
    that was instantiating (``trainer.strategy``, ``trainer.callbacks``), else ``model``, ``data`` or
    ``trainer`` for a constructor of those; ``None`` if none is on the traceback."""
    from lightning.pytorch import LightningDataModule, LightningModule, Trainer
    from lightning.pytorch.strategies import Strategy

    kinds = (
        (Strategy, "trainer.strategy"),
        (LightningModule, "model"),
        (LightningDataModule, "data"),
        (Trainer, "trainer"),
    )
    found = None
    seen: set[int] = set()
    exc: BaseException | None = error
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            obj = tb.tb_frame.f_locals.get("self")
            if isinstance(obj, argparse.Action):  # jsonargparse instantiating a class-typed setting
                found = obj.dest
            else:
                found = next((name for cls, name in kinds if isinstance(obj, cls)), found)
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return found


def _raised_by_constructor(error: BaseException) -> BaseException | None:
    """The innermost exception of ``error``'s chain raised inside a constructor that is not
    jsonargparse's (a class of the package or of Lightning refusing a value), or ``None``."""
    found = None
    seen: set[int] = set()
    exc: BaseException | None = error
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            module = frame.f_globals.get("__name__", "")
            if frame.f_code.co_name == "__init__" and not module.startswith("jsonargparse"):
                found = exc
                break
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return found


def short_setting_error(error: BaseException, config: Any = None) -> str:
    """One line for a value that a constructor refused while the CLI built the run, naming the setting:
    ``--model.arch='lsmt' is not supported; choose one of ...``. ``config``: the subcommand's
    namespace, to tell a setting's name at the start of the message from other words."""
    component = component_of(error)
    text = str(_raised_by_constructor(error) or error)
    if "Errors:" in text:  # jsonargparse's report on a union (a strategy given as a name or a class)
        errors = re.findall(r"^\s*- (.*)$", text.split("Errors:", 1)[1], flags=re.MULTILINE)
        # the alternatives that did not apply (a strategy given as a name: "Expected a <class 'str'>")
        refused = [e for e in errors if not e.startswith(("Expected a", "Not a valid subclass"))]
        class_path = _GIVEN_CLASS.search(text)
        text = "; ".join(refused) or _DUMPS.sub("", text).strip()
        if class_path and not refused:
            text = f"{class_path.group(1)}: {text}"
    text = " ".join(text.split())
    if component is None:
        return text
    first = re.match(r"`?(\w+)`?(.*)", text, flags=re.DOTALL)
    if first and config is not None:
        name, rest = first.groups()
        for key in (f"{component}.{name}", f"{component}.init_args.{name}"):
            try:
                known = key in config
            except Exception:
                known = False
            if known:
                return f"--{component}.{name}{rest}"
    return f"--{component}: {text}"
