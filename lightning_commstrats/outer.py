"""Outer optimizers of the periodic schemes: the one global copy of the weights and the rule that steps it.

Pure tensor code, no Lightning and no communication. Every periodic scheme of the package (model
averaging, BMUF, local SGD, DiLoCo, Streaming DiLoCo) is the same loop: workers train alone from a
start point ``w_start`` for a block of ``H`` inner steps, then the *pseudo-gradient*

    G = w_start - mean over ranks(w_local)        (a descent direction, like a gradient)

is handed to an outer optimizer that steps the global copy, and every rank restarts from the new
start point. Which outer optimizer makes which scheme:

- model averaging: ``torch.optim.SGD(lr=1, momentum=0)``: ``w = w_start - G = mean(w_local)``;
- DiLoCo (Douillard et al. 2023): ``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)`` in the paper, momentum
  0.5 by default here (see :class:`~lightning_commstrats.strategies.diloco.DiLoCoStrategy`);
- BMUF (Chen & Huo 2016): :class:`BlockMomentum`, the block-momentum filter as the paper writes
  it, or :class:`CNTKBlockMomentum`, as CNTK's ``BlockMomentumSGD`` computes it;
- any other ``torch.optim.Optimizer`` (Adam as the outer optimizer, say) by class.

:class:`OuterOptimizer` holds the global copy as one flat float32 tensor per *fragment* (one
fragment for the classic schemes; Streaming DiLoCo syncs fragments in turn) and the optimizer over
those tensors; it is the only place the global model lives.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_commstrats.buckets import visit

OuterFactory = Callable[[list[Parameter]], Optimizer]


def block_momentum_from_time_constant(time_constant: float, sync_period: float) -> float:
    """``exp(-sync_period / time_constant)``: the block momentum of a given time constant, both in
    the same unit (samples or steps, both per worker or both over all workers: CNTK's
    ``blockMomentumAsTimeConstant`` and ``blockSize`` count samples over all workers)."""
    if not time_constant > 0:
        raise ValueError(f"block_momentum_as_time_constant must be > 0, got {time_constant}")
    return math.exp(-sync_period / time_constant)


def time_constant_from_block_momentum(block_momentum: float, sync_period: float) -> float:
    """``-sync_period / ln(block_momentum)`` (0 for no momentum)."""
    return -sync_period / math.log(block_momentum) if block_momentum > 0 else 0.0


class BlockMomentum(Optimizer):
    """The BMUF block-momentum filter (Chen & Huo, ICASSP 2016) as an optimizer over the global model.

    The parameter is the global model ``w_global``; its gradient is the pseudo-gradient
    ``G = w_start - w_avg`` of the block that just ended. With ``eta = momentum``, ``zeta = lr``::

        delta    = eta * delta - zeta * G          (the paper's  eta * delta + zeta * (w_avg - w_start))
        w_global = w_global + delta
        w_start  = w_global + eta * delta          (Nesterov, the default: where the next block starts)
                 = w_global                        (classical block momentum)

    ``momentum=0, lr=1, nesterov=False`` returns ``w_avg``: plain model averaging. The look-ahead
    point is only where the workers start; validation and checkpoints use ``w_global``
    (:meth:`start_point` versus the parameter itself). CNTK's ``BlockMomentumSGD`` with block
    learning rate ``blr`` over ``N`` workers is this filter with ``lr = N * (1 - eta) * blr`` without
    Nesterov; with Nesterov its trajectory differs (:class:`CNTKBlockMomentum`).

    Args:
        params: the global model's tensors.
        lr: the block learning rate ``zeta`` > 0.
        momentum: the block momentum ``eta`` in [0, 1).
        nesterov: start blocks from the look-ahead point.
    """

    def __init__(self, params: Any, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = True) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"block_momentum must be in [0, 1), got {momentum}")
        if not lr > 0:
            raise ValueError(f"block_learning_rate must be > 0, got {lr}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("BlockMomentum.step takes no closure")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                delta = self.state[p].get("delta")
                if delta is None:
                    delta = self.state[p]["delta"] = torch.zeros_like(p)
                delta.mul_(group["momentum"]).sub_(p.grad, alpha=group["lr"])
                p.add_(delta)

    @torch.no_grad()
    def start_point(self, p: Tensor) -> Tensor:
        """Where the next block of ``p`` starts: ``w_global + eta * delta`` with Nesterov, else ``w_global``."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        delta = self.state[p].get("delta")
        if not group["nesterov"] or delta is None:
            return p
        return p + group["momentum"] * delta


class CNTKBlockMomentum(Optimizer):
    """BMUF as CNTK's ``BlockMomentumSGD`` computes it, as an optimizer over the one model CNTK keeps.

    CNTK keeps no separate global model: the parameter is the point every block starts from,
    ``w_start`` (CNTK's ``prevParameters``, also the model it validates and saves). Its gradient is
    the averaged pseudo-gradient ``G = w_start - w_avg`` of the block that just ended; CNTK sums the
    workers' block gradients ``w_start - w_local`` instead of averaging them, which is ``N G``. With
    ``bm = momentum``, ``blr = lr``, ``sg`` CNTK's block-level smoothed gradient::

        sg      = bm * sg + (1 - bm) * blr * N * G
        w_start = w_start - sg                         (classical block momentum)
        w_start = w_start - sg - bm * sg               (Nesterov, CNTK's default)

    The filter's gain is ``(1 - bm) * blr * N`` (1 with CNTK's defaults ``bm = 1 - 1/N``,
    ``blr = 1``). Without Nesterov it equals :class:`BlockMomentum` with
    ``lr = N * (1 - bm) * blr``. With Nesterov the two differ from the second block on: CNTK's
    look-ahead ``- bm * sg`` stays in the model and the next update lands on top of it, whereas the
    paper's form steps ``w_global`` and starts each block at ``w_global + bm * delta``. Workers that
    move one unit per block from wherever they start, at ``N = 4`` with the defaults, start blocks
    at 1.75, 4.8125, 8.859375 here and at 1.75, 4.0625, 6.796875 in the paper's form.

    Args:
        params: the model's tensors (the start point of the next block).
        lr: CNTK's ``blockLearningRate`` > 0.
        momentum: the block momentum in [0, 1).
        nesterov: CNTK's ``useNesterovMomentum``.
        workers: ``N``, the number of workers whose block gradients CNTK sums (>= 1).
    """

    def __init__(
        self, params: Any, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = True, workers: int = 1
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"block_momentum must be in [0, 1), got {momentum}")
        if not lr > 0:
            raise ValueError(f"block_learning_rate must be > 0, got {lr}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "workers": workers})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("CNTKBlockMomentum.step takes no closure")
        for group in self.param_groups:
            bm, gain = group["momentum"], (1.0 - group["momentum"]) * group["lr"] * group["workers"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                sg = self.state[p].get("smoothed_gradient")
                if sg is None:
                    sg = self.state[p]["smoothed_gradient"] = torch.zeros_like(p)
                sg.mul_(bm).add_(p.grad, alpha=gain)
                p.sub_(sg)
                if group["nesterov"]:
                    p.sub_(sg, alpha=bm)

    def start_point(self, p: Tensor) -> Tensor:
        """Where the next block of ``p`` starts: ``p`` itself (CNTK keeps no other model)."""
        return p


def resolve_outer_optimizer(
    outer_optimizer: str | type[Optimizer] | OuterFactory | None,
    lr: float,
    momentum: float,
    kwargs: dict[str, Any] | None = None,
) -> OuterFactory:
    """A factory ``params -> Optimizer`` from what a user gives, checked now (at construction).

    Args:
        outer_optimizer: ``None`` (Nesterov SGD), a class path (``"torch.optim.Adam"``), an
            ``Optimizer`` subclass (built with ``lr``, and ``momentum`` / ``nesterov`` where its
            constructor takes them, plus ``kwargs``), or a callable ``params -> Optimizer``.
        lr: the outer learning rate.
        momentum: the outer momentum, for optimizers that take one (Nesterov when > 0 for SGD).
        kwargs: further constructor arguments.

    Raises:
        ValueError: naming ``outer_optimizer`` when it does not resolve to a ``torch.optim.Optimizer``.
    """
    extra = dict(kwargs or {})
    spec: Any = torch.optim.SGD if outer_optimizer is None else outer_optimizer
    if isinstance(spec, str):
        module, _, name = spec.rpartition(".")
        try:
            spec = getattr(importlib.import_module(module or "torch.optim"), name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"outer_optimizer={outer_optimizer!r} cannot be imported: {err}") from err
    if inspect.isclass(spec):
        if not issubclass(spec, Optimizer):
            raise ValueError(f"outer_optimizer={outer_optimizer!r} is not a torch.optim.Optimizer subclass")
        accepted = inspect.signature(spec).parameters
        built = {"lr": lr, **extra}
        if "momentum" in accepted:
            built.setdefault("momentum", momentum)
        if "nesterov" in accepted and built.get("momentum", 0):
            built.setdefault("nesterov", True)
        cls = spec

        def factory(params: list[Parameter]) -> Optimizer:
            return cls(params, **built)

    elif callable(spec):
        if extra:
            raise ValueError("outer_optimizer_kwargs are only used when outer_optimizer is a class or class path")
        factory = spec
    else:
        raise ValueError(f"outer_optimizer={outer_optimizer!r} must be a class path, an Optimizer class or a callable")
    try:
        probe = factory([Parameter(torch.zeros(2))])
    except Exception as err:  # the user's arguments: report them with the argument's name
        raise ValueError(f"outer_optimizer={outer_optimizer!r} could not be built: {err}") from err
    if not isinstance(probe, Optimizer):
        raise ValueError(
            f"outer_optimizer={outer_optimizer!r} returned {type(probe).__name__}, not a torch.optim.Optimizer"
        )
    return factory


OUTER_STATES = ("host", "device")


def check_outer_state(outer_state: Any) -> None:
    """``outer_state`` must be one of :data:`OUTER_STATES`."""
    if outer_state not in OUTER_STATES:
        raise ValueError(f"outer_state={outer_state!r} is not supported; choose one of {OUTER_STATES}")


class OuterOptimizer:
    """The global copy of the weights (flat float32, one tensor per fragment) and its outer optimizer.

    Args:
        factory: builds the optimizer over the global tensors (see :func:`resolve_outer_optimizer`).
        device: the training device, where :meth:`start_point` and :meth:`global_weights` hand out
            a fragment (default: where the weights are).
        placement: ``"device"`` (the global copy and the optimizer's state on ``device``) or
            ``"host"``: on a CUDA ``device`` they live in pinned host memory, the outer step runs
            on the CPU there (the state it reads and writes is there: stepping on the GPU would
            move the weights and every state buffer of the fragment to the device and back at each
            sync, and the step is a few elementwise passes once per period), and a fragment visits
            the device only as the averaged pseudo-gradient coming to the host and the start point
            going back. On a CPU ``device`` both placements are the same memory.

    Attributes:
        syncs: outer steps taken, per fragment.
    """

    def __init__(self, factory: OuterFactory, device: torch.device | None = None, placement: str = "device") -> None:
        check_outer_state(placement)
        self.factory = factory
        self.device = device
        self.home = torch.device("cpu") if placement == "host" and device is not None else device
        self.pinned = placement == "host" and device is not None and device.type == "cuda"
        self.weights: list[Parameter] = []
        self.optimizer: Optimizer | None = None
        self.syncs: list[int] = []

    @property
    def started(self) -> bool:
        return self.optimizer is not None

    def start(self, fragments: Sequence[Tensor]) -> None:
        """Begin from these weights (identical on every rank), one flat tensor per fragment."""
        self.weights = [Parameter(self._home(f.detach())) for f in fragments]
        self.optimizer = self.factory(self.weights)
        self.syncs = [0] * len(self.weights)

    def _home(self, t: Tensor) -> Tensor:
        """A float32 copy of ``t`` where the state lives (pinned host memory for ``"host"`` on CUDA)."""
        out = torch.empty(t.shape, dtype=torch.float32, device=self.home or t.device, pin_memory=self.pinned)
        return out.copy_(t)

    def _visit(self, t: Tensor) -> Tensor:
        """``t`` on the training device (a copy of one fragment when the state is on the host)."""
        return t if self.device is None else visit(t, self.device)

    def global_weights(self, fragment: int) -> Tensor:
        """The global model of ``fragment`` (what validation and checkpoints see), on the training device."""
        return self._visit(self.weights[fragment].detach())

    def start_point(self, fragment: int) -> Tensor:
        """Where workers start the next block of ``fragment`` (the look-ahead point for Nesterov BMUF),
        on the training device."""
        p = self.weights[fragment]
        start = getattr(self.optimizer, "start_point", None)
        return self._visit((start(p) if start is not None else p).detach())

    def step(self, fragment: int, pseudo_grad: Tensor) -> None:
        """One outer step of ``fragment`` with the averaged pseudo-gradient (identical on every rank),
        where the state lives."""
        assert self.optimizer is not None, "call start() first"
        p = self.weights[fragment]
        p.grad = pseudo_grad.to(p.device, torch.float32)
        self.optimizer.step()
        p.grad = None
        self.syncs[fragment] += 1

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"weights": None}
        return {
            "weights": [w.detach() for w in self.weights],
            "optimizer": self.optimizer.state_dict(),
            "syncs": list(self.syncs),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        if state["weights"] is None:
            self.weights, self.optimizer, self.syncs = [], None, []
            return
        self.start([w.to(self.home or device) for w in state["weights"]])
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state["optimizer"])
        self.syncs = list(state["syncs"])

    def check_state(self, state: dict[str, Any], sizes: Sequence[int]) -> None:
        """Raise ``ValueError`` when a saved state does not fit fragments of these sizes."""
        if state["weights"] is None:
            return
        saved = [int(w.numel()) for w in state["weights"]]
        if saved != list(sizes):
            raise ValueError(f"its global model has fragments of {saved} weights, this run needs {list(sizes)}")
