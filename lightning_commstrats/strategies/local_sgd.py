"""``local_sgd``: weights averaged every ``Q`` steps over MPI, launched with ``mpiexec``."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_commstrats.comm import MPI4PY_AVAILABLE, import_mpi
from lightning_commstrats.strategies.periodic import ModelAveragingStrategy


class LocalSGDStrategy(ModelAveragingStrategy):
    """Local SGD over mpi4py: the weight exchange of the common mpi4py data-parallel recipe.

    Stores, like ``model_averaging``, the global model of the last exchange and the counters.

    1. At start, rank 0's weights are broadcast (``MPI.COMM_WORLD.Bcast``);
    2. every rank trains on its own shard of the data (Lightning's distributed sampler);
    3. every ``sync_period`` (``Q``) optimizer steps, every parameter tensor is ``Allreduce``d in
       place (the tensor's own memory is the MPI buffer, no copy) and divided by the world size.

    It is model averaging with the period counted in steps and MPI as the transport: the result
    equals ``model_averaging`` with the same period over gloo. Start it under MPI::

        mpiexec -n 4 python recipes/train_lm.py fit --config ... --trainer.strategy=local_sgd --trainer.devices=4

    Lightning's ``MPIEnvironment`` reads the ranks from MPI. Without ``mpiexec`` only ``devices=1``
    runs (there is nobody to talk to).

    Args:
        sync_period: ``Q``, optimizer steps between exchanges (default 8). Larger ``Q`` sends
            ``1/Q`` of the model's all-reduce per step but lets models drift apart.
        average_optimizer_state: average the optimizers' float state at each exchange too.
        **kwargs: :class:`~lightning_commstrats.strategies.base.CommStrategy` arguments
            (``backend`` is always ``"mpi"``).
    """

    strategy_name = "local_sgd"

    def __init__(self, sync_period: int = 8, average_optimizer_state: bool = False, **kwargs: Any) -> None:
        if not MPI4PY_AVAILABLE:
            raise ModuleNotFoundError(
                f"local_sgd needs mpi4py and an MPI runtime: `pip install mpi4py mpich` ({MPI4PY_AVAILABLE})"
            )
        import_mpi()  # fails now, with the reason, when mpi4py cannot load an MPI library
        backend = kwargs.pop("backend", "mpi")
        if backend not in ("mpi", "auto"):  # "auto" is MPI here: a CLI fills in the base default
            raise ValueError(f"local_sgd talks MPI only; backend={backend!r} is not allowed")
        kwargs["backend"] = "mpi"
        super().__init__(
            sync_period=sync_period,
            sync_period_unit="steps",
            average_optimizer_state=average_optimizer_state,
            **kwargs,
        )

    @override
    def averaged_weights(self) -> torch.Tensor:
        if self.world_size > 1:
            with torch.no_grad():
                for p in self.params:
                    # in place on the parameter's own CPU memory: mpi4py takes it as the buffer
                    self.comm.all_reduce(p.data, "sum", tag="weights")
                    p.data.div_(self.world_size)
        return self.flat_weights()
