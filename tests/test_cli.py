"""The recipe CLI's surface: packaged configs found by name, plain help text, what the wheel ships."""

import functools
import importlib.resources
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from lightning_commstrats import DiLoCoStrategy
from lightning_commstrats.cli import CONFIG_DIR, main, packaged_configs, resolve_config, strategy_names_as_class_paths

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
    with pytest.raises(ValueError, match="packaged configs: ffn_paper, lstm_autoadjust, lstm_demo"):
        resolve_config(value)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"no file {value!r}" in err
    assert all(name in err for name in packaged_configs())


DILOCO = "lightning_commstrats.DiLoCoStrategy"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trainer.strategy=diloco", "--trainer.strategy.pseudo_grad_bits=4"], [f"--trainer.strategy={DILOCO}"]),
        (
            ["--trainer.strategy", "diloco", "--trainer.strategy.init_args.sync_period", "7"],
            ["--trainer.strategy", DILOCO],
        ),
        # the name in a config (lstm_tiny: allreduce) is given as its class path before the setting
        (
            ["--config", "lstm_tiny", "--trainer.strategy.bucket_cap_mb=5"],
            ["--config", "lstm_tiny", "--trainer.strategy=lightning_commstrats.AllReduceStrategy"],
        ),
        # settings belong to the strategy given last
        (
            ["--trainer.strategy=bmuf", "--trainer.strategy=diloco", "--trainer.strategy.outer_lr=0.5"],
            ["--trainer.strategy=bmuf", f"--trainer.strategy={DILOCO}"],
        ),
        (["--trainer.strategy=diloco"], ["--trainer.strategy=diloco"]),  # no setting: a name, as the Trainer takes it
        (["--trainer.strategy.help", "diloco"], ["--trainer.strategy.help", DILOCO]),
        # a class path alone would reach the Trainer as a string
        ([f"--trainer.strategy={DILOCO}"], [f'--trainer.strategy={{"class_path": "{DILOCO}"}}']),
    ],
    ids=["equals", "space", "config", "last", "alone", "help", "class-path"],
)
def test_a_package_name_followed_by_settings_becomes_its_class_path(args, expected):
    out = strategy_names_as_class_paths(["fit", *args])
    assert out[: len(expected) + 1] == ["fit", *expected]
    assert [a for a in out if a.startswith("--trainer.strategy.") and ".help" not in a] == [
        a for a in args if a.startswith("--trainer.strategy.") and ".help" not in a
    ]


def test_settings_after_a_name_print_and_train(capsys):
    args = ["--config", "lstm_tiny", "--trainer.strategy=diloco", "--trainer.strategy.pseudo_grad_bits=4"]
    strategy = _print_config(capsys, *args)["trainer"]["strategy"]
    assert strategy["class_path"] == DILOCO and strategy["init_args"]["pseudo_grad_bits"] == 4
    cli = main(["fit", *args, "--trainer.strategy.sync_period=3", "--trainer.max_steps=3"])
    assert isinstance(cli.trainer.strategy, DiLoCoStrategy)
    assert cli.trainer.strategy.pseudo_grad_bits == 4 and cli.trainer.strategy.sync_period == 3
    assert cli.trainer.global_step == 3


@pytest.mark.parametrize(
    "args",
    [["--trainer.strategy=dilocco"], ["--trainer.strategy=dilocco", "--trainer.strategy.pseudo_grad_bits=4"]],
    ids=["alone", "with-settings"],
)
def test_a_misspelled_strategy_is_a_usage_error_with_the_nearest_names(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "lstm_tiny", *args])
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--trainer.strategy='dilocco' is not a registered strategy name; did you mean 'diloco'?" in err
    assert "lightning_commstrats registers allreduce, onebit_sgd, model_averaging, bmuf" in err


def test_settings_after_another_package_s_name_say_what_to_type():
    with pytest.raises(ValueError, match=r"give its class path before the settings \(--trainer.strategy=<class path>"):
        strategy_names_as_class_paths(
            ["fit", "--trainer.strategy=ddp", "--trainer.strategy.find_unused_parameters=true"]
        )


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


def test_fix_mmap_threshold_is_applied_before_the_model_is_built_and_only_when_asked(capsys, monkeypatch):
    import lightning_commstrats.cli as cli_module
    from lightning_commstrats.models import LanguageModel

    events = []
    monkeypatch.setattr(cli_module, "fix_mmap_threshold", lambda: events.append("fixed") or (True, "fixed here"))
    built = LanguageModel.__init__

    @functools.wraps(built)  # the CLI reads the model's settings from this signature
    def build(self, *args, **kwargs):
        events.append("model built")
        built(self, *args, **kwargs)

    monkeypatch.setattr(LanguageModel, "__init__", build)
    assert _print_config(capsys, "--config", "lstm_tiny")["fix_mmap_threshold"] is False
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "0")  # recorded, so the test's own setting is undone after it
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    main(["fit", "--config", "lstm_tiny", "--trainer.max_steps=1"])
    assert events == ["model built"] and "MALLOC_MMAP_THRESHOLD_" not in os.environ
    events.clear()
    main(["fit", "--config", "lstm_tiny", "--trainer.max_steps=1", "--fix_mmap_threshold=true"])
    assert events == ["fixed", "model built"]
    # and ranks started afresh from this process (spawn) read it from their environment at start
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "131072"
