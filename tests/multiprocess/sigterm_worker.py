"""One rank of a SIGTERM trial (started by ``tests/multiprocess/test_sigterm_ranks.py``).

Usage: ``sigterm_worker.py SPEC_JSON OUT_DIR``. The rank writes ``OUT_DIR/pid<rank>`` when it starts,
trains the small LM of ``worker.py`` with ``spec["strategy"]`` (``spec["kwargs"]``) for up to
``spec["max_steps"]`` steps, and writes ``OUT_DIR/result<rank>.json`` when fit is over: whether it
ended on Lightning's ``SIGTERMException``, at which step, and when.

``spec["signal"]`` (optional) makes this rank send SIGTERM from inside the run, at an exact point:
``{"rank": s, "target": t, "where": w, "nth": n}``: rank ``s`` sends it to rank ``t`` (itself when
``s == t``) at the ``n``-th time it reaches ``w``:

* ``"batch"``: the start of its training step;
* ``"flat_weights"``: inside a periodic scheme's ``flat_weights`` (the start of an exchange);
* ``"collective"``: just before one of its data collectives (gradients, weights); the sender then
  waits 0.3 s before entering it, so a target other than itself is blocked inside the collective
  when the signal comes;
* ``"exchange"``: inside ``average_pseudo_gradient`` (a background thread for ``streaming_diloco``);
* ``"validation"``: inside a validation step.

The time the signal was sent goes to ``OUT_DIR/signal.json``. Without ``spec["signal"]`` the test
sends it from outside, at a time of its choosing, once ``OUT_DIR/running<rank>`` exists.
``spec["checkpoint"]``: on ``SIGTERMException`` every rank saves ``OUT_DIR/stopped.ckpt``
(the checkpoint's collectives must meet on every rank).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
from worker import TinyLM

import lightning_commstrats  # noqa: F401 - registers the strategies
from lightning_commstrats.comm import destroy_process_group

try:
    from lightning.pytorch.utilities.exceptions import SIGTERMException
except ImportError:  # pragma: no cover
    SIGTERMException = SystemExit  # type: ignore[assignment,misc]


def this_rank() -> int:
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        return int(os.environ["OMPI_COMM_WORLD_RANK"])
    if "PMI_RANK" in os.environ:
        return int(os.environ["PMI_RANK"])
    return int(os.environ.get("LOCAL_RANK", 0))


class Injector(L.Callback):
    """Sends SIGTERM from inside the run at the point the spec names (see the module)."""

    def __init__(self, out: Path, rank: int, spec: dict[str, Any] | None) -> None:
        self.out, self.rank, self.spec = out, rank, spec
        self.counts: dict[str, int] = {}
        self.sent = False

    def reach(self, where: str) -> bool:
        """Count a visit of ``where``; send the signal on the one the spec names. True when sent now."""
        spec = self.spec
        if spec is None or self.sent or spec["rank"] != self.rank or spec["where"] != where:
            return False
        self.counts[where] = self.counts.get(where, 0) + 1
        if self.counts[where] < spec["nth"]:
            return False
        self.sent = True
        target = self.out / f"pid{spec['target']}"
        while not target.exists():
            time.sleep(0.01)
        (self.out / "signal.json").write_text(json.dumps({"time": time.time(), "where": where}))
        os.kill(int(target.read_text()), signal.SIGTERM)
        return True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if hasattr(strategy, "flat_weights"):
            flat_weights = strategy.flat_weights

            def flat_weights_then(*args: Any, **kwargs: Any) -> Any:
                self.reach("flat_weights")
                return flat_weights(*args, **kwargs)

            strategy.flat_weights = flat_weights_then
        if hasattr(strategy, "average_pseudo_gradient"):
            average = strategy.average_pseudo_gradient

            def average_then(*args: Any, **kwargs: Any) -> Any:
                self.reach("exchange")
                return average(*args, **kwargs)

            strategy.average_pseudo_gradient = average_then
        comm = strategy.comm
        for method in ("all_reduce", "all_gather"):
            original = getattr(comm, method)

            def collective(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if kwargs.get("tag") in ("grad", "weights") and self.reach("collective"):
                    time.sleep(0.3)
                return _original(*args, **kwargs)

            setattr(comm, method, collective)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == 3:
            (self.out / f"running{self.rank}").touch()
        self.reach("batch")

    def on_validation_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self.reach("validation")


class OnStop(L.Callback):
    """Notes the exception fit ends on; with ``checkpoint``, saves the run on SIGTERM (every rank)."""

    def __init__(self, out: Path, checkpoint: bool) -> None:
        self.out, self.checkpoint = out, checkpoint
        self.exception: BaseException | None = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.exception = exception
        if self.checkpoint and isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(self.out / "stopped.ckpt")


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    rank = this_rank()
    (out / f"pid{rank}").write_text(str(os.getpid()))
    L.seed_everything(7, verbose=False)
    model = TinyLM(batch_size=4)
    strategy = L.pytorch.strategies.StrategyRegistry[spec["strategy"]]["strategy"](**spec.get("kwargs", {}))
    on_stop = OnStop(out, spec.get("checkpoint", False))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=spec["devices"],
        strategy=strategy,
        max_steps=spec.get("max_steps", 400),
        max_epochs=-1,
        val_check_interval=spec.get("val_every"),
        limit_val_batches=4 if spec.get("val_every") else 0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Injector(out, rank, spec.get("signal")), on_stop],
    )
    stopped = False
    try:
        trainer.fit(model)
    except SIGTERMException:
        stopped = True
    result = {
        "rank": rank,
        "stopped": stopped,
        "exception": type(on_stop.exception).__name__ if on_stop.exception is not None else None,
        "step": trainer.global_step,
        "time": time.time(),
        "received_sigterm": trainer.received_sigterm,
    }
    (out / f"result{rank}.json").write_text(json.dumps(result))
    destroy_process_group()


if __name__ == "__main__":
    main()
