"""The console commands as a user runs them: exit status 0 after a successful run and non-zero on a
bad setting, with no stray repr; and the recipe CLI's errors, one line naming the setting (the
nearest settings for a misspelled one, the types allowed for a bad value), not 90 lines of usage or
a traceback."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import _base_env

from lightning_commstrats.cli import main

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def pyproject_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: command -> ``module:function``."""
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.:]+)"', section, flags=re.MULTILINE))


def run(command: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=_base_env(), cwd=REPO, check=False
    )


def installed(command: str) -> Path:
    path = BIN / command
    if not path.exists():
        pytest.skip(f"{command} is not installed beside this interpreter (pip install -e .)")
    return path


def lighthouse_until_listening_then_sigterm(extra: list[str]) -> tuple[int, str]:
    proc = subprocess.Popen(
        [str(installed("commstrats-lighthouse")), "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_base_env(),
    )
    try:
        assert proc.stdout is not None
        out = ""
        deadline = time.monotonic() + 60
        while "listening at" not in out and time.monotonic() < deadline and proc.poll() is None:
            out += proc.stdout.readline()
        assert "listening at" in out, out
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=20)
        return proc.returncode, out + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# for every console command: a successful run, and a bad setting
OK = {
    "commstrats-lm": ["fit", "--config", "lstm_tiny", "--trainer.max_steps=2"],
    "commstrats-advise": ["--config", "lstm_tiny", "--bandwidth", "100", "--compute-seconds", "0.1", "--ranks", "2"],
    "commstrats-lighthouse": None,  # serves until stopped: started, then SIGTERM
}
BAD = {
    "commstrats-lm": ["fit", "--config", "lstm_tiny", "--trainer.max_stepz=2"],
    "commstrats-advise": ["--config", "lstm_tiny", "--bandwidth", "100", "--compute-seconds", "0.1", "--ranks", "0"],
    "commstrats-lighthouse": ["--min-replicas", "0"],
}


def test_every_console_command_is_tested_and_installed_as_declared():
    declared = pyproject_scripts()
    assert set(declared) == set(OK) == set(BAD)
    assert declared["commstrats-lm"] == "lightning_commstrats.cli:console_main"  # not main, which returns the CLI
    for command, target in declared.items():  # the scripts pip wrote call what pyproject names
        module, function = target.split(":")
        script = installed(command).read_text()
        assert f"from {module} import {function}\n" in script, (
            f"{command} is older than pyproject.toml: pip install -e ."
        )


@pytest.mark.parametrize("command", sorted(OK))
def test_a_console_command_exits_0_after_success_without_a_repr(command):
    if OK[command] is None:
        code, out = lighthouse_until_listening_then_sigterm([])
    else:
        done = run([str(installed(command)), *OK[command]])
        code, out = done.returncode, done.stdout + done.stderr
    assert code == 0, out[-3000:]
    assert not re.search(r"<[\w.]+ object at 0x[0-9a-f]+>", out), out[-3000:]
    if command == "commstrats-lm":  # 2 steps, below lstm_tiny's first validation (step 3): still printed
        assert re.search(r"^\[lm\] valid perplexity [\d.]+; unigram baseline", out, flags=re.MULTILINE), out[-3000:]


@pytest.mark.parametrize("command", sorted(BAD))
def test_a_console_command_exits_non_zero_on_a_bad_setting(command):
    done = run([str(installed(command)), *BAD[command]])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    if command == "commstrats-lm":
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        (error,) = errors
        assert error.startswith("error: --trainer.max_stepz is not a setting; did you mean --trainer.max_steps")
        assert "commstrats-lm fit --help lists every setting" in done.stderr
        assert len([line for line in done.stderr.splitlines() if line.strip()]) <= 4, done.stderr


def test_python_m_cli_exits_0():
    done = run(
        [sys.executable, "-m", "lightning_commstrats.cli", "fit", "--config", "lstm_tiny", "--trainer.max_steps=1"]
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "object at 0x" not in done.stdout + done.stderr


def test_main_still_returns_the_cli_for_programs():
    cli = main(["fit", "--config", "lstm_tiny", "--trainer.max_steps=1"])
    assert cli.trainer.global_step == 1 and cli.model is not None


DILOCO = ["--trainer.strategy=diloco"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.lrr=1"], "--model.lrr is not a setting; did you mean --model.lr?"),
        # argparse would take a prefix for the whole name: refused, and the name suggested
        (["--trainer.max_step=3"], "--trainer.max_step is not a setting; did you mean --trainer.max_steps"),
        (["--trainer.max_steps=abc"], "--trainer.max_steps=abc: expected int"),
        (["--trainer.max_epochs=1.5"], "--trainer.max_epochs=1.5: expected int or null"),
        (["--trainer.precision=17"], "--trainer.precision=17: expected one of 64, 32, 16, 'transformer-engine'"),
        (
            [*DILOCO, "--trainer.strategy.sync_period=abc"],
            "--trainer.strategy.sync_period=abc: expected int (lightning_commstrats.DiLoCoStrategy)",
        ),
        (
            [*DILOCO, "--trainer.strategy.sync_periodd=3"],
            "--trainer.strategy.sync_periodd is not a setting of lightning_commstrats.DiLoCoStrategy; did you mean"
            " --trainer.strategy.sync_period? (--trainer.strategy.help lightning_commstrats.DiLoCoStrategy lists them)",
        ),
        # refused by the constructors, after parsing: the strategy's, the model's, the data's, the Trainer's
        (
            [*DILOCO, "--trainer.strategy.pseudo_grad_bits=3"],
            "--trainer.strategy.pseudo_grad_bits=3 is not supported; choose one of (2, 4, 8, 16, 32)",
        ),
        (["--model.arch=lsmt"], "--model.arch='lsmt' is not supported; choose one of ('lstm', 'ffn', 'transformer')"),
        (["--data.batch_size=0"], "--data.batch_size must be > 0, got 0"),
        (["--trainer.max_epochs=-5"], "--trainer.max_epochs must be a non-negative integer or -1"),
    ],
    ids=[
        "unknown",
        "abbreviated",
        "not-an-int",
        "union",
        "literal",
        "strategy-type",
        "strategy-unknown",
        "strategy-refused",
        "model-refused",
        "data-refused",
        "trainer-refused",
    ],
)
def test_a_bad_setting_is_one_line_naming_it(args, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "lstm_tiny", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {expected}"), err
    assert "usage:" not in err and "Traceback" not in err and "Given value" not in err
    assert len([line for line in err.splitlines() if line.strip()]) <= 2, err


def test_an_unknown_key_in_a_config_file_is_named_with_the_nearest(tmp_path, capsys):
    config = tmp_path / "my.yaml"
    config.write_text("trainer:\n  max_stepz: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "lstm_tiny", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: trainer.max_stepz is not a setting (in a config); did you mean trainer.max_steps" in err


def test_the_top_level_usage_is_still_printed_it_is_short(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fitt"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "{fit,validate,test,predict}" in err


def test_the_advisors_help_answers_without_torch_or_lightning():
    # the installed command, as a user runs it; then the same door in a fresh interpreter, asked which
    # modules it imported
    done = run([str(installed("commstrats-advise")), "--help"])
    assert done.returncode == 0 and "--activation-checkpointing" in done.stdout, done.stderr[-2000:]
    probe = (
        "import sys; sys.argv = ['commstrats-advise', '--help']\n"
        "import lightning_commstrats_launch as door\n"
        "try:\n    door.advise()\nexcept SystemExit as e:\n    code = e.code\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'lightning_commstrats.strategies') if m in sys.modules)\n"
        "print('RESULT', code, heavy, 'lightning_commstrats' in sys.modules)\n"
    )
    out = run([sys.executable, "-c", probe]).stdout
    assert "RESULT 0 [] False" in out, out[-2000:]
