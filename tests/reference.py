"""Reference trainers of the package's schemes, in plain torch, every rank simulated in one process.

The second witness of correctness (``DESIGN.md``, "Shape of the code"): written from the papers' (and
CNTK's) equations, sharing no code with ``lightning_commstrats`` (not imported here, nor anything of
it). A test records what real ranks did (the weights training started from, the batches every rank
trained on) and replays it here; the real run's weights must come out the same.

Each simulated *worker* is a model replica with its own copy of the weights and its own inner
optimizer (``torch.optim``: the user's optimizer, not a scheme's). ``batches[r][t]`` is the batch
rank ``r`` trained on at optimizer step ``t``. With ``group_size = g`` (``shard="fsdp"``: FSDP2 shards
one replica over ``g`` consecutive ranks, which train it synchronously) worker ``m`` is ranks
``m g .. m g + g - 1`` and its gradient at a step is the mean of their ranks' gradients; with
``g = 1`` every rank is a worker. ``N`` below is the number of workers. A rank's gradient is that of
its own batch's mean loss (``loss_fn``).

Schemes (one function each), with ``mean`` the average over the ``N`` workers:

- :func:`allreduce` (synchronous data parallelism): ``g = mean_m g_m``, then every worker's
  optimizer steps with ``g``.
- :func:`model_averaging` (CNTK's ``ModelAveragingSGD``): every ``sync_period`` the workers' weights
  are replaced by ``w = mean_m w_m``.
- :func:`bmuf` (Chen & Huo, ICASSP 2016, the paper's form): at a block's end ``w_avg = mean_m w_m``,
  ``G = w_avg - w_start``, ``delta = bm delta + blr G``, ``w_global += delta``; the next block starts
  from ``w_global + bm delta`` (Nesterov) or ``w_global``.
- :func:`diloco` at 32 bits (Douillard et al. 2023): ``G = w_global - mean_m w_m``; outer Nesterov
  SGD with momentum ``mu``, ``buf = mu buf + G``, ``update = G + mu buf`` (``buf`` without Nesterov),
  ``w_global -= lr update``; every worker restarts from ``w_global``.

Where the package's documented behaviour goes beyond (or departs from) the papers, the reference
follows the package's documentation, and says so here:

- Schedule: a block ends after the optimizer step at which the progress since the block began
  reaches ``sync_period``: optimizer steps (``sync_period_unit="steps"``) or samples per worker
  (``"samples"``, CNTK's unit: the ranks agree on the mean of their batch sizes, rounded down, as
  ``total over ranks // ranks``); the next block begins at that progress (no carry-over of a block
  that overshot). The first block begins at step 0 (no warm start: ``parallelization_start=0``).
- End of fit: when the last step is not a block's end, the workers' progress since their block
  began is merged into the global model *without an outer step*: ``w_global += mean_m w_m -
  w_start`` (for BMUF with Nesterov, ``w_start`` is the look-ahead point, so this is not the
  paper's final average), and every rank ends with ``w_global`` (never the look-ahead point).
- ``reset_sgd_momentum``: after every sync, the inner optimizers' first moments (SGD's
  ``momentum_buffer``, Adam's ``exp_avg``) are zeroed; Adam's ``exp_avg_sq`` and step counts stay.
  BMUF's default is on (CNTK's), DiLoCo's and model averaging's off (DiLoCo keeps its inner AdamW
  state across syncs).
- BMUF's default block momentum is ``1 - 1/N`` with ``N`` the number of *workers* (model replicas:
  groups of ranks when sharded), block learning rate 1, Nesterov on. CNTK's own form (summed block
  gradients, ``sg``, no separate global model) is not this function.
- DiLoCo's defaults: outer lr 0.7, momentum 0.9, Nesterov (on whenever the momentum is > 0), the
  period in steps; BMUF's and model averaging's period defaults to samples per worker (CNTK's unit).

Not modelled (the tests do not use them): a warm start (``parallelization_start``), module buffers
(the package averages floating-point buffers at each sync; the tests' model has none), model
averaging's ``average_optimizer_state`` and ``weighting="samples"``, compressed pseudo-gradients,
fragments (Streaming DiLoCo), gradient accumulation and clipping, learning-rate schedules.

``reduce="sum"`` is a negative control for the tests, not a scheme: what an exchange that sums
over workers instead of averaging would compute (gradients summed; the workers' pseudo-gradients
``w_start - w_m`` summed, so the "average" model is ``w_start - sum_m (w_start - w_m)``). A test
shows the real run is far from it, i.e. that its tolerance can tell a wrong average.

Arithmetic: float32 throughout, as the models are. Sums over workers run in worker order
``((x_0 + x_1) + x_2) + ...``, then divide by ``N`` (exact for ``N`` a power of two: ``sum / N`` is
``(1/N) sum``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

State = dict[str, Tensor]
LossFn = Callable[[nn.Module, Any], Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

REDUCES = ("mean", "sum")
FIRST_MOMENTS = ("momentum_buffer", "exp_avg")


def mse_loss(model: nn.Module, batch: Any) -> Tensor:
    """The mean squared error of ``model`` on a batch ``(x, y)``: the batch's mean loss."""
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@dataclass
class Run:
    """What a reference run produced.

    Attributes:
        final: the parameters every rank holds when fit ends (after the end-of-fit merge).
        steps: ``steps[t][m]``: worker ``m``'s parameters after optimizer step ``t`` (after that
            step's sync, if it ended a block); rank ``r`` holds worker ``r // group_size``'s.
        syncs: the optimizer steps (1-based counts) after which a block ended.
        merged: whether fit ended inside a block (its progress merged without an outer step).
    """

    final: State
    steps: list[list[State]] = field(default_factory=list)
    syncs: list[int] = field(default_factory=list)
    merged: bool = False


# ---------------------------------------------------------------------- the workers


class Workers:
    """``N`` model replicas, each with its inner optimizer, trained on their ranks' batches."""

    def __init__(
        self,
        initial: State,
        make_model: Callable[[], nn.Module],
        batches: Sequence[Sequence[Any]],
        make_optimizer: OptimizerFactory,
        loss_fn: LossFn,
        group_size: int,
    ) -> None:
        ranks = len(batches)
        if ranks % group_size:
            raise ValueError(f"{ranks} ranks do not split into groups of {group_size}")
        self.steps = len(batches[0])
        if any(len(b) != self.steps for b in batches):
            raise ValueError("every rank must have trained on as many batches")
        self.batches, self.loss_fn, self.group_size = batches, loss_fn, group_size
        self.models: list[nn.Module] = []
        for _ in range(ranks // group_size):
            model = make_model()
            model.load_state_dict(initial)
            self.models.append(model)
        self.optimizers = [make_optimizer(list(m.parameters())) for m in self.models]
        self.names = [n for n, _ in self.models[0].named_parameters()]

    @property
    def n(self) -> int:
        return len(self.models)

    def ranks(self, m: int) -> range:
        return range(m * self.group_size, (m + 1) * self.group_size)

    def gradient(self, m: int, t: int) -> list[Tensor]:
        """Worker ``m``'s gradient at step ``t``: the mean over its ranks of each rank's gradient of
        its own batch's mean loss (one rank: that rank's gradient)."""
        model = self.models[m]
        per_rank = []
        for r in self.ranks(m):
            model.zero_grad(set_to_none=True)
            self.loss_fn(model, self.batches[r][t]).backward()
            per_rank.append([p.grad.detach().clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        if len(per_rank) == 1:
            return per_rank[0]
        return [mean(list(gs)) for gs in zip(*per_rank, strict=True)]

    def step(self, m: int, grads: Sequence[Tensor]) -> None:
        """Worker ``m``'s inner optimizer steps with ``grads``."""
        for p, g in zip(self.models[m].parameters(), grads, strict=True):
            p.grad = g.clone()
        self.optimizers[m].step()
        self.models[m].zero_grad(set_to_none=True)

    def local_step(self, t: int) -> None:
        """Every worker trains alone for one step (the periodic schemes' inner step)."""
        for m in range(self.n):
            self.step(m, self.gradient(m, t))

    def weights(self, m: int) -> Tensor:
        """Worker ``m``'s parameters as one float32 vector (parameter order)."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.models[m].parameters()])

    def load(self, m: int, flat: Tensor) -> None:
        """Worker ``m``'s parameters become ``flat`` (its optimizer state is kept)."""
        offset = 0
        with torch.no_grad():
            for p in self.models[m].parameters():
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def load_all(self, flat: Tensor) -> None:
        for m in range(self.n):
            self.load(m, flat)

    def zero_first_moments(self) -> None:
        """``reset_sgd_momentum``: zero SGD's momentum buffers and Adam's first moments."""
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for key in FIRST_MOMENTS:
                    if isinstance(state.get(key), Tensor):
                        state[key].zero_()

    def state(self, m: int) -> State:
        return {n: p.detach().clone() for n, p in self.models[m].named_parameters()}

    def as_state(self, flat: Tensor) -> State:
        out, offset = {}, 0
        for n, p in self.models[0].named_parameters():
            out[n] = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return out

    def snapshot(self) -> list[State]:
        return [self.state(m) for m in range(self.n)]


def total(xs: Sequence[Tensor]) -> Tensor:
    """``((x_0 + x_1) + x_2) + ...``."""
    out = xs[0].clone()
    for x in xs[1:]:
        out = out + x
    return out


def mean(xs: Sequence[Tensor]) -> Tensor:
    """``(1/N) sum_i x_i``, computed as ``sum / N``."""
    return total(xs) / len(xs)


def _check(reduce: str) -> None:
    if reduce not in REDUCES:
        raise ValueError(f"reduce={reduce!r} is not one of {REDUCES}")


def workers_average(locals_: Sequence[Tensor], start: Tensor, reduce: str) -> Tensor:
    """``mean_m w_m``, the average of the workers' models; for ``reduce="sum"`` (a negative control)
    the model an exchange that sums the pseudo-gradients gives, ``w_start - sum_m (w_start - w_m)``."""
    if reduce == "mean":
        return mean(locals_)
    return start - total([start - w for w in locals_])


class Schedule:
    """When blocks end: after the step at which the progress since the block began reaches
    ``sync_period`` (optimizer steps, or samples per worker agreed as the ranks' mean)."""

    def __init__(self, sync_period: int, unit: str, batches: Sequence[Sequence[Any]]) -> None:
        if unit not in ("steps", "samples"):
            raise ValueError(f"sync_period_unit={unit!r} is not 'steps' or 'samples'")
        self.sync_period, self.unit, self.batches = sync_period, unit, batches
        self.all_ranks = 0  # samples over all ranks so far
        self.progress = 0
        self.block_start = 0

    def after_step(self, t: int) -> bool:
        """Count step ``t`` (0-based); whether a block ends after it (the next one begins there)."""
        if self.unit == "steps":
            self.progress = t + 1
        else:
            self.all_ranks += sum(len(b[t][0]) for b in self.batches)
            self.progress = self.all_ranks // len(self.batches)
        if self.progress - self.block_start >= self.sync_period:
            self.block_start = self.progress
            return True
        return False

    @property
    def inside_a_block(self) -> bool:
        """Whether workers trained since the last block began (the end of fit then merges)."""
        return self.progress > self.block_start


# ---------------------------------------------------------------------- allreduce


def allreduce(
    initial: State,
    make_model: Callable[[], nn.Module],
    batches: Sequence[Sequence[Any]],
    make_optimizer: OptimizerFactory,
    *,
    loss_fn: LossFn = mse_loss,
    group_size: int = 1,
    reduce: str = "mean",
) -> Run:
    """Synchronous data parallelism: at every step ``g = (1/N) sum_m g_m`` (``reduce="sum"``: the sum),
    then every worker's optimizer steps with ``g``; the workers stay identical."""
    _check(reduce)
    w = Workers(initial, make_model, batches, make_optimizer, loss_fn, group_size)
    run = Run(final={})
    for t in range(w.steps):
        grads = [w.gradient(m, t) for m in range(w.n)]
        combined = [(mean if reduce == "mean" else total)(list(gs)) for gs in zip(*grads, strict=True)]
        for m in range(w.n):
            w.step(m, combined)
        run.steps.append(w.snapshot())
    run.final = w.state(0)
    return run


# ---------------------------------------------------------------------- the periodic schemes


def model_averaging(
    initial: State,
    make_model: Callable[[], nn.Module],
    batches: Sequence[Sequence[Any]],
    make_optimizer: OptimizerFactory,
    *,
    sync_period: int,
    sync_period_unit: str = "samples",
    reset_sgd_momentum: bool = False,
    loss_fn: LossFn = mse_loss,
    group_size: int = 1,
    reduce: str = "mean",
) -> Run:
    """Model averaging: workers train alone; every ``sync_period`` every worker's weights become
    ``w = mean_m w_m``."""
    _check(reduce)
    w = Workers(initial, make_model, batches, make_optimizer, loss_fn, group_size)
    schedule = Schedule(sync_period, sync_period_unit, batches)
    w_global = w.weights(0)
    run = Run(final={})
    for t in range(w.steps):
        w.local_step(t)
        if schedule.after_step(t):
            w_global = workers_average([w.weights(m) for m in range(w.n)], w_global, reduce)
            w.load_all(w_global)
            if reset_sgd_momentum:
                w.zero_first_moments()
            run.syncs.append(t + 1)
        run.steps.append(w.snapshot())
    if schedule.inside_a_block:  # the end of fit: w_global += mean_m w_m - w_start (w_start = w_global)
        w_global = w_global + (workers_average([w.weights(m) for m in range(w.n)], w_global, reduce) - w_global)
        run.merged = True
    run.final = w.as_state(w_global)
    return run


def bmuf(
    initial: State,
    make_model: Callable[[], nn.Module],
    batches: Sequence[Sequence[Any]],
    make_optimizer: OptimizerFactory,
    *,
    sync_period: int,
    sync_period_unit: str = "samples",
    block_momentum: float | None = None,
    block_learning_rate: float = 1.0,
    use_nesterov_momentum: bool = True,
    reset_sgd_momentum: bool = True,
    loss_fn: LossFn = mse_loss,
    group_size: int = 1,
    reduce: str = "mean",
) -> Run:
    """BMUF, Chen & Huo (ICASSP 2016), eqs. of section 2: for block ``t``

        W_avg(t)   = mean over workers of their models at the block's end
        G(t)       = W_avg(t) - W_start(t)                     (the block's aggregated update)
        Delta(t)   = eta Delta(t-1) + zeta G(t)                (block momentum eta, block lr zeta)
        W(t)       = W(t-1) + Delta(t)                         (the global model)
        W_start(t+1) = W(t) + eta Delta(t)   (Nesterov)   or   W(t)

    with ``W(0) = W_start(1) =`` the initial model and ``Delta(0) = 0``; ``eta`` defaults to
    ``1 - 1/N``."""
    _check(reduce)
    w = Workers(initial, make_model, batches, make_optimizer, loss_fn, group_size)
    eta = 1.0 - 1.0 / w.n if block_momentum is None else block_momentum
    zeta = block_learning_rate
    schedule = Schedule(sync_period, sync_period_unit, batches)
    w_global = w.weights(0)
    w_start = w_global.clone()
    delta = torch.zeros_like(w_global)
    run = Run(final={})
    for t in range(w.steps):
        w.local_step(t)
        if schedule.after_step(t):
            w_avg = workers_average([w.weights(m) for m in range(w.n)], w_start, reduce)
            g = w_avg - w_start
            delta = eta * delta + zeta * g
            w_global = w_global + delta
            w_start = w_global + eta * delta if use_nesterov_momentum else w_global.clone()
            w.load_all(w_start)
            if reset_sgd_momentum:
                w.zero_first_moments()
            run.syncs.append(t + 1)
        run.steps.append(w.snapshot())
    if schedule.inside_a_block:  # the end of fit: the workers' progress since w_start, no filter
        w_global = w_global + (workers_average([w.weights(m) for m in range(w.n)], w_start, reduce) - w_start)
        run.merged = True
    run.final = w.as_state(w_global)
    return run


def diloco(
    initial: State,
    make_model: Callable[[], nn.Module],
    batches: Sequence[Sequence[Any]],
    make_optimizer: OptimizerFactory,
    *,
    sync_period: int,
    sync_period_unit: str = "steps",
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    reset_sgd_momentum: bool = False,
    loss_fn: LossFn = mse_loss,
    group_size: int = 1,
    reduce: str = "mean",
) -> Run:
    """DiLoCo (Douillard et al. 2023, Algorithm 1) with fp32 pseudo-gradients: every ``H`` inner steps

        G      = w_global - mean over workers of w_m               (outer gradient)
        buf    = mu buf + G                                         (buf = 0 before the first sync)
        update = G + mu buf   (Nesterov)   or   buf
        w_global = w_global - lr update

    and every worker restarts from ``w_global``, its inner optimizer's state kept (unless
    ``reset_sgd_momentum``)."""
    _check(reduce)
    w = Workers(initial, make_model, batches, make_optimizer, loss_fn, group_size)
    schedule = Schedule(sync_period, sync_period_unit, batches)
    w_global = w.weights(0)
    buf = torch.zeros_like(w_global)
    run = Run(final={})
    for t in range(w.steps):
        w.local_step(t)
        if schedule.after_step(t):
            g = w_global - workers_average([w.weights(m) for m in range(w.n)], w_global, reduce)
            buf = outer_momentum * buf + g
            update = g + outer_momentum * buf if nesterov else buf
            w_global = w_global - outer_lr * update
            w.load_all(w_global)
            if reset_sgd_momentum:
                w.zero_first_moments()
            run.syncs.append(t + 1)
        run.steps.append(w.snapshot())
    if schedule.inside_a_block:  # the end of fit: w_global -= G, no outer step (its momentum untouched)
        w_global = w_global - (w_global - workers_average([w.weights(m) for m in range(w.n)], w_global, reduce))
        run.merged = True
    run.final = w.as_state(w_global)
    return run
