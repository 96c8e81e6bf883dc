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
- :func:`diloco` (Douillard et al. 2023): ``G = w_global - mean_m w_m``; outer Nesterov
  SGD with momentum ``mu``, ``buf = mu buf + G``, ``update = G + mu buf`` (``buf`` without Nesterov),
  ``w_global -= lr update``; every worker restarts from ``w_global``. Below 32 bits (INTELLECT-1's 8)
  ``G`` is the compressed average of the workers' ``w_global - w_m`` (:class:`Exchange`).
- :func:`streaming_diloco` (Douillard et al. 2025): DiLoCo on ``F`` fragments of the model taking turns,
  each fragment's outer step landing ``tau`` steps after its turn and mixed into the workers' weights
  by ``alpha`` (see the function).
- :func:`onebit_sgd` (Seide et al. 2014): :func:`allreduce` whose gradients are averaged by
  :class:`Exchange` at 1 bit per value (or ``num_quantization_bits``) with error feedback.
- :class:`Exchange`: the compressed average of ``DESIGN.md``'s 1-bit SGD (two stages, each with its
  error-feedback residual), with 1-bit SGD's codec (``onebit_reference.compress``, from the paper) or
  the uniform n-bit grid written from the docstring of ``compression/quantizers.py`` (a description,
  not its code: its float32 operations in the order it states them).

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
- DiLoCo's (and Streaming DiLoCo's) defaults: outer lr 0.7, momentum 0.5 (the package's default; the
  paper's is 0.9), Nesterov (on whenever the momentum is > 0), the period in steps; BMUF's and model
  averaging's period defaults to samples per worker (CNTK's unit).
- ``nonfinite="skip"`` (``inject`` puts an inf in a rank's gradient): a gradient scheme skips the step
  on every worker (no update, no optimizer state, no residual moves); a periodic scheme whose averaged
  pseudo-gradient is not finite discards the block (no outer step, no residual moves, every worker
  restarts from ``w_global``). A worker that trained on an inf inside a block carries it in its local
  weights (and its inner optimizer's state) until the block ends.
- Compressed exchanges: matrices of more than ``small_tensor_numel`` values travel quantized, one scale
  pair per row (periodic schemes, ``pseudo_grad_scales="rows"``) or column (1-bit SGD); 1-D and
  smaller tensors in float32. An input holding an inf or a NaN is sent as NaN.

Not modelled (the tests do not use them): a warm start (``parallelization_start``, 1-bit SGD's
``distributed_after``), module buffers (the package averages floating-point buffers at each sync; the
tests' model has none), model averaging's ``average_optimizer_state`` and ``weighting="samples"``, the
E3M0, top-k and statistical codecs, 16 bits, compressed exchanges of sharded workers, Streaming
DiLoCo's ``keep_local_progress`` (and an ``H`` that ``F`` does not divide), gradient accumulation and
clipping, learning-rate schedules.

``reduce="sum"`` is a negative control for the tests, not a scheme: what an exchange that sums
over workers instead of averaging would compute (gradients summed; the workers' pseudo-gradients
``w_start - w_m`` summed, so the "average" model is ``w_start - sum_m (w_start - w_m)``). A test
shows the real run is far from it, i.e. that its tolerance can tell a wrong average. Likewise
``error_feedback=False`` (residuals dropped) for the compressed exchanges.

Arithmetic: float32 throughout, as the models are. Sums over workers run in worker order
``((x_0 + x_1) + x_2) + ...``, then divide by ``N`` (exact for ``N`` a power of two: ``sum / N`` is
``(1/N) sum``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from onebit_reference import compress as onebit_compress
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
        history: (periodic schemes) ``(fragment, step its exchange started after, step it was applied
            after)`` of every sync applied, the end-of-fit merges included, in order.
        discarded: the steps after which a block's average was not finite and was discarded
            (``nonfinite="skip"``); for the gradient schemes, the steps skipped (0-based).
        exchange: the compressed exchange, when there is one (its residuals, the codec's half steps).
        dropped: (Streaming DiLoCo) per fragment landing after the last step, the largest magnitude of the
            workers' mean progress since its turn that its mixing discarded (none left to merge).
        global_steps: (DiLoCo, Streaming DiLoCo) the global model after every optimizer step (what a
            checkpoint saved then holds as the model).
    """

    final: State
    steps: list[list[State]] = field(default_factory=list)
    syncs: list[int] = field(default_factory=list)
    merged: bool = False
    history: list[tuple[int, int, int]] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)
    exchange: Exchange | None = None
    dropped: dict[int, float] = field(default_factory=dict)
    global_steps: list[State] = field(default_factory=list)


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
        inject: Mapping[tuple[int, int], str] | None = None,
    ) -> None:
        ranks = len(batches)
        if ranks % group_size:
            raise ValueError(f"{ranks} ranks do not split into groups of {group_size}")
        self.steps = len(batches[0])
        if any(len(b) != self.steps for b in batches):
            raise ValueError("every rank must have trained on as many batches")
        self.batches, self.loss_fn, self.group_size = batches, loss_fn, group_size
        self.inject = dict(inject or {})
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
        its own batch's mean loss (one rank: that rank's gradient). ``inject[(r, t)] = name``: rank
        ``r``'s gradient of parameter ``name`` at step ``t`` has its first value replaced by inf."""
        model = self.models[m]
        per_rank = []
        for r in self.ranks(m):
            model.zero_grad(set_to_none=True)
            self.loss_fn(model, self.batches[r][t]).backward()
            per_rank.append([p.grad.detach().clone() for p in model.parameters()])
            if (r, t) in self.inject:
                per_rank[-1][self.names.index(self.inject[r, t])].view(-1)[0] = math.inf
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

    def zero_first_moments(self, params: range | None = None) -> None:
        """``reset_sgd_momentum``: zero SGD's momentum buffers and Adam's first moments (of the
        parameters ``params``, indices in parameter order; all of them for ``None``)."""
        for model, optimizer in zip(self.models, self.optimizers, strict=True):
            chosen = list(model.parameters()) if params is None else [list(model.parameters())[i] for i in params]
            for p in chosen:
                state = optimizer.state.get(p, {})
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


# ---------------------------------------------------------------------- the compressed exchange

CLIP_STDDEVS = {2: 2.0, 4: 2.7, 8: 4.0}  # the uniform grid's half width, in standard deviations


def to_lines(t: Tensor, by_rows: bool) -> Tensor:
    """A matrix of shape ``(d0, d1, ...)`` seen as ``[d0, rest]``, as its lines ``[lines, values]``: its
    rows (``by_rows``, the periodic schemes' default ``pseudo_grad_scales="rows"``) or its columns
    (1-bit SGD's layout)."""
    m = t.reshape(t.shape[0], -1)
    return (m if by_rows else m.t()).contiguous().float()


def from_lines(lines: Tensor, shape: torch.Size, by_rows: bool) -> Tensor:
    return (lines if by_rows else lines.t()).reshape(shape).clone()


def uniform_lines(lines: Tensor, bits: int) -> Tensor:
    """The uniform ``bits``-bit codec, per line (``quantizers.py``'s docstring): ``[lo, hi]`` is the
    line's ``mean +- k std`` (population std; ``k`` 2, 2.7, 4 at 2, 4, 8 bits) intersected with its
    ``[min, max]``; in float32, each operation rounded, ``step = (hi - lo) / 2^bits``, ``inv = 1 / step``
    (0 for a zero step), a value's bin is ``(x - lo) * inv`` truncated and clamped to ``[0, 2^bits - 1]``
    and it is rebuilt as ``lo + (bin + 0.5) * step``: within half a step of ``x`` inside ``[lo, hi]``."""
    levels = 2**bits
    k = CLIP_STDDEVS[bits]
    var, mean = torch.var_mean(lines, dim=1, correction=0)
    std = var.sqrt()
    lo = torch.maximum(mean - k * std, lines.amin(1))[:, None]
    hi = torch.minimum(mean + k * std, lines.amax(1))[:, None]
    step = (hi - lo) / levels
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    code = ((lines - lo) * inv).clamp(0, levels - 1).trunc()
    return lo + (code + 0.5) * step


def uniform_half_step(lines: Tensor, bits: int) -> Tensor:
    """Half the uniform codec's step of each line: the most it moves a value inside ``[lo, hi]``."""
    k = CLIP_STDDEVS[bits]
    var, mean = torch.var_mean(lines, dim=1, correction=0)
    lo = torch.maximum(mean - k * var.sqrt(), lines.amin(1))
    hi = torch.minimum(mean + k * var.sqrt(), lines.amax(1))
    return (hi - lo) / 2 ** (bits + 1)


def onebit_lines(lines: Tensor) -> Tensor:
    """1-bit SGD's codec per line (``onebit_reference.compress``, from the paper: each value becomes
    the mean of the line's values of its sign, non-negative or negative), rounded to float32."""
    return onebit_compress(lines.t()).t().float()


def quantize_lines(lines: Tensor, bits: int) -> Tensor:
    """The dequantized lines; a line block holding an inf or a NaN is sent as NaN (the package's
    documented rule: a non-finite input never looks finite, nor reaches a residual)."""
    if not bool(torch.isfinite(lines).all()):
        return torch.full_like(lines, math.nan)
    return onebit_lines(lines) if bits == 1 else uniform_lines(lines, bits)


class Exchange:
    """The average over the ``N`` workers of their named tensors, as the package documents it
    (``DESIGN.md``, 1-bit SGD; ``compression/aggregation.py``):

    - ``bits=32``, and every tensor of at most ``small_tensor_numel`` values or of one dimension:
      ``(1/N) sum_m x_m`` in float32, summed in worker order;
    - otherwise (a matrix, ``bits`` 1 or 8 here): two stages with error feedback. Stage 1, on every
      worker: ``v_m = lines(x_m) + e1_m``, ``q_m = Q(v_m)``, ``e1_m = v_m - q_m``. Stage 2: the owner of a
      line sums the workers' ``q_m`` of it in worker order, adds its own residual ``e2``,
      ``s = sum_m q_m + e2``, ``e2 = s - Q(s)``, and every worker receives ``Q(s) / N``. ``Q`` quantizes each
      line alone (1 bit, or the uniform grid), so who owns which line (the package's stripes) changes
      nothing but which rank holds that line's ``e2``: the reference keeps one ``e2`` per line.

    When an average is not finite, no residual changes (the caller skips the step, or discards the
    block). ``error_feedback=False`` is a negative control (residuals dropped, never carried);
    ``reduce="sum"`` another (the sum over workers, not the mean).
    """

    def __init__(
        self,
        n: int,
        bits: int = 32,
        *,
        by_rows: bool = True,
        small_tensor_numel: int = 1024,
        error_feedback: bool = True,
        reduce: str = "mean",
    ) -> None:
        if bits not in (1, 2, 4, 8, 32):
            raise ValueError(f"the reference models 1, 2, 4, 8 and 32 bits, not {bits}")
        self.n, self.bits, self.by_rows = n, bits, by_rows
        self.small_tensor_numel, self.error_feedback, self.reduce = small_tensor_numel, error_feedback, reduce
        self.e1: list[dict[str, Tensor]] = [{} for _ in range(n)]
        self.e2: dict[str, Tensor] = {}
        self.half_steps: list[float] = []  # the largest half step of every quantization (uniform codec)

    def quantizes(self, t: Tensor) -> bool:
        return self.bits < 32 and t.dim() >= 2 and t.numel() > self.small_tensor_numel

    def _divide(self, total_: Tensor) -> Tensor:
        return total_ / self.n if self.reduce == "mean" else total_

    def __call__(self, names: Sequence[str], per_worker: Sequence[Sequence[Tensor]]) -> list[Tensor] | None:
        """``per_worker[m][i]``: worker ``m``'s tensor ``names[i]``. The averages in the same order, or
        ``None`` when one is not finite (then no residual moves)."""
        out: list[Tensor] = []
        e1 = [dict(mine) for mine in self.e1]
        e2 = dict(self.e2)
        for i, name in enumerate(names):
            xs = [per_worker[m][i] for m in range(self.n)]
            if not self.quantizes(xs[0]):
                out.append(self._divide(total([x.float() for x in xs])))
                continue
            qs = []
            for m, x in enumerate(xs):
                v = to_lines(x, self.by_rows)
                if name in e1[m]:
                    v = v + e1[m][name]
                q = quantize_lines(v, self.bits)
                self._note(v)
                e1[m][name] = v - q
                qs.append(q)
            s = total(qs)
            if name in e2:
                s = s + e2[name]
            q2 = quantize_lines(s, self.bits)
            self._note(s)
            e2[name] = s - q2
            out.append(from_lines(self._divide(q2), xs[0].shape, self.by_rows))
        if not all(bool(torch.isfinite(t).all()) for t in out):
            return None
        if self.error_feedback:
            self.e1, self.e2 = e1, e2
        return out

    def _note(self, lines: Tensor) -> None:
        if self.bits > 1 and bool(torch.isfinite(lines).all()):
            self.half_steps.append(uniform_half_step(lines, self.bits).max().item())

    def average_flat(self, workers: Workers, per_worker: Sequence[Tensor], params: range) -> Tensor | None:
        """The average of flat per-worker vectors over the parameters ``params`` (indices into the
        model's parameter order, the vectors their concatenation); ``None`` when not finite."""
        shapes = [p.shape for p in workers.models[0].parameters()]
        names = [workers.names[i] for i in params]
        split = [list(v.split([shapes[i].numel() for i in params])) for v in per_worker]
        views = [[t.view(shapes[i]) for t, i in zip(parts, params, strict=True)] for parts in split]
        out = self(names, views)
        return None if out is None else torch.cat([t.reshape(-1) for t in out])


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
    nonfinite: str = "raise",
    inject: Mapping[tuple[int, int], str] | None = None,
) -> Run:
    """Synchronous data parallelism: at every step ``g = (1/N) sum_m g_m`` (``reduce="sum"``: the sum),
    then every worker's optimizer steps with ``g``; the workers stay identical.

    ``nonfinite``: when ``g`` holds an inf or a NaN, ``"raise"`` (``FloatingPointError``) or ``"skip"``:
    no worker steps (its optimizer state unchanged, as if the step's batches had not come)."""
    return _gradient_scheme(
        lambda n: Exchange(n, 32, reduce=reduce),
        initial,
        make_model,
        batches,
        make_optimizer,
        loss_fn=loss_fn,
        group_size=group_size,
        nonfinite=nonfinite,
        inject=inject,
    )


def onebit_sgd(
    initial: State,
    make_model: Callable[[], nn.Module],
    batches: Sequence[Sequence[Any]],
    make_optimizer: OptimizerFactory,
    *,
    num_quantization_bits: int = 1,
    small_tensor_numel: int = 1024,
    error_feedback: bool = True,
    loss_fn: LossFn = mse_loss,
    group_size: int = 1,
    reduce: str = "mean",
    nonfinite: str = "raise",
    inject: Mapping[tuple[int, int], str] | None = None,
) -> Run:
    """1-bit SGD (Seide et al. 2014): :func:`allreduce` whose gradients are averaged by
    :class:`Exchange` at ``num_quantization_bits`` per value of each matrix, one scale pair per
    *column* of its ``[shape[0], rest]`` view (1-bit: the means of the column's non-negative and
    negative values), with both stages' error feedback. 32 bits is :func:`allreduce`. Not modelled:
    the warm start (``distributed_after``; 0 here)."""
    return _gradient_scheme(
        lambda n: Exchange(
            n,
            num_quantization_bits,
            by_rows=False,
            small_tensor_numel=small_tensor_numel,
            error_feedback=error_feedback,
            reduce=reduce,
        ),
        initial,
        make_model,
        batches,
        make_optimizer,
        loss_fn=loss_fn,
        group_size=group_size,
        nonfinite=nonfinite,
        inject=inject,
    )


def _gradient_scheme(
    make_exchange: Callable[[int], Exchange],
    initial: State,
    make_model: Callable[[], nn.Module],
    batches: Sequence[Sequence[Any]],
    make_optimizer: OptimizerFactory,
    *,
    loss_fn: LossFn,
    group_size: int,
    nonfinite: str,
    inject: Mapping[tuple[int, int], str] | None,
) -> Run:
    w = Workers(initial, make_model, batches, make_optimizer, loss_fn, group_size, inject)
    exchange = make_exchange(w.n)
    _check(exchange.reduce)
    run = Run(final={}, exchange=exchange)
    for t in range(w.steps):
        grads = [w.gradient(m, t) for m in range(w.n)]
        combined = exchange(w.names, grads)
        if combined is None:
            _nonfinite(nonfinite, f"the averaged gradients of step {t}")
            run.discarded.append(t)
        else:
            for m in range(w.n):
                w.step(m, combined)
        run.steps.append(w.snapshot())
    run.final = w.state(0)
    return run


def _nonfinite(policy: str, what: str) -> None:
    if policy == "raise":
        raise FloatingPointError(f"{what} hold inf or NaN")
    if policy != "skip":
        raise ValueError(f"nonfinite={policy!r} is not 'raise' or 'skip'")


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
    outer_momentum: float = 0.5,
    nesterov: bool = True,
    reset_sgd_momentum: bool = False,
    pseudo_grad_bits: int = 32,
    pseudo_grad_scales: str = "rows",
    small_tensor_numel: int = 1024,
    error_feedback: bool = True,
    nonfinite: str = "raise",
    inject: Mapping[tuple[int, int], str] | None = None,
    loss_fn: LossFn = mse_loss,
    group_size: int = 1,
    reduce: str = "mean",
) -> Run:
    """DiLoCo (Douillard et al. 2023, Algorithm 1): every ``H`` inner steps

        G      = w_global - mean over workers of w_m               (outer gradient)
        buf    = mu buf + G                                         (buf = 0 before the first sync)
        update = G + mu buf   (Nesterov)   or   buf
        w_global = w_global - lr update

    and every worker restarts from ``w_global``, its inner optimizer's state kept (unless
    ``reset_sgd_momentum``).

    ``pseudo_grad_bits`` below 32: ``G`` is the :class:`Exchange` average of the workers' own
    ``G_m = w_global - w_m``, each matrix of more than ``small_tensor_numel`` values on the uniform grid,
    one scale pair per row (``pseudo_grad_scales="rows"``, the default) or column, with both stages'
    error feedback carried from sync to sync (INTELLECT-1's 8 bits).

    ``nonfinite="skip"``: a block whose averaged ``G`` is not finite is discarded on every worker: no
    outer step (its momentum untouched), no residual moves, every worker restarts from ``w_global``
    (its inner optimizer's state kept: whatever the block put there), and the next block begins."""
    _check(reduce)
    w = Workers(initial, make_model, batches, make_optimizer, loss_fn, group_size, inject)
    if pseudo_grad_bits < 32 and group_size > 1:
        raise ValueError("the reference quantizes whole matrices: not sharded ones (group_size > 1)")
    exchange = Exchange(
        w.n,
        pseudo_grad_bits,
        by_rows=pseudo_grad_scales == "rows",
        small_tensor_numel=small_tensor_numel,
        error_feedback=error_feedback,
        reduce=reduce,
    )
    schedule = Schedule(sync_period, sync_period_unit, batches)
    w_global = w.weights(0)
    buf = torch.zeros_like(w_global)
    run = Run(final={}, exchange=exchange)

    def pseudo_gradient() -> Tensor | None:
        if pseudo_grad_bits == 32:
            g = w_global - workers_average([w.weights(m) for m in range(w.n)], w_global, reduce)
            return g if bool(torch.isfinite(g).all()) else None
        return exchange.average_flat(w, [w_global - w.weights(m) for m in range(w.n)], range(len(w.names)))

    for t in range(w.steps):
        w.local_step(t)
        if schedule.after_step(t):
            g = pseudo_gradient()
            if g is None:  # the block is discarded: every worker restarts from the global model
                _nonfinite(nonfinite, f"the averaged pseudo-gradient of the block ending at step {t + 1}")
                w.load_all(w_global)
                run.discarded.append(t + 1)
            else:
                buf = outer_momentum * buf + g
                update = g + outer_momentum * buf if nesterov else buf
                w_global = w_global - outer_lr * update
                w.load_all(w_global)
                if reset_sgd_momentum:
                    w.zero_first_moments()
                run.syncs.append(t + 1)
                run.history.append((0, t + 1, t + 1))
        run.steps.append(w.snapshot())
        run.global_steps.append(w.as_state(w_global))
    if schedule.inside_a_block:  # the end of fit: w_global -= G, no outer step (its momentum untouched)
        g = pseudo_gradient()
        if g is None:
            _nonfinite(nonfinite, "the averaged pseudo-gradient at the end of fit")
        else:
            w_global = w_global - g
            run.merged = True
            run.history.append((0, w.steps, w.steps))
    run.final = w.as_state(w_global)
    return run


def balanced_fragments(sizes: Sequence[int], num_fragments: int) -> list[range]:
    """The parameters (indices, registration order) of each of ``num_fragments`` fragments: contiguous
    runs of at least one tensor, about equal in size: the ``k``-th cut is the tensor boundary whose
    running total is closest to ``k / F`` of the whole (the later one on a tie)."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    cuts = [0]
    for k in range(1, num_fragments):
        target = prefix[-1] * k / num_fragments
        allowed = range(cuts[-1] + 1, len(sizes) - (num_fragments - k) + 1)
        cuts.append(min(allowed, key=lambda e: (abs(prefix[e] - target), -e)))
    cuts.append(len(sizes))
    return [range(cuts[i], cuts[i + 1]) for i in range(num_fragments)]


def streaming_diloco(
    initial: State,
    make_model: Callable[[], nn.Module],
    batches: Sequence[Sequence[Any]],
    make_optimizer: OptimizerFactory,
    *,
    sync_period: int,
    num_fragments: int = 4,
    fragment_sync_delay: int = 0,
    fragment_update_alpha: float = 0.0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.5,
    nesterov: bool = True,
    reset_sgd_momentum: bool = False,
    pseudo_grad_bits: int = 4,
    pseudo_grad_scales: str = "rows",
    small_tensor_numel: int = 1024,
    error_feedback: bool = True,
    loss_fn: LossFn = mse_loss,
    group_size: int = 1,
    reduce: str = "mean",
) -> Run:
    """Streaming DiLoCo (Douillard et al. 2025), as ``streaming_diloco.py`` documents it. With ``H`` the
    period, ``F`` fragments (:func:`balanced_fragments`), ``tau`` the delay and ``alpha`` the mixing:

    - fragment ``f``'s turns are the steps ``(f + 1) H / F + j H`` (``j >= 0``); after the step of its
      turn ``t``, each worker's ``G_{f,m} = w_{global,f} - w_{m,f}`` is averaged (:class:`Exchange`) and
      its next block begins;
    - ``tau`` steps later (after step ``t + tau``; at once for ``tau = 0``) the outer step lands: the
      fragment's own Nesterov SGD (its momentum buffer only ever sees ``G_f``) steps ``w_{global,f}``
      with the ``G_f`` of step ``t``, and every worker's fragment becomes
      ``alpha w_{m,f} + (1 - alpha) w_{global,f}`` (at ``alpha = 0``: the global fragment, the ``tau``
      steps taken meanwhile on it discarded);
    - the end of fit (after step ``T``): the exchange in flight lands (its outer step and mixing), then
      every fragment whose block began before ``T`` is merged without an outer step,
      ``w_{global,f} -= mean_m (w_{global,f} - w_{m,f})``, and every rank ends with ``w_global``.

    ``reset_sgd_momentum`` zeroes the first moments of the landed fragment's parameters only.

    Its ``history`` is the package's ``sync_history``: ``(f, t, step applied after)`` per landing and
    merge. The package's docstring says the end of fit adds "each fragment's progress since its turn";
    what it does (and this function) is the rule above: a fragment whose exchange landed after its turn
    was mixed at the landing, so the merge sees its progress since the landing only. When that landing
    is after the last step ``T`` itself, the fragment ends without ``(1 - alpha)`` of the workers' mean
    progress of steps ``t + 1 .. T``: ``dropped[f]`` is its largest magnitude (also when the exchange
    in flight lands at the end of fit, ``tau`` >= 2 steps after a turn before ``T``). Not modelled: ``H`` not a
    multiple of ``F``, ``keep_local_progress``, a non-finite average."""
    _check(reduce)
    h, nf, tau, alpha = sync_period, num_fragments, fragment_sync_delay, fragment_update_alpha
    if h % nf or not 0 <= tau < h // nf:
        raise ValueError("the reference models sync_period a multiple of num_fragments and 0 <= delay < H/F")
    w = Workers(initial, make_model, batches, make_optimizer, loss_fn, group_size)
    sizes = [p.numel() for p in w.models[0].parameters()]
    fragments = balanced_fragments(sizes, nf)
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    spans = [slice(offsets[f.start], offsets[f.stop]) for f in fragments]
    exchange = Exchange(
        w.n,
        pseudo_grad_bits,
        by_rows=pseudo_grad_scales == "rows",
        small_tensor_numel=small_tensor_numel,
        error_feedback=error_feedback,
        reduce=reduce,
    )
    w_global = w.weights(0)
    buf = torch.zeros_like(w_global)
    turns: list[int | None] = [None] * nf  # the step of each fragment's last turn (None: none yet)
    at_turn: list[list[Tensor]] = [[] for _ in range(nf)]  # the workers' fragment at its last turn
    inflight: tuple[int, int, int, Tensor] | None = None  # fragment, turn, step it lands after, average
    run = Run(final={}, exchange=exchange)

    def average(f: int) -> Tensor:
        sl = spans[f]
        g = exchange.average_flat(w, [w_global[sl] - w.weights(m)[sl] for m in range(w.n)], fragments[f])
        if g is None:
            raise FloatingPointError(f"the averaged pseudo-gradient of fragment {f} holds inf or NaN")
        return g

    def land(f: int, turn: int, g: Tensor, now: int) -> None:
        sl = spans[f]
        buf[sl] = outer_momentum * buf[sl] + g
        update = g + outer_momentum * buf[sl] if nesterov else buf[sl]
        w_global[sl] = w_global[sl] - outer_lr * update
        for m in range(w.n):
            mine = w.weights(m)
            mine[sl] = alpha * mine[sl] + (1 - alpha) * w_global[sl] if alpha else w_global[sl]
            w.load(m, mine)
        if reset_sgd_momentum:
            w.zero_first_moments(fragments[f])
        run.history.append((f, turn, now))

    def note_dropped(f: int, turn: int) -> None:
        """A landing after the last step: the progress since the turn that its mixing discards for good."""
        if turn < w.steps:
            progress = mean([w.weights(m)[spans[f]] - at_turn[f][m] for m in range(w.n)])
            run.dropped[f] = (1 - alpha) * progress.abs().max().item()

    for t in range(w.steps):
        w.local_step(t)
        now = t + 1
        if inflight is not None and now == inflight[2]:
            f, turn, _, g = inflight
            if now == w.steps:
                note_dropped(f, turn)
            land(f, turn, g, now)
            inflight = None
        for f in range(nf):
            first = (f + 1) * h // nf
            if now >= first and (now - first) % h == 0:
                g = average(f)
                turns[f] = now
                at_turn[f] = [w.weights(m)[spans[f]].clone() for m in range(w.n)]
                if tau == 0:
                    land(f, now, g, now)
                else:
                    inflight = (f, now, now + tau, g)
        run.steps.append(w.snapshot())
        run.global_steps.append(w.as_state(w_global))
    end = w.steps
    if inflight is not None:  # the exchange in flight lands at the end of fit
        f, turn, _, g = inflight
        note_dropped(f, turn)
        land(f, turn, g, end)
    for f in range(nf):
        if turns[f] is None or turns[f] < end:  # it trained since its block began: merged as it is
            w_global[spans[f]] = w_global[spans[f]] - average(f)
            run.history.append((f, end, end))
            run.merged = True
    run.syncs = [applied for _, _, applied in run.history]
    run.final = w.as_state(w_global)
    return run
