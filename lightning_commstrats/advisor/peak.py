"""A rank's peak memory, phase by phase: the tensors it holds between steps, and what each phase of a
step adds on top of them (:func:`peak_phases`, :class:`Peak`, :func:`peak_per_rank`), with a batch's
activations measured on the meta device (:func:`activation_bytes`).

The phases, each read from the code that allocates (bytes on top of the tensors held between steps,
:class:`~lightning_commstrats.advisor.Memory`; ``F`` a fragment's values in float32, the whole local
model for ``diloco``):

- **forward**: the activations autograd saves for the backward (and the logits), plus FSDP2's root
  (kept gathered after forward) and the unit computing. The previous step's gradients are still held:
  Lightning's closure zeroes them after ``training_step``, just before ``backward``
  (``lightning/pytorch/loops/optimization/automatic.py``, ``Closure.closure``).
- **backward**: the gradients were set to ``None``; this step's come back unit by unit while the
  activations are freed (at most the larger of the two at a time), beside FSDP2's root gathered with
  its unsharded gradients (its reduce-scatter is the backward's last), the unit being differentiated
  (gathered, with its unsharded gradients) and the next unit prefetched.
- **optimizer step**: ``torch.optim.Adam(W)``'s temporaries: with ``foreach`` (its default on CUDA) a
  ``sqrt(v)`` the size of every parameter (``_multi_tensor_adam``'s ``exp_avg_sq_sqrt``); single-tensor
  (its default on CPU) ``exp_avg_sq.sqrt() / bias_correction2_sqrt``, two temporaries of the largest
  tensor at a time. SGD with momentum: Nesterov's ``grad.add(buf)`` likewise (counted, since the advisor
  does not know whether Nesterov is on).
- **sync**: the periodic schemes (``strategies/periodic.py``, ``_launch`` and ``_apply``): the fragment's
  flat local copy and its pseudo-gradient (``2 F``), with a copy of the start point on the device for a
  GPU run keeping its outer state on the host (``F``), and, when there are other groups to exchange with,
  the exchange's fused float32 buckets (``F``: made per call, ``keep_buffers=False``) and gloo's ring
  scratch (two segments of the largest bucket, ``bucket / replicas``, CPU only); the outer step after it
  holds the pseudo-gradient and Nesterov's ``grad.add(buf)`` (``2 F``). A compressed exchange (fewer
  than 32 bits, sparse or gathered codecs) is counted conservatively: the decoded average (``F``), the
  new residuals beside the old ones until commit, and a codec's scratch of ``F``. The gradient schemes
  exchange after backward: gloo's ring scratch on their kept buckets, or for a compressed exchange the
  new residuals and ``F`` of scratch.
- **build**: a sharded model not built empty exists whole on every rank before it is sharded.

The peak is ``slack x (held + the largest phase)`` (or ``slack x`` the whole model built, if more),
plus the process's own growth. Where the two factors come from (``docs/advisor.md``, "Peak memory"):

- **On a CPU host**, glibc's mmap threshold fixed (``fix_mmap_threshold``), ``benchmarks/fit_limit.py``'s
  ranks in memory cgroups of 768 MiB (``benchmarks/results/fit_limit/results.json``, the cgroup's peak
  above each rank's start): the five trials that fitted peaked 29.2 (unsharded, 10.4M), 37.1 (2x2,
  23.4M), 18.9, 27.4 and 30.5 MB (1x4, 45.0M, 54.5M, 59.8M) above the largest phase here.
  :data:`HOST_PROCESS_BYTES` is the largest (35.4 MiB) with 1.6 MiB for the run-to-run drift, 37 MiB (fitted
  on the trials the test replays: in sample), with
  no factor (``slack`` 1.0): what no tensor accounts for (gloo's pairs, threads' stacks, modules imported
  during fit, the heap's small blocks), not a share of the model (it does not grow along the 1x4 ladder).
  The predictions are then 1.6 to 18.9 MiB above those peaks, and the killed rungs 20 to 83 MiB over the 498
  MiB left to training (``tests/test_advisor_peak.py``).
- **On a GPU**, ``docs/advisor.md``'s measured ``diloco`` steps on an H200 (``max_memory_allocated``):
  the largest measured peak over the itemized one is 1.099 (32-bit ``diloco``'s second sync, 9.89 M
  against 9.00 M; its plain step 1.04, its 4-bit syncs 1.05 and below): ``slack`` 1.10. CUDA's caching
  allocator can reserve more than it allocates, and the CUDA context, NCCL's buffers and cuBLAS's
  workspace are outside torch's counters: give as ``device_memory`` what is left to tensors.

Where they do not hold: glibc's default settings keep freed blocks (``benchmarks/results/memory/os-small``:
the same runs peaked 1.5x unsharded and 4.7x sharded their peaks with the threshold fixed), and so do
tcmalloc's defaults (1.3x and 2.3x) and jemalloc's (1.1x and 1.5x): pass ``overhead`` for them, or fix
the threshold. The kernel's resident set (``VmHWM``) counts shared libraries' pages that a cgroup charges
to whoever loaded them first (16 MB more than the cgroup above the start in fit_limit's unsharded trial):
os-small's unsharded rank peaked 224.6 MiB of it where this predicts 213.6. Its sharded ranks, and
os-big's, peaked well below these phases (90.7 and 333.5 MiB against 137.6 and 460.2): conservative
there, not understood. Not measured: batches large enough for the activations to dominate, compressed
syncs on CPU.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_commstrats.advisor.fsdp import FsdpUnits, check_units, fsdp_gathers, local_numel
from lightning_commstrats.advisor.inputs import PERIODIC, int_setting
from lightning_commstrats.advisor.memory import Memory
from lightning_commstrats.advisor.names import INNER_OPTIMIZERS
from lightning_commstrats.advisor.schedule import schedule_of
from lightning_commstrats.buckets import DEFAULT_BUCKET_CAP_MB, plan_buckets
from lightning_commstrats.compression.exchange import EXCHANGE_BITS
from lightning_commstrats.strategies.fragments import fragment_bounds
from lightning_commstrats.strategies.periodic_settings import DILOCO_OUTER_MOMENTUM

MIB = 1 << 20
# The process's own growth during fit on a CPU host beyond every tensor the phases count: the largest
# residual of benchmarks/results/fit_limit/results.json's five fitting trials (18.9 to 37.1 MB above the
# largest phase, the cgroup's count above each rank's start), 35.4 MiB, and 1.6 MiB of run-to-run drift.
HOST_PROCESS_BYTES = 37 * MIB
# The allocator's factor on the itemized peak: 1.0 on a CPU host with glibc's mmap threshold fixed (the
# fit_limit residuals are a constant, above); 1.10 on a GPU, docs/advisor.md's H200 diloco table (the
# largest measured peak over the itemized one: 9.89 M / 9.00 M, 32-bit diloco's second sync).
ALLOCATOR_SLACK = {"cpu": 1.0, "gpu": 1.10}


@dataclass(frozen=True)
class Peak:
    """A rank's predicted peak on the device it trains on (the GPU of a GPU run, the host of a CPU run),
    and what makes it (:func:`peak_phases`).

    Attributes:
        held: the tensors it holds between steps there (:class:`~lightning_commstrats.advisor.Memory`).
        phases: ``(phase, bytes)``: what each phase of a step adds on top of ``held`` at its own peak.
        built: the whole model's parameters, when every rank builds it before it is sharded (else 0).
        slack: the allocator's factor on ``held`` plus the largest phase (and on ``built``).
        process: bytes the process adds beyond its tensors (:data:`HOST_PROCESS_BYTES` on a CPU host).
    """

    held: int
    phases: tuple[tuple[str, int], ...] = ()
    built: int = 0
    slack: float = 1.0
    process: int = 0

    @property
    def top(self) -> tuple[str, int]:
        """The phase that peaks and its bytes on top of ``held`` (``("held", 0)`` without phases)."""
        return max(self.phases, key=lambda p: p[1], default=("held", 0))

    @property
    def phase(self) -> str:
        """Where the peak is: a phase's name, or ``"build"`` when the whole model built is more."""
        return "build" if self.built > self.held + self.top[1] else self.top[0]

    @property
    def total(self) -> int:
        """The peak in bytes: ``slack x max(held + the largest phase, built) + process``."""
        inside = max(self.held + self.top[1], self.built)
        return math.ceil(self.slack * inside) + self.process


def check_overhead(overhead: Any, name: str = "overhead") -> None:
    if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 1 <= overhead < math.inf:
        raise ValueError(f"{name} must be a finite number >= 1 (the allocator's factor), got {overhead!r}")


def check_bytes(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}")


def peak_per_rank(
    memory: Memory,
    transient: int = 0,
    *,
    overhead: float | None = None,
    built: int = 0,
    process: int | None = None,
) -> int:
    """The most memory a rank reaches on the device it trains on: ``overhead x`` (the tensors held between
    steps, :class:`~lightning_commstrats.advisor.Memory`, plus ``transient``, the most a phase of a step adds
    on top of them: :func:`peak_phases`), or ``overhead x built`` if more (the whole model built on every
    rank before it is sharded), plus ``process``.

    ``overhead`` and ``process`` default to the measured ones of ``memory``'s device
    (:data:`ALLOCATOR_SLACK`, :data:`HOST_PROCESS_BYTES` on a CPU host, 0 on a GPU; see the module
    docstring). :func:`~lightning_commstrats.advisor.predict` gives each layout's :class:`Peak` with its
    phases apart.
    """
    return _peak(memory, (("transient", transient),), built, overhead, process).total


def _peak(
    memory: Memory, phases: tuple[tuple[str, int], ...], built: int, overhead: float | None, process: int | None
) -> Peak:
    where = "cpu" if memory.on_device == "host" else "gpu"
    if overhead is None:
        overhead = ALLOCATOR_SLACK[where]
    check_overhead(overhead)
    if process is None:
        process = HOST_PROCESS_BYTES if where == "cpu" else 0
    check_bytes("process", process)
    check_bytes("built", built)
    for name, nbytes in phases:
        check_bytes(f"the {name} phase", nbytes)
    held = memory.device if memory.on_device == "device" else memory.host
    return Peak(held, phases, built, float(overhead), process)


def peak_phases(
    scheme: str,
    settings: Mapping[str, Any],
    shapes: Sequence[Sequence[int]],
    memory: Memory,
    *,
    ranks: int,
    optimizer: str = "adamw",
    param_width: int = 4,
    outer_state: str = "host",
    activations: int = 0,
    units: FsdpUnits | None = None,
    gather_bytes: int = 4,
    reduce_bytes: int = 4,
    reshard_after_forward: bool | None = None,
    built: int = 0,
    overhead: float | None = None,
    process: int | None = None,
) -> Peak:
    """Every phase of a step on one rank, for ``memory`` (:func:`~lightning_commstrats.advisor.memory_per_rank`
    of ``scheme`` at ``settings``, sharded over ``memory.shard`` ranks, whose FSDP2 ``units`` must then be
    given) and ``activations`` (the bytes a batch's forward keeps for the backward: :func:`activation_bytes`;
    0 leaves them out), on the device ``memory`` trains on (a GPU, or a CPU host: ``memory.on_device``).
    See the module docstring for what each phase holds and where each figure comes from.
    """
    check_bytes("activations", activations)
    accelerator = "cpu" if memory.on_device == "host" else "gpu"
    shard = memory.shard
    local = [local_numel(s, shard) for s in shapes]
    replicas = ranks // shard
    grads = memory.gradients
    forward = backward = 0
    if shard > 1:
        if units is None:
            raise ValueError("a sharded layout's peak needs its FSDP2 units")
        check_units(units, len(shapes))
        gathers = fsdp_gathers(
            shapes,
            units,
            shard,
            gather_bytes=gather_bytes,
            reduce_bytes=reduce_bytes,
            reshard_after_forward=reshard_after_forward,
        )
        forward, backward = gathers.forward, gathers.backward
        end = gathers.backward_end
    else:
        end = 0
    phases = (
        ("forward", activations + forward),
        ("backward", max(max(activations, grads) - grads + backward, end)),
        ("optimizer step", optimizer_temporaries(optimizer, local, param_width, accelerator)),
        ("sync", sync_transient(scheme, settings, local, memory, replicas, param_width, outer_state, accelerator)),
    )
    return _peak(memory, phases, built, overhead, process)


def optimizer_temporaries(optimizer: str, local: Sequence[int], width: int, accelerator: str) -> int:
    """Bytes ``torch.optim``'s step allocates for the moment over ``local`` (each tensor's values on this
    rank), with its default ``foreach`` (on CUDA: a temporary the size of every parameter at once) or
    single-tensor loop (on CPU: of the largest tensor)."""
    if optimizer not in INNER_OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not supported; choose one of {tuple(INNER_OPTIMIZERS)}")
    whole, largest = width * sum(local), width * max(local, default=0)
    if optimizer in ("adam", "adamw"):  # sqrt(v) for every tensor at once, or sqrt(v) and sqrt(v) / c of one
        return whole if accelerator == "gpu" else 2 * largest
    if optimizer == "sgd_momentum":  # Nesterov's grad.add(buf, alpha=momentum)
        return whole if accelerator == "gpu" else largest
    return 0  # plain SGD steps in place


def sync_transient(
    scheme: str,
    settings: Mapping[str, Any],
    local: Sequence[int],
    memory: Memory,
    replicas: int,
    width: int,
    outer_state: str,
    accelerator: str,
) -> int:
    """Bytes a sync allocates for the moment on one rank over the state ``memory`` holds (see the module
    docstring): ``local`` is each tensor's values on this rank, ``replicas`` the groups that exchange."""
    cap = int(DEFAULT_BUCKET_CAP_MB * MIB)
    residuals = sum(b for what, b, _ in memory.scheme if "residual" in what or "error-feedback" in what)
    if scheme in PERIODIC:
        sched = schedule_of(scheme, settings, len(local))
        bounds = fragment_bounds(list(local), sched.fragments)
        fragment = 4 * max(sum(local[i0:i1]) for i0, i1 in bounds)  # float32: flat_weights' .float()
        bucket = max(_largest_bucket([4 * n for n in local[i0:i1]], cap) for i0, i1 in bounds)
        launch = 2 * fragment  # the flat local weights and the pseudo-gradient start - local
        if outer_state == "host" and accelerator == "gpu":
            launch += fragment  # the start point's visit to the device
        if replicas > 1:
            if sched.bits == 32 and sched.sparse is None and sched.gather is None:
                launch += fragment + _ring_scratch(bucket, replicas, accelerator)
            else:  # the decoded average, the new residuals beside the old, a codec's scratch
                launch += 2 * fragment + residuals
        momentum = settings.get("outer_momentum", DILOCO_OUTER_MOMENTUM)
        nesterov = scheme in ("diloco", "streaming_diloco") and momentum > 0
        outer = 2 * fragment if nesterov else fragment  # the pseudo-gradient, Nesterov's grad.add(buf)
        return max(launch, outer)
    if replicas == 1:  # nothing crosses groups
        return 0
    bits = 32 if scheme in ("allreduce", "sampled_vocab") else int_setting(settings, "num_quantization_bits", 1)
    if bits not in EXCHANGE_BITS and bits != 32:
        bits = 32
    if bits == 32:  # the kept buckets are held: gloo's ring scratch on the largest
        return _ring_scratch(_largest_bucket([width * n for n in local], cap), replicas, accelerator)
    return residuals + width * sum(local)  # the new residuals beside the old, the decoded gradients


def _largest_bucket(sizes: Sequence[int], cap: int) -> int:
    """The largest fused bucket of tensors of these byte sizes, as the strategies plan them
    (:func:`~lightning_commstrats.buckets.plan_buckets` over meta tensors of those sizes)."""
    tensors = [torch.empty(size, dtype=torch.uint8, device="meta") for size in sizes]
    return max((sum(sizes[i] for i in bucket) for bucket in plan_buckets(tensors, cap)), default=0)


def _ring_scratch(bucket: int, replicas: int, accelerator: str) -> int:
    """gloo's ring all-reduce of ``bucket`` bytes over ``replicas`` ranks allocates two segments of
    ``bucket / (2 replicas)`` (gloo/allreduce.cc: "Allocate scratch space to hold two chunks"); in host
    memory, so none on a GPU's device."""
    if accelerator == "gpu" or replicas < 2:
        return 0
    return 2 * -(-bucket // (2 * replicas))


ATTENTION = ("math", "fused")


def activation_bytes(
    module: nn.Module,
    batch_size: int,
    seq_len: int,
    *,
    loss: bool = True,
    checkpointing: bool = False,
    dtype: str | torch.dtype | None = None,
    attention: str = "math",
) -> int:
    """Bytes one rank's forward keeps for its backward with a batch of ``batch_size`` sequences of
    ``seq_len`` token ids: every tensor autograd saves (each storage once; parameters and buffers
    excluded) and the output (the logits, alive until the loss is taken), with ``loss`` a cross-entropy
    over the output's last dimension (its log-softmax saved). Measured on the meta device (no memory,
    no compute; ``module`` may be real or on meta). Raises ``ValueError`` when the forward cannot run on
    meta or does not take token ids.

    ``dtype``: the dtype the forward runs in (FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``: the
    floating parameters cast to it, so are the activations they make); default: the parameters' own.
    ``attention``: ``"math"`` (default) counts what ``scaled_dot_product_attention``'s reference
    implementation saves, the attention weights included (what the meta device runs); ``"fused"`` what
    the fused kernels (flash, memory-efficient: a GPU's) keep instead: the queries, keys, values, the
    output and the float32 log-sum-exp of each row.

    ``checkpointing``: every unit of the package's default shard policy (the blocks: what
    ``shard_policy={"activation_checkpointing": True}`` checkpoints; the outermost, where units nest)
    keeps only its input from forward and computes the rest again in backward. Counted conservatively:
    what is saved outside the units, every unit's input, and one unit's whole activations (the largest:
    the one being recomputed in backward, or computed in forward, its output included), all at once. The
    model is full checkpointing; a selective one (torchtitan's, saving some matrix products) keeps more.

    An estimate of the forward's end: with ``"math"`` on meta ``scaled_dot_product_attention`` saves the
    attention weights, which CPU's flash kernel does not keep (more); the forward's temporaries of the
    moment are not counted (less): a real CPU forward of ``benchmarks/memory.py``'s residual MLP LMs on 4 x 64
    tokens grew the resident set by 37.8 and 92.5 MiB where this says 34.5 and 89.0."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not supported; choose one of {ATTENTION}")
    cast = _torch_dtype(dtype)
    params = {
        n: t.to("meta", dtype=cast) if cast and t.is_floating_point() else t.to("meta")
        for n, t in module.named_parameters()
    }
    meta = {**params, **{n: t.to("meta") for n, t in module.named_buffers()}}
    own = {t.untyped_storage()._cdata for t in meta.values()}
    saved: dict[int, int] = {}  # storage -> bytes
    where: dict[int, int] = {}  # storage -> the unit it was first saved in (-1: outside every unit)
    inputs: dict[int, int] = {}  # the units' input storages -> bytes
    inputs_of: dict[int, set[int]] = {}  # unit -> its input storages
    keep: list[torch.Tensor] = []  # alive until counted: a freed storage's address may come back
    units = _checkpoint_units(module) if checkpointing else []
    inside: list[int] = []

    def note(t: torch.Tensor) -> None:
        keep.append(t)
        storage = t.untyped_storage()
        if storage._cdata not in own and storage._cdata not in saved:
            saved[storage._cdata] = storage.nbytes()
            where[storage._cdata] = inside[-1] if inside else -1

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t

    def enter(index: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            if not inside:  # a unit's input is what checkpointing keeps of it
                for a in args:
                    if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata not in own:
                        keep.append(a)
                        inputs[a.untyped_storage()._cdata] = a.untyped_storage().nbytes()
                        inputs_of.setdefault(index, set()).add(a.untyped_storage()._cdata)
            inside.append(index)

        return hook

    def leave(*_: Any) -> None:  # a forward hook's return value would replace the output
        inside.pop()

    handles = [u.register_forward_pre_hook(enter(i)) for i, u in enumerate(units)]
    handles += [u.register_forward_hook(leave) for u in units]
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    fused = _FusedAttentionMode() if attention == "fused" else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad(), fused:
            out = torch.func.functional_call(module, meta, (tokens,))
            out = getattr(out, "logits", out)  # a Hugging Face model's output
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"the forward returned {type(out).__name__}, not a tensor")
            note(out)
            if loss:
                flat = out.reshape(-1, out.shape[-1]).float()
                nn.functional.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device="meta"))
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
        name = type(module).__name__
        raise ValueError(f"activations: the forward of {name} on token ids did not run: {err}") from err
    finally:
        for h in handles:
            h.remove()
    if not checkpointing:
        return sum(saved.values())
    outside = {k: b for k, b in saved.items() if where[k] == -1}
    # a unit recomputed holds what it saves but its input, which is kept already (counted above)
    per_unit = [
        sum(b for k, b in saved.items() if where[k] == i and k not in inputs_of.get(i, ())) for i in range(len(units))
    ]
    return sum({**outside, **inputs}.values()) + max(per_unit, default=0)


def _checkpoint_units(module: nn.Module) -> list[nn.Module]:
    """The modules ``ShardPolicy(activation_checkpointing=True)`` checkpoints (every unit of the default
    policy), the outermost where they nest: what keeps only its input."""
    from lightning_commstrats.sharding.policy import ShardPolicy

    chosen = [unit for _, unit in ShardPolicy().select(module)]
    inner = {id(m) for u in chosen for m in u.modules() if m is not u}
    return [u for u in chosen if id(u) not in inner]


def _torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {tuple(names)}")
    return names[dtype]


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for its backward, on meta: q, k, v, the output and the float32
    log-sum-exp of each query row (flash and memory-efficient attention; the weights are recomputed)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # pragma: no cover: only measured, never run
        raise NotImplementedError


class _FusedAttentionMode(TorchFunctionMode):
    """``scaled_dot_product_attention`` as a fused kernel keeps its tensors (:class:`_FusedAttention`)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is nn.functional.scaled_dot_product_attention:
            return _FusedAttention.apply(*args[:3])
        return func(*args, **(kwargs or {}))
