"""One replica of a fault-tolerant run: 4-bit DiLoCo across replicas that may die and come back.

Start a Lighthouse first, then this script once per replica, each with its own name::

    commstrats-lighthouse --port 29510 --min-replicas 2 &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    python replicas.py r0 & python replicas.py r1; wait

Each replica is a job of its own, here one CPU rank. Every 8 steps the replicas alive average their
pseudo-gradients through torchft. A replica killed and started again with the same name heals from a
live one and goes on with the run. Needs the ``[ft]`` extra.
"""

import sys

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_commstrats import CommStatsMonitor, DiLoCoStrategy

if __name__ == "__main__":
    replica_id = sys.argv[1]  # unique in the run, the same after a restart
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,  # this replica's devices: a replica can be a multi-rank job of its own
        strategy=DiLoCoStrategy(
            sync_period=8,
            pseudo_grad_bits=4,
            fault_tolerance={"replica_id": replica_id, "min_replicas": 2},  # the Lighthouse from TORCHFT_LIGHTHOUSE
        ),
        max_steps=32,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CommStatsMonitor()],  # at the end: [comm], [memory] and this replica's [ft] line
    )
    model = BoringModel()
    trainer.fit(model)
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"replica {replica_id} stopped at step {trainer.global_step}; weights sum {checksum:.6f}")
