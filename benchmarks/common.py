"""What the benchmarks share: their ranks' processes, a quiet Trainer, the recipe's command, the results.

Processes. A benchmark starts its ranks as ``torchrun`` would (``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK`` in each one's environment; :func:`localhost_env`,
:func:`node_env`), each writing to ``log<i>.txt`` (:func:`run_ranks`), waits for them all until a
deadline or the first failure and then kills what still runs (:func:`wait_all`, :func:`stop`), so a
failed or stuck rank never leaves the others waiting. Ranks that write ``rank<r>.json``
(:func:`finish_rank`) are read back with :func:`read_rank_results`.

Training. :func:`quiet_trainer` is a Trainer that logs, checkpoints and prints nothing of its own;
:func:`train_lm_command` and :func:`run_recipe` run ``recipes/train_lm.py fit`` as a child process.

Results. :func:`write_results` writes ``results.md`` and ``results.json`` into the output folder.

Only the standard library is imported here; Lightning and torch where a function needs them, so a
launcher stays light.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = REPO / "lightning_commstrats" / "configs"
RANK_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "RANK")

# ---------------------------------------------------------------- environments


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_free_env() -> dict[str, str]:
    """This environment without the rank variables of an enclosing launch, so a run starts its own."""
    return {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}


def prepend_pythonpath(env: dict[str, str], *paths: str | Path | None) -> dict[str, str]:
    """Put ``paths`` (None skipped) in front of ``env``'s ``PYTHONPATH``, in place; returns ``env``."""
    joined = os.pathsep.join(str(p) for p in [*paths, env.get("PYTHONPATH")] if p)
    if joined:
        env["PYTHONPATH"] = joined
    return env


def child_env(*paths: str | Path | None, threads: int | None = 1) -> dict[str, str]:
    """The environment of a benchmark's child process: :func:`launcher_free_env`, unbuffered output,
    ``OMP_NUM_THREADS=threads`` (left as it is for None) and ``paths`` in front of ``PYTHONPATH``."""
    env = launcher_free_env()
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return prepend_pythonpath(env, *paths)


def localhost_env(world: int, *paths: str | Path | None) -> dict[str, str]:
    """:func:`child_env` with what ``torchrun`` gives the ``world`` ranks of one machine (a free port on
    127.0.0.1, node 0); each rank adds its ``LOCAL_RANK`` (:func:`local_rank`)."""
    env = child_env(*paths)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), NODE_RANK="0")
    return env


def node_env(env: dict[str, str], rank: int, world: int, master_addr: str, port: int) -> dict[str, str]:
    """``env`` with what ``torchrun`` gives rank ``rank`` of ``world`` ranks that run one per node."""
    return {
        **env,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "NODE_RANK": str(rank),
        "LOCAL_RANK": "0",
    }


# ---------------------------------------------------------------- processes


def popen_on(cluster: Any, host: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """Start ``cmd`` on host ``host`` of an emulated cluster (``cluster.py``), or here when it is None."""
    return cluster.popen(host, cmd, **kwargs) if cluster is not None else subprocess.Popen(cmd, **kwargs)


def local_rank(cmd: Sequence[str], env: dict[str, str], rank: int, log: IO[str], **kwargs: Any) -> subprocess.Popen:
    """Start ``cmd`` as local rank ``rank`` of this machine, its output into ``log``, in a process group of
    its own (so that :func:`stop` ends whatever it started too)."""
    return subprocess.Popen(
        cmd,
        env={**env, "LOCAL_RANK": str(rank)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        **kwargs,
    )


def stop(procs: Sequence[subprocess.Popen]) -> None:
    """Kill every process still running and reap them all; one that leads its own process group (started
    with ``start_new_session``) is killed with its group."""
    for p in procs:
        if p.poll() is None:
            try:
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
            except ProcessLookupError:
                pass
        p.wait()


def wait_all(procs: Sequence[subprocess.Popen], deadline: float, grace: float = 0.0) -> None:
    """Wait for every process until ``deadline`` (a ``time.perf_counter()`` value) or until one fails (then
    ``grace`` seconds more, for the others to log their side of it), then :func:`stop` those still
    running: a failed or stuck rank never leaves the others waiting."""
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(grace)
                break
            if time.perf_counter() > deadline:
                break
            time.sleep(0.2)
    finally:
        stop(procs)


def run_ranks(
    start: Callable[[int, IO[str]], subprocess.Popen], n: int, log_dir: Path, timeout: float, grace: float = 0.0
) -> list[subprocess.Popen]:
    """Start ``n`` ranks, rank ``i`` by ``start(i, log)`` with ``log`` open on ``log_dir/log<i>.txt``, and
    :func:`wait_all` for them for at most ``timeout`` seconds; the processes, every one ended (an error
    on the way kills those started)."""
    logs = [open(Path(log_dir) / f"log{i}.txt", "w") for i in range(n)]
    procs: list[subprocess.Popen] = []
    try:
        deadline = time.perf_counter() + timeout
        for i, log in enumerate(logs):
            procs.append(start(i, log))
        wait_all(procs, deadline, grace)
    finally:
        stop(procs)
        for log in logs:
            log.close()
    return procs


def failed_ranks(procs: Sequence[subprocess.Popen]) -> list[int]:
    """The ranks whose process did not exit with status 0 (a killed one included)."""
    return [i for i, p in enumerate(procs) if p.returncode != 0]


def log_tail(log_dir: Path, rank: int, chars: int = 3000) -> str:
    """The last ``chars`` characters of rank ``rank``'s ``log<rank>.txt``."""
    return (Path(log_dir) / f"log{rank}.txt").read_text()[-chars:]


def rank_tails(procs: Sequence[subprocess.Popen], log_dir: Path, chars: int) -> str:
    """Every rank's exit status and the end of its log, for an error message."""
    return "\n".join(
        f"--- rank {r} (exit {p.returncode}) ---\n{log_tail(log_dir, r, chars)}" for r, p in enumerate(procs)
    )


def wait_for_line(path: Path, text: str, proc: subprocess.Popen, timeout: float, what: str) -> str:
    """The log at ``path`` once ``text`` is in it; a RuntimeError naming ``what`` when ``proc`` ends or
    ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while text not in (log := path.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start:\n{log[-3000:]}")
        time.sleep(0.1)
    return log


def finish_rank(out: str | Path, rank: int, result: Any) -> None:
    """A rank's last act: ``result`` into ``out/rank<rank>.json``, then the process group closed together."""
    import torch

    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def read_rank_results(out: str | Path, world: int) -> list[Any]:
    """What :func:`finish_rank` wrote for each of the ``world`` ranks, in rank order."""
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------- training


def quiet_trainer(*, validate: bool = True, **kwargs: Any) -> Any:
    """A Lightning ``Trainer`` on the CPU that writes and prints nothing of its own: no logger, no
    checkpoints, no progress bar, no model summary; without validation (and its sanity check) when
    ``validate`` is False. ``kwargs`` are the Trainer's and win over these."""
    import lightning as L

    quiet: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if not validate:
        quiet.update(limit_val_batches=0, num_sanity_val_steps=0)
    return L.Trainer(**{**quiet, **kwargs})


def strategy_json(name: str, init_args: dict[str, Any]) -> str:
    """Registered strategy ``name`` with ``init_args``, as the recipe's ``--trainer.strategy`` takes it."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_commstrats  # noqa: F401 - registers the names

    if name not in StrategyRegistry:
        raise SystemExit(f"strategy {name!r} is not registered; registered: {sorted(StrategyRegistry)}")
    cls = StrategyRegistry[name]["strategy"]
    return json.dumps({"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args})


def train_lm_command(config: str | Path, *args: str) -> list[str]:
    """The command of ``recipes/train_lm.py fit --config <config> <args>`` in this interpreter."""
    return [sys.executable, str(REPO / "recipes" / "train_lm.py"), "fit", "--config", str(config), *args]


def run_recipe(cmd: list[str], env: dict[str, str], label: str, log: Path, header: str = "") -> float:
    """Run ``cmd`` in the repository to its end, its output (after ``header``) into ``log``; its wall seconds.
    A failure exits with the end of the output."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(header + output)
    if proc.returncode:
        raise SystemExit(f"{label} failed (log: {log}):\n{output[-3000:]}")
    return wall


def transformer_args(vocab: int, seq_len: int, d_model: int, blocks: int, heads: int, lr: float = 1e-3) -> dict:
    """``LanguageModel`` arguments of a Transformer LM: FFN 4 x ``d_model``, tied, no dropout, AdamW."""
    return {
        "arch": "transformer",
        "vocab_size": vocab,
        "hidden_dim": d_model,
        "num_layers": blocks,
        "num_heads": heads,
        "ffn_dim": 4 * d_model,
        "max_seq_len": seq_len,
        "dropout": 0.0,
        "tie_weights": True,
        "optimizer": "adamw",
        "lr": lr,
    }


def zipf_batches(rank: int, steps: int, batch: int, seq_len: int, vocab: int, seed: int = 0) -> list[Any]:
    """``steps`` batches ``(inputs, targets)`` of this rank: a Zipf(1) stream over ``vocab`` words."""
    import torch

    g = torch.Generator().manual_seed(10_000 * seed + rank)
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    tokens = torch.multinomial(probs / probs.sum(), steps * batch * (seq_len + 1), replacement=True, generator=g)
    tokens = tokens.view(steps, batch, seq_len + 1)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


# ---------------------------------------------------------------- measuring and results


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def write_results(out: str | Path, text: str, data: Any, **json_kwargs: Any) -> None:
    """``text`` as ``out/results.md`` and ``data`` as ``out/results.json`` (``indent=1`` unless
    ``json_kwargs`` say otherwise), the folder made if need be."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(data, **{"indent": 1, **json_kwargs}))
