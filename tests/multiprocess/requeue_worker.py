"""One rank of a SLURM requeue trial (started by ``tests/strategies/test_stop_requeue.py`` through
``tests/harness.py``'s ``run_ranks``).

Usage: ``requeue_worker.py SPEC_JSON OUT_DIR``. The rank makes its environment that of a SLURM task
of job 4242 (``SLURM_PROCID`` from the harness's ``LOCAL_RANK``...), so Lightning picks
``SLURMEnvironment`` with ``auto_requeue`` and registers its requeue handler for SIGUSR1. A fake
``scontrol`` comes first on ``PATH``: it only writes its arguments to ``OUT_DIR/scontrol.log``.

The rank trains the small LM of ``worker.py`` with ``spec["strategy"]`` for up to
``spec["max_steps"]`` steps. ``spec["signal"]`` (``{"rank": s, "target": t, "nth": n}``): rank ``s``
sends SIGUSR1 to rank ``t`` at the ``n``-th data collective (gradients, weights): once ``t`` has
entered it (``t`` touches ``OUT_DIR/inside<t>``), and before ``s`` enters it itself (0.3 s later),
so a target other than itself is blocked inside that collective when the signal comes.

Every call of ``Trainer.save_checkpoint`` is recorded with the step, how deep in a data collective
the rank was, and whether a signal handler or the agreement's ``poll`` was on the stack. The rank
saves ``OUT_DIR/rank<r>.pt``: those records, the exception fit ended on, the step, the ``scontrol``
commands this process ran and (rank 0) the global step of the HPC checkpoint it saved.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from worker import TinyLM

import lightning_commstrats  # noqa: F401 - registers the strategies
from lightning_commstrats.comm import destroy_process_group

JOB_ID = "4242"


def become_slurm_task(out: Path) -> int:
    rank = int(os.environ.pop("LOCAL_RANK"))
    world = os.environ.pop("WORLD_SIZE")
    os.environ.pop("NODE_RANK", None)
    os.environ.update(
        SLURM_NTASKS=world,
        SLURM_NTASKS_PER_NODE=world,
        SLURM_NNODES="1",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODEID="0",
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NAME="requeue-trial",
    )
    os.environ.pop("SLURM_ARRAY_JOB_ID", None)
    bin_dir = out / f"bin{rank}"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$PPID $*" >> "{out / "scontrol.log"}"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return rank


class Probe(L.Callback):
    """Sends the signal at the spec's collective and records the saves (see the module)."""

    def __init__(self, out: Path, rank: int, spec: dict[str, Any] | None) -> None:
        self.out, self.rank, self.spec = out, rank, spec
        self.collectives = 0
        self.depth = 0
        self.saves: list[dict[str, Any]] = []
        self.noted_in_collective = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        comm = strategy.comm
        for method in ("all_reduce", "all_gather"):
            original = getattr(comm, method)

            def collective(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                noted_before = strategy.stop_agreement.requeue_requested
                if kwargs.get("tag") in ("grad", "weights"):
                    self.before_data_collective()
                self.depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.depth -= 1
                    if strategy.stop_agreement.requeue_requested and not noted_before:
                        self.noted_in_collective = True  # the handler ran while this rank was inside it

            setattr(comm, method, collective)
        save = trainer.save_checkpoint

        def recorded_save(path: Any, *args: Any, **kwargs: Any) -> Any:
            frames = traceback.extract_stack()
            names = [f.name for f in frames]
            in_handler = "notify_requeue" in names or any(
                f.name == "__call__" and f.filename.endswith("signal_connector.py") for f in frames
            )
            self.saves.append(
                {
                    "step": trainer.global_step,
                    "collective_depth": self.depth,
                    "in_handler": in_handler,
                    "in_poll": "poll" in names,
                    "path": str(path),
                }
            )
            return save(path, *args, **kwargs)

        trainer.save_checkpoint = recorded_save  # type: ignore[method-assign]

    def before_data_collective(self) -> None:
        spec = self.spec
        self.collectives += 1
        if spec is None or self.collectives != spec["nth"]:
            return
        inside = self.out / f"inside{spec['target']}"
        if self.rank == spec["target"]:
            inside.touch()  # the sender waits for this: the signal comes once this rank is in the collective
        if self.rank != spec["rank"]:
            return
        if spec["target"] != self.rank:
            deadline = time.monotonic() + 60.0
            while not inside.exists():  # the target waits for this rank in the collective
                assert time.monotonic() < deadline, "the target never reached the collective"
                time.sleep(0.01)
        os.kill(int((self.out / f"pid{spec['target']}").read_text()), signal.SIGUSR1)
        time.sleep(0.3)  # the target blocked in the collective when the signal comes


class OnStop(L.Callback):
    def __init__(self) -> None:
        self.exception: BaseException | None = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.exception = exception


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    rank = become_slurm_task(out)
    (out / f"pid{rank}").write_text(str(os.getpid()))
    L.seed_everything(7, verbose=False)
    model = TinyLM(batch_size=4)
    strategy = L.pytorch.strategies.StrategyRegistry[spec["strategy"]]["strategy"](**spec.get("kwargs", {}))
    probe, on_stop = Probe(out, rank, spec.get("signal")), OnStop()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["SLURM_NTASKS"]),
        strategy=strategy,
        max_steps=spec.get("max_steps", 200),
        max_epochs=-1,
        default_root_dir=str(out / "root"),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe, on_stop],
    )
    try:
        trainer.fit(model)
    except SIGTERMException:  # the stop after the requeue; any other error fails the rank (and the test)
        pass
    log = out / "scontrol.log"
    lines = log.read_text().splitlines() if log.exists() else []
    mine = [line.split()[1:] for line in lines if line.split()[0] == str(os.getpid())]
    hpc_step = None
    if rank == 0 and probe.saves:
        hpc_step = torch.load(probe.saves[0]["path"], weights_only=False)["global_step"]
    result = {
        "rank": rank,
        "exception": type(on_stop.exception).__name__ if on_stop.exception is not None else None,
        "step": trainer.global_step,
        "saves": probe.saves,
        "requeue_noted_in_collective": probe.noted_in_collective,
        "scontrol": mine,
        "hpc_step": hpc_step,
    }
    torch.save(result, out / f"rank{rank}.pt")
    destroy_process_group()


if __name__ == "__main__":
    main()
