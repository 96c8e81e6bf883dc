"""One site: Lightning's ``ddp`` swapped for a scheme of the package.

Two CPU ranks (gloo) train Lightning's ``BoringModel`` for 32 steps under 4-bit DiLoCo, syncing every
8 steps. ``python one_site.py`` runs it; ``python one_site.py ddp`` runs the same fit under Lightning's
``ddp`` for comparison (no bytes counted there).
"""

import sys

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_commstrats  # noqa: F401  (registers the strategy names with Lightning)
from lightning_commstrats import CommStatsMonitor, DiLoCoStrategy

if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    if len(sys.argv) > 1:
        strategy = sys.argv[1]  # a registered name: "ddp", "allreduce", "diloco"...
    else:
        strategy = DiLoCoStrategy(sync_period=8, pseudo_grad_bits=4)  # the one line that changes
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,  # two processes on this machine: Lightning starts the second one itself
        strategy=strategy,
        max_steps=32,
        callbacks=[CommStatsMonitor()],  # prints a [comm] summary line at the end of fit
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    stats = getattr(trainer.strategy, "comm_stats", None)
    if trainer.global_rank == 0 and stats is not None:
        print(f"rank 0 sent {stats.bytes_sent} bytes in {stats.calls} collectives over {stats.steps} steps")
