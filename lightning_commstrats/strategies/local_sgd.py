"""``local_sgd``: weights averaged every ``Q`` steps over MPI, launched with ``mpiexec``."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_commstrats.comm import MPI4PY_AVAILABLE, import_mpi
from lightning_commstrats.strategies.model_averaging import ModelAveragingStrategy


class LocalSGDStrategy(ModelAveragingStrategy):
    """Local SGD over mpi4py: the weight exchange of the common mpi4py data-parallel recipe.

    Stores, like ``model_averaging``, the global model of the last exchange and the counters.

    1. At start, rank 0's weights are broadcast (``MPI.COMM_WORLD.Bcast``);
    2. every rank trains on its own shard of the data (Lightning's distributed sampler);
    3. every ``sync_period`` (``Q``) optimizer steps, the change of every parameter tensor since
       the last exchange (the pseudo-gradient) is summed by ``Allreduce`` in place, one call per
       tensor (the tensor's own memory is the MPI buffer, no copy), and divided by the world size.

    It is model averaging with the period counted in steps and MPI as the transport: the result
    equals ``model_averaging`` with the same period over gloo. ``pseudo_grad_bits`` < 32 sends the
    change quantized with error feedback, through the same two-stage exchange as the other schemes. Start it under MPI::

        mpiexec -n 4 python recipes/train_lm.py fit --config ... --trainer.strategy=local_sgd --trainer.devices=4

    Lightning's ``MPIEnvironment`` reads the ranks from MPI. Without ``mpiexec`` only ``devices=1``
    runs (there is nobody to talk to).

    Args:
        sync_period: ``Q``, optimizer steps between exchanges (default 8). Larger ``Q`` sends
            ``1/Q`` of the model's all-reduce per step but lets models drift apart.
        average_optimizer_state: average the optimizers' float state at each exchange too.
        pseudo_grad_bits: 32 (default: one ``Allreduce`` per tensor), 16, 8, 4 or 2.
        **kwargs: :class:`~lightning_commstrats.strategies.base.CommStrategy` arguments
            (``backend`` is always ``"mpi"``).
    """

    strategy_name = "local_sgd"
    supports_shard = False

    def __init__(
        self, sync_period: int = 8, average_optimizer_state: bool = False, pseudo_grad_bits: int = 32, **kwargs: Any
    ) -> None:
        if kwargs.get("fault_tolerance") is not None:
            raise ValueError(
                "local_sgd cannot honour fault_tolerance: an MPI job ends when one of its ranks dies; use"
                " model_averaging (the same exchange) with fault_tolerance instead"
            )
        if not MPI4PY_AVAILABLE:
            raise ModuleNotFoundError(
                'local_sgd needs mpi4py and an MPI runtime: `pip install "lightning-commstrats[mpi]"`'
                f" (or mpi4py built against your cluster's MPI); {MPI4PY_AVAILABLE}"
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
            pseudo_grad_bits=pseudo_grad_bits,
            **kwargs,
        )

    @override
    def average_pseudo_gradient(self, named: dict[str, torch.Tensor]) -> list[str]:
        if self.pseudo_grad_bits < 32:
            return super().average_pseudo_gradient(named)
        self.weigh_by_samples(named)  # weighting="samples": CNTK's weights, one count all-reduced
        for t in named.values():  # contiguous slices of one buffer: mpi4py takes each as it is
            self.comm.all_reduce(t, "avg", tag="weights")
        # every rank holds the same averages: the same answer everywhere, one host sync
        if bool(torch.stack([torch.isfinite(t).all() for t in named.values()]).all()):
            return []
        return [n for n, t in named.items() if not bool(torch.isfinite(t).all())]
