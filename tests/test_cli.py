"""The recipe CLI's surface: packaged configs found by name, plain help text, what the wheel ships."""

import importlib.resources
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from lightning_commstrats.cli import CONFIG_DIR, main, packaged_configs, resolve_config

REPO = Path(__file__).resolve().parents[1]


def _print_config(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_packaged_configs_are_package_resources():
    resources = importlib.resources.files("lightning_commstrats") / "configs"
    names = sorted(r.name.removesuffix(".yaml") for r in resources.iterdir() if r.name.endswith(".yaml"))
    assert names == packaged_configs()
    assert {"lstm_tiny", "lstm_demo", "moe_tiny", "moe_demo"} <= set(names)
    assert (importlib.resources.files("lightning_commstrats") / "py.typed").is_file()


@pytest.mark.parametrize("name", ["lstm_tiny", "lstm_tiny.yaml"])
def test_a_name_resolves_to_the_packaged_config(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name here
    assert resolve_config(name) == str(CONFIG_DIR / "lstm_tiny.yaml")
    config = _print_config(capsys, "--config", name)
    packaged = yaml.safe_load((CONFIG_DIR / "lstm_tiny.yaml").read_text())
    assert config["model"]["hidden_dim"] == packaged["model"]["hidden_dim"] == 32
    assert config["trainer"]["max_steps"] == packaged["trainer"]["max_steps"] == 6


def test_an_existing_file_wins_over_a_packaged_name(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lstm_tiny.yaml").write_text("trainer:\n  max_steps: 77\n")
    assert resolve_config("lstm_tiny.yaml") == "lstm_tiny.yaml"
    assert _print_config(capsys, "--config", "lstm_tiny.yaml")["trainer"]["max_steps"] == 77
    # without the suffix it is not that file's path: the packaged config
    assert _print_config(capsys, "--config", "lstm_tiny")["trainer"]["max_steps"] == 6


def test_several_configs_apply_in_order_and_inline_yaml_passes_through(capsys):
    config = _print_config(capsys, "--config", "lstm_tiny", "--config", "moe_tiny")
    assert config["model"]["arch"] == "transformer" and config["model"]["num_experts"] == 4
    config = _print_config(capsys, "--config", "lstm_tiny", "--config", "trainer: {max_steps: 5}")
    assert config["trainer"]["max_steps"] == 5 and config["model"]["arch"] == "lstm"


@pytest.mark.parametrize("value", ["no_such_config", "no_such_config.yaml", "recipes/configs/lstm_tiny.yaml"])
def test_an_unknown_name_is_a_usage_error_that_lists_the_packaged_names(value, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="packaged configs: ffn_paper, lstm_demo"):
        resolve_config(value)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"no file {value!r}" in err
    assert all(name in err for name in packaged_configs())


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [["--help"], ["fit", "--help"], ["fit", "--trainer.strategy.help", "lightning_commstrats.DiLoCoStrategy"]],
    ids=["top", "fit", "strategy"],
)
def test_help_has_no_rest_markup(args, capsys):
    out = _help(capsys, *args)
    assert "``" not in out and ":class:" not in out and ":paramref:" not in out


def test_top_level_help_keeps_the_examples_and_lists_the_packaged_configs(capsys):
    out = _help(capsys, "--help")
    assert "\n  commstrats-lm fit --config lstm_demo\n" in out  # example commands as written
    assert "moe_demo, moe_large, moe_shared" in " ".join(out.split())


def test_the_wheel_ships_the_configs_py_typed_and_the_licence(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("building the wheel offline needs setuptools>=77 in this environment")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src)
    shutil.copytree(
        REPO / "lightning_commstrats", src / "lightning_commstrats", ignore=shutil.ignore_patterns("__pycache__")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("lightning_commstrats-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert {f"lightning_commstrats/configs/{name}.yaml" for name in packaged_configs()} <= names
        assert "lightning_commstrats/py.typed" in names
        (licence,) = (n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert archive.read(licence).startswith(b"Copyright 2026 The lightning-commstrats developers")
        (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in archive.read(metadata).decode()
