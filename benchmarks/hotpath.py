"""What the gradient schemes' per-step work launches, synchronises and allocates, counted per step.

    python benchmarks/hotpath.py [--steps 6] [--warmup 2] [--before /tmp/hotpath-before]

Two ranks (gloo on localhost, one process each) train the LSTM LM of
``lightning_commstrats/configs/lstm_demo.yaml`` (10,000 words, embedding and hidden size 256, tied
vocabulary matrix) on a synthetic Zipf-distributed token stream, with ``onebit_sgd`` at 1, 2, 4 and
8 bits (the n-bit aggregation, :class:`~lightning_commstrats.compression.QuantizedAllReduce`) and with
``sampled_vocab`` (its defaults: alpha 2000, beta 1000, fp32 for the other parameters). Rank 0 counts,
for every optimizer step after ``--warmup``, what runs inside the strategy's per-step hooks
(``on_train_batch_start``, ``after_backward``, ``after_optimizer_step``) and, apart, inside the
quantized all-reduce alone:

- **kernels**: aten operators that are not views or bare allocations (seen by a
  ``TorchDispatchMode``): on CUDA each one is (at least) a kernel launch;
- **host syncs**: what makes the host wait for the device on CUDA: ``.item()`` / ``bool()`` /
  ``int()`` of a tensor (``aten::_local_scalar_dense``), ``.tolist()`` and ``.cpu()`` (device-to-host
  copies), and operators whose output size depends on the data (``nonzero``, ``unique``,
  ``masked_select``, indexing with a boolean mask, ``bincount``, ``repeat_interleave`` without
  ``output_size``). Copies from host to device are not counted;
- **fp32 allocated**: bytes of the new float32 tensors of at least ``--min-kib`` KiB the operators
  return (views and in-place results are not new), also as a multiple of the float32 bytes of the
  model's parameters (``x model``).

The counts depend on the shapes only (not on the other rank's data), so one rank's are the step's.
On this CPU machine 1-bit packing goes through numpy, which the operator counts do not see (on
CUDA it is a few kernels per matrix, before and after alike).

A second table counts the quantized all-reduce alone on the same model's matrices for more ranks
(``--ranks``), in one process: rank 0 of ``N`` whose peers send exactly what it sends
(:class:`Mirror`), which gives every rank's shapes and so every count but the time.

``--before PATH`` runs the same ranks a second time with ``PATH`` (a checkout of the earlier code)
first on ``PYTHONPATH``, and prints both side by side; ``--after PATH`` does the same for the code
measured as "after" (default: the package this interpreter imports).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from common import localhost_env, prepend_pythonpath, quiet_trainer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_commstrats.comm import Communicator

VOCAB, DIM, SEQ_LEN, BATCH = 10_000, 256, 35, 32
SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {
    "onebit_sgd 1 bit": ("onebit_sgd", {"num_quantization_bits": 1}),
    "onebit_sgd 2 bits": ("onebit_sgd", {"num_quantization_bits": 2}),
    "onebit_sgd 4 bits": ("onebit_sgd", {"num_quantization_bits": 4}),
    "onebit_sgd 8 bits": ("onebit_sgd", {"num_quantization_bits": 8}),
    "sampled_vocab": ("sampled_vocab", {}),
}

# operators that need the device's data on the host (their output size, or a value, is data)
SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::bincount",
    "aten::equal",
}
# operators that launch nothing: allocations and metadata
NO_KERNEL_OPS = {
    "aten::empty",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::_unsafe_view",
    "aten::set_",
    "aten::resize_",
}


class HotPathCounter(TorchDispatchMode):
    """Counts kernels, views, host synchronisations and large float32 allocations of the operators
    run inside it (see the module notes); ``.tolist()`` and ``.cpu()`` are counted by
    :func:`counting_transfers`, which must be active too."""

    def __init__(self, min_bytes: int = 64 * 2**10) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.kernels = 0
        self.views = 0
        self.collectives = 0
        self.syncs: Counter[str] = Counter()
        self.fp32_bytes = 0
        self.fp32_allocs = 0
        self.ops: Counter[str] = Counter()
        self.fp32_by_op: Counter[str] = Counter()

    def totals(self) -> dict[str, Any]:
        return {
            "kernels": self.kernels,
            "views": self.views,
            "collectives": self.collectives,
            "syncs": sum(self.syncs.values()),
            "sync_kinds": dict(self.syncs),
            "fp32_bytes": self.fp32_bytes,
            "fp32_allocs": self.fp32_allocs,
        }

    def __enter__(self) -> HotPathCounter:
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.name()
        base = name.split(".")[0]
        self.ops[name] += 1
        if name.startswith("c10d::"):
            self.collectives += 1
            return out
        if base in SYNC_OPS or _data_sized(base, args, kwargs):
            self.syncs[base] += 1
        if func.is_view:
            self.views += 1
        elif base not in NO_KERNEL_OPS and base not in SYNC_OPS:
            self.kernels += 1
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.dtype == torch.float32
                and t.untyped_storage().nbytes() >= self.min_bytes
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.fp32_bytes += t.untyped_storage().nbytes()
                self.fp32_allocs += 1
                self.fp32_by_op[name] += t.untyped_storage().nbytes()
        return out


_ACTIVE: list[HotPathCounter] = []


def _data_sized(base: str, args: tuple, kwargs: dict) -> bool:
    """Indexing with a boolean mask, and ``repeat_interleave`` without ``output_size``: their output
    size is the data's."""
    if base in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if base == "aten::repeat_interleave":
        return kwargs.get("output_size") is None and not (len(args) > 3 and args[3] is not None)
    return False


@contextmanager
def counting_transfers() -> Iterator[None]:
    """Count ``Tensor.tolist()`` and ``Tensor.cpu()`` as host synchronisations of the active
    counters (on CUDA both copy device memory to the host and wait for it)."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}

    def counted(name: str) -> Callable[..., Any]:
        original = originals[name]

        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            for counter in _ACTIVE:
                counter.syncs[f"Tensor.{name}"] += 1
            return original(self, *args, **kwargs)

        return method

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class Mirror(Communicator):
    """Rank ``rank`` of ``world_size`` whose peers all send what it sends: collectives in one process
    with the shapes (not the values) of a real run."""

    backend = "mirror"

    def _all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        out.copy_(tensor.expand_as(out))

    def _all_to_all(
        self, out: torch.Tensor, tensor: torch.Tensor, recv_splits: list[int], send_splits: list[int]
    ) -> None:
        out.copy_(tensor.split(send_splits)[self.rank].repeat(self.world_size))

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        tensor.mul_(self.world_size)

    def _reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: str) -> None:
        out.copy_(tensor.view(self.world_size, -1)[self.rank]).mul_(self.world_size)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        pass

    def _barrier(self) -> None:
        pass


def simulate_aggregation(bits: int, world: int, min_kib: int) -> dict[str, Any]:
    """One call's counts of the quantized all-reduce on the LM's matrices (rank 0 of ``world``, in
    this process, after a first call that makes the residuals)."""
    from lightning_commstrats.compression import ColumnCodec, QuantizedAllReduce

    shapes = {"embedding": (VOCAB, DIM), "weight_ih": (4 * DIM, DIM), "weight_hh": (4 * DIM, DIM)}
    g = torch.Generator().manual_seed(0)
    grads = {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}
    aggregate = QuantizedAllReduce(ColumnCodec(bits), Mirror(rank=0, world_size=world))
    aggregate(grads)
    counter = HotPathCounter(min_kib * 2**10)
    with counting_transfers(), counter:
        aggregate(grads)
    return {**counter.totals(), "model_bytes": sum(t.numel() * 4 for t in grads.values())}


# ---------------------------------------------------------------- one rank


def zipf_stream(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``n`` token ids drawn with probability proportional to ``1 / (rank + 1)`` (word frequencies)."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=True, generator=torch.Generator().manual_seed(seed))


def measure_rank(
    scheme: str,
    steps: int,
    warmup: int,
    min_kib: int,
    vocab: int = VOCAB,
    dim: int = DIM,
    strategy_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Train ``steps`` optimizer steps of ``scheme`` (with ``strategy_kwargs`` added to its
    arguments) on this rank, launched as torchrun does, on an LSTM LM of ``vocab`` words and size
    ``dim``; rank 0 returns its per-step counts after ``warmup`` steps, the other ranks None."""
    from torch.utils.data import DataLoader

    import lightning_commstrats
    from lightning_commstrats.compression import QuantizedAllReduce
    from lightning_commstrats.data import StreamWindows
    from lightning_commstrats.models import LanguageModel

    name, kwargs = SCHEMES[scheme]
    kwargs = {**kwargs, **(strategy_kwargs or {})}
    stream = zipf_stream(2 * (steps + 1) * BATCH * (SEQ_LEN + 1), vocab)
    counts = torch.bincount(stream, minlength=vocab).tolist()
    if name == "sampled_vocab":
        kwargs = {**kwargs, "word_counts": counts}
    strategy = lightning_commstrats.OneBitSGDStrategy(**kwargs) if name == "onebit_sgd" else None
    if strategy is None:
        strategy = lightning_commstrats.SampledVocabStrategy(**kwargs)
    model = LanguageModel(arch="lstm", vocab_size=vocab, embed_dim=dim, hidden_dim=dim, tie_weights=True, lr=0.003)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    loader = DataLoader(StreamWindows(stream, SEQ_LEN, pad_id=0), batch_size=BATCH)

    current = {"step": HotPathCounter(min_kib * 2**10), "aggregation": HotPathCounter(min_kib * 2**10)}
    per_step: list[dict[str, Any]] = []
    agg_per_step: list[dict[str, Any]] = []

    def counted(hook: Callable[..., Any], last: bool = False) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            with current["step"]:
                out = hook(*args, **kw)
            if last:  # the step's scheme work is done: close its counts
                per_step.append(current["step"].totals())
                agg_per_step.append(current["aggregation"].totals())
                current.update(step=HotPathCounter(min_kib * 2**10), aggregation=HotPathCounter(min_kib * 2**10))
            return out

        return run

    for hook in ("on_train_batch_start", "after_backward"):
        setattr(strategy, hook, counted(getattr(strategy, hook)))
    strategy.after_optimizer_step = counted(strategy.after_optimizer_step, last=True)
    aggregate = QuantizedAllReduce.__call__

    def aggregate_counted(self: Any, *args: Any, **kw: Any) -> Any:
        with current["aggregation"]:
            return aggregate(self, *args, **kw)

    QuantizedAllReduce.__call__ = aggregate_counted  # type: ignore[method-assign]
    trainer = quiet_trainer(validate=False, devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=steps)
    with counting_transfers():
        trainer.fit(model, train_dataloaders=loader)
    if trainer.global_rank != 0:
        return None
    return {
        "scheme": scheme,
        "model_bytes": model_bytes,
        "steps": per_step[warmup:],
        "aggregation": agg_per_step[warmup:],
    }


# ---------------------------------------------------------------- the table


def run_ranks(scheme: str, args: argparse.Namespace, pythonpath: str | None) -> dict[str, Any]:
    """Rank 0's counts of ``scheme`` on two ranks, the package imported from ``pythonpath`` first."""
    with tempfile.TemporaryDirectory() as out:
        env = localhost_env(2, pythonpath)
        spec = json.dumps({"scheme": scheme, "steps": args.steps, "warmup": args.warmup, "min_kib": args.min_kib})
        procs = [
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--rank", spec, out],
                env={**env, "LOCAL_RANK": str(r)},
                cwd=out,
            )
            for r in range(2)
        ]
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError(f"{scheme}: a rank failed")
        return json.loads((Path(out) / "rank0.json").read_text())


def per_step(result: dict[str, Any], part: str) -> dict[str, float]:
    """The mean per step of ``part`` ("steps" or "aggregation"); the counts must not vary between steps."""
    rows = result[part]
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in ("kernels", "syncs", "fp32_bytes", "fp32_allocs")}
    mean["varies"] = any(r["kernels"] != rows[0]["kernels"] or r["syncs"] != rows[0]["syncs"] for r in rows)
    kinds: Counter[str] = Counter()
    for r in rows:
        kinds.update(r["sync_kinds"])
    mean["kinds"] = ", ".join(f"{k} {v / len(rows):g}" for k, v in sorted(kinds.items()))
    mean["x_model"] = mean["fp32_bytes"] / result["model_bytes"]
    return mean


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    versions = list(results)
    lines = [
        "| scheme | part | "
        + " | ".join(f"{what} ({v})" for what in ("kernels", "host syncs", "fp32 MB (x model)") for v in versions)
        + " |",
        "|---|---|" + "---|" * (3 * len(versions)),
    ]
    for scheme in SCHEMES:
        for part, label in (("steps", "step hooks"), ("aggregation", "quantized all-reduce")):
            cells = {v: per_step(results[v][scheme], part) for v in versions if scheme in results[v]}
            if all(c["kernels"] == 0 for c in cells.values()):
                continue
            kernels = [f"{cells[v]['kernels']:g}" + (" *" if cells[v]["varies"] else "") for v in versions]
            syncs = [f"{cells[v]['syncs']:g}" for v in versions]
            mem = [f"{cells[v]['fp32_bytes'] / 1e6:.1f} ({cells[v]['x_model']:.2f})" for v in versions]
            lines.append(f"| {scheme} | {label} | " + " | ".join(kernels + syncs + mem) + " |")
    lines.append("")
    lines.append("Host syncs by kind, per step (step hooks):")
    lines.append("")
    for scheme in SCHEMES:
        for v in versions:
            if scheme in results[v]:
                lines.append(f"- {scheme}, {v}: {per_step(results[v][scheme], 'steps')['kinds'] or 'none'}")
    return "\n".join(lines)


def simulate_in(pythonpath: str | None, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """:func:`simulate_aggregation` for every width and ``args.ranks``, the package from ``pythonpath``."""
    env = prepend_pythonpath(dict(os.environ), pythonpath)
    with tempfile.TemporaryDirectory() as out:
        spec = json.dumps({"ranks": args.ranks, "min_kib": args.min_kib})
        path = Path(out) / "simulated.json"
        subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--simulate", spec, str(path)], env=env, cwd=out, check=True
        )
        return json.loads(path.read_text())


def simulated_table(simulated: dict[str, dict[str, dict[str, Any]]]) -> str:
    versions = list(simulated)
    lines = [
        "| bits | N | "
        + " | ".join(f"{what} ({v})" for what in ("kernels", "host syncs", "fp32 x model") for v in versions)
        + " |",
        "|---|---|" + "---|" * (3 * len(versions)),
    ]
    for key in simulated[versions[0]]:
        bits, world = key.split()
        cells = [simulated[v][key] for v in versions]
        row = [str(c["kernels"]) for c in cells] + [str(c["syncs"]) for c in cells]
        row += [f"{c['fp32_bytes'] / c['model_bytes']:.2f}" for c in cells]
        lines.append(f"| {bits} | {world} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps not counted (layouts, buffers)")
    parser.add_argument("--min-kib", type=int, default=64, help="smallest float32 allocation counted, KiB")
    parser.add_argument("--before", help="a checkout of the earlier code, put first on PYTHONPATH")
    parser.add_argument("--after", help="a checkout of the code to compare it with (default: as imported)")
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 8, 32], help="ranks of the second table")
    parser.add_argument("--rank", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--simulate", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        spec, out = json.loads(args.rank[0]), Path(args.rank[1])
        result = measure_rank(spec["scheme"], spec["steps"], spec["warmup"], spec["min_kib"])
        if result is not None:
            (out / "rank0.json").write_text(json.dumps(result))
        return
    if args.simulate:
        spec = json.loads(args.simulate[0])
        counts = {f"{b} {n}": simulate_aggregation(b, n, spec["min_kib"]) for b in (1, 2, 4, 8) for n in spec["ranks"]}
        Path(args.simulate[1]).write_text(json.dumps(counts))
        return
    versions = {"before": args.before, "after": args.after} if args.before else {"now": args.after}
    results: dict[str, dict[str, dict[str, Any]]] = {v: {} for v in versions}
    for scheme in args.schemes:
        for version, path in versions.items():
            results[version][scheme] = run_ranks(scheme, args, path)
    simulated = {version: simulate_in(path, args) for version, path in versions.items()} if args.ranks else {}
    print(f"torch {torch.__version__}, 2 ranks (gloo), LSTM LM {VOCAB} words x {DIM}, batch {BATCH} x {SEQ_LEN}")
    print(f"per optimizer step, mean of steps {args.warmup + 1}..{args.steps} on rank 0; * = varies between steps")
    print()
    print(table(results))
    if simulated:
        print()
        print(f"The quantized all-reduce alone, one call, rank 0 of N ({Mirror.__name__}: in one process)")
        print()
        print(simulated_table(simulated))


if __name__ == "__main__":
    main()
