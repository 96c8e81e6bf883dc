"""Building a model without its memory, and giving a sharded one its weights shard by shard.

A model too large for one rank must never exist whole on one. The sharded schemes build it in three
moves, as Lightning's own sharded strategies and torchtitan do:

1. **Build empty.** :func:`parameters_on_meta` is the context of ``init_module(empty_init=True)``
   under ``shard="fsdp"``: every parameter registered inside it moves to the meta device the moment
   it is registered (no memory, no initialisation: torch's ``nn.init`` functions return at once on
   them), while buffers and other tensors (masks, rotary caches, torchmetrics states, a projection
   drawn by ``nn.init`` in ``__init__``) are built and drawn for real, so they need no initialiser.
   A ``configure_model`` that builds under ``torch.device("meta")`` puts its buffers there too; both
   are handled alike from here on.
2. **Shard.** ``fully_shard`` works on meta tensors: the parameters become meta DTensors whose
   local shard is ``1 / g`` of each.
3. **Materialise** (:func:`materialize`): only the tensors on meta get memory on the device, each
   rank's local shards only, then every module holding them is initialised:

   - a module that defines ``init_weights()`` (torchtitan's name for a model's own initialiser) is
     called, the outermost such module first, and covers everything inside it;
   - any other module holding meta tensors, itself or in its children, is initialised by its
     ``reset_parameters()`` (how Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy``
     materialise: ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.LSTM`` all have one), in
     reverse order of ``named_modules()``: a module after the modules inside it (an MoE layer redraws
     its router, a child ``Linear``, with its own std after the ``Linear``'s default), and a weight
     tied to an earlier module (an output layer tied to the embedding) initialised as that module does,
     as a tie made in ``__init__`` leaves it. The padding row of an embedding with a ``padding_idx``
     is zeroed in this rank's shard afterwards (:func:`zero_padding_rows`).

   A module with meta tensors and neither hook is refused before anything is allocated
   (:func:`check_initialisable`), naming it: its weights would be whatever the allocator left.
   And an ``init_weights()`` may miss what its subtree holds (an ``apply`` over the ``Linear`` and
   ``Embedding`` modules leaves a rotary cache built on meta untouched): every 16-, 32- or 64-bit float
   tensor given memory here is first filled with a mark (a NaN of a payload of its own, :data:`MARKS`),
   and the names of those still holding the mark after the initialisers ran are returned
   (:func:`materialize`), for the caller to refuse on every rank. A NaN an initialiser writes on purpose
   is another NaN and passes. Smaller floats, complex, integer and boolean tensors are not checked.

Random initialisers on sharded tensors draw from each rank's own generator; on CPU torch gives every
rank of a group the same stream, so every shard would repeat the first. :func:`materialize` seeds
every initialiser by its place and by this rank's place along the dimension its tensors are split over
(the generators are restored afterwards): the shards of a group differ, every group draws the same
model, and tensors a strategy keeps apart per rank (experts) differ where they are held apart. No
Lightning here.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_commstrats.sharding.layout import is_dtensor, local

INIT_HOOK = "init_weights"
# What a tensor given memory holds until an initialiser writes it: a quiet NaN with a payload of its own, by
# the integer type of the same width (a NaN an initialiser writes on purpose is another NaN). Other dtypes
# (8-bit and smaller floats, complex, integers, booleans) are not marked, and not checked.
MARKS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float16: (torch.int16, 0x7E5A),
    torch.bfloat16: (torch.int16, 0x7FDA),
    torch.float32: (torch.int32, 0x7FC5A5A5),
    torch.float64: (torch.int64, 0x7FF8A5A5A5A5A5A5),
}


class _SkipMetaInit(TorchFunctionMode):
    """``torch.nn.init`` calls on meta tensors return at once; every other draw runs. Lightning's
    ``_EmptyInit`` skips them all, which leaves a buffer drawn in ``__init__`` holding whatever the
    allocator left (buffers are built for real here, and nothing initialises them later)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            target = kwargs.get("tensor", args[0] if args else None)
            if isinstance(target, Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside go to the meta device as they are registered, uninitialised;
    everything else is built as usual (see the module docstring). A parameter already on meta (a
    tied weight assigned to a second module) is kept as it is, so ties stay ties."""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is None or param.device.type == "meta":
            return
        held = module._parameters[name]
        assert held is not None
        moved = type(held)(held.to("meta"), requires_grad=held.requires_grad)
        moved.__dict__.update({k: v for k, v in held.__dict__.items() if k != "requires_grad"})
        module._parameters[name] = moved

    with ExitStack() as stack:
        stack.enter_context(_SkipMetaInit())
        nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
        stack.callback(setattr, nn.Module, "register_parameter", register)
        yield


def _meta_direct(module: nn.Module) -> list[str]:
    """Names of ``module``'s own parameters and buffers (not its children's) that are on meta."""
    found = [n for n, p in module.named_parameters(recurse=False) if p.is_meta]
    return found + [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _plan(root: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]], list[str]]:
    """``(own initialisers, reset_parameters modules, modules with neither)`` for ``root``'s meta tensors."""
    own: list[tuple[str, nn.Module]] = []
    resets: list[tuple[str, nn.Module]] = []
    missing: list[str] = []
    covered: list[str] = []  # names of modules whose init_weights covers their subtree
    for name, module in root.named_modules():
        if any(name == c or name.startswith(c + ".") or c == "" for c in covered):
            continue
        if callable(getattr(module, INIT_HOOK, None)) and has_meta(module):
            own.append((name, module))
            covered.append(name)
            continue
        meta = _meta_direct(module)
        if callable(getattr(module, "reset_parameters", None)) and (meta or has_meta(module)):
            # also a module whose meta tensors sit in its children: its reset runs after theirs and
            # redraws what it owns its way (an MoE layer's router, a child Linear of its own std)
            resets.append((name, module))
        elif meta:
            shown = f"{name or '(the root)'} ({type(module).__name__}: {', '.join(meta[:4])})"
            missing.append(shown)
    return own, resets, missing


def check_initialisable(root: nn.Module) -> None:
    """Raise ``ValueError`` naming every module of ``root`` whose meta tensors nothing would initialise."""
    _, _, missing = _plan(root)
    if missing:
        raise ValueError(
            f"the model was built empty (on the meta device) and {len(missing)} module(s) hold tensors nothing"
            f" initialises: {'; '.join(missing[:6])}. Give each a reset_parameters() method, or give the model an"
            f" {INIT_HOOK}() method that initialises all its weights"
        )


def _allocate_plain(root: nn.Module, device: torch.device) -> None:
    """Memory on ``device`` for every meta tensor of an unsharded ``root``, one new tensor per old one:
    a weight two modules share stays shared (``Module._apply`` would give each holder its own)."""
    new: dict[int, Tensor] = {}
    for module in root.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in new:
                    empty = torch.empty_like(t, device=device)
                    new[id(t)] = type(t)(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
                table[name] = new[id(t)]


def _still_marked(t: Tensor) -> Tensor:
    """Whether some value of ``t`` still holds its dtype's mark (a 0-dim bool on ``t``'s device)."""
    as_int, mark = MARKS[t.dtype]
    return (t.view(as_int) == mark).any()


def _named_tensors(root: nn.Module) -> dict[str, Tensor]:
    """``root``'s parameters and buffers by name (a shared tensor under its first name), local shards."""
    return {n: local(t) for n, t in (*root.named_parameters(), *root.named_buffers()) if t is not None}


def _stream_seed(base: int, ordinal: int, stream: int | tuple[int, int]) -> int:
    """The seed of initialiser ``ordinal``'s draws on a rank whose place along that initialiser's
    tensors is ``stream``: independent of every other (ordinal, stream) pair, the same on every rank
    with the same pair."""
    digest = hashlib.blake2b(f"{base}:{ordinal}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _module_tensors(module: nn.Module) -> list[Tensor]:
    return [t for t in (*module.parameters(), *module.buffers()) if t is not None]


def zero_padding_rows(root: nn.Module, modules: Collection[nn.Module]) -> None:
    """Zero the padding row of every ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``modules`` that has a
    ``padding_idx``, in this rank's shard. Their ``reset_parameters`` zero it by indexing the weight,
    which on a sharded DTensor writes into a redistributed copy and leaves the shard's row as drawn
    (a row that never gets a gradient: random for the whole run)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for module in modules:
        pad = getattr(module, "padding_idx", None)
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or pad is None:
            continue
        weight = module.weight
        with torch.no_grad():
            if not is_dtensor(weight):
                weight[pad].zero_()
                continue
            shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
            row = pad - offset[0]
            if 0 <= row < shape[0]:
                local(weight)[row].zero_()


def materialize(
    root: nn.Module,
    device: torch.device,
    index: int = 0,
    *,
    kept: Collection[Tensor] = (),
    kept_index: int = 0,
) -> tuple[list[str], list[str]]:
    """Give ``root``'s meta tensors memory on ``device`` (this rank's local shards only) and initialise
    them (see the module docstring). Returns ``(called, unwritten)``: the names of the initialisers
    called, in order, and of the marked tensors no initialiser wrote (still marked in this rank's shard:
    a rank whose shard of a tensor is empty cannot see it, so the caller agrees on them across ranks).

    Seeds follow the mesh: each initialiser draws from a seed of its own (its place in the plan and
    ``torch.initial_seed()``) and of this rank's place along the dimension its tensors are split over:
    ``index``, this rank's place in its FSDP2 group, for sharded and replicated tensors (the shards of a
    group differ, every group draws the same); ``kept_index`` for an initialiser whose tensors are all in
    ``kept``, tensors the strategy keeps whole and apart on each rank (expert parallelism's experts, by
    the expert-parallel rank: ranks holding other experts draw other experts, replicas of the same
    experts the same). An initialiser over both kinds (a model's ``init_weights()``, an MoE layer's
    ``reset_parameters``) draws from a stream unique to the pair, and the strategy's broadcast of the
    initial weights makes equal what must be equal."""
    own, resets, missing = _plan(root)
    if missing:
        check_initialisable(root)
    # the tensors given memory below that can hold a mark (a meta tensor knows its dtype)
    marked = [n for n, t in _named_tensors(root).items() if t.is_meta and t.dtype in MARKS]
    kept_ids = {id(t) for t in kept}
    # which stream each initialiser draws from, decided while the tensors are still the meta ones
    streams: list[int | tuple[int, int]] = []
    for _, module in (*own, *reversed(resets)):
        held = [id(t) in kept_ids for t in _module_tensors(module) if t.is_meta]
        if held and all(held):
            streams.append(kept_index)
        elif any(held):
            streams.append((index, kept_index))  # the pair, whatever the sizes of the two dimensions
        else:
            streams.append(index)
    materialised = [m for m in root.modules() if _meta_direct(m)]

    if any(is_dtensor(p) for p in root.parameters()):
        # FSDP2's own _apply re-registers the sharded parameters afterwards
        root._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    else:
        _allocate_plain(root, device)
    devices = [device] if device.type == "cuda" else []
    called = []
    base = torch.initial_seed()
    with torch.random.fork_rng(devices=devices), torch.no_grad(), warnings.catch_warnings():
        # DTensor says its random operators may be incomplete on a CPU mesh: each rank then draws its
        # own shard from its own generator, which the seeds below set per initialiser and per rank
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        tensors = _named_tensors(root)
        for name in marked:  # what no initialiser writes keeps the mark, bit for bit, and is found below
            as_int, mark = MARKS[tensors[name].dtype]
            tensors[name].view(as_int).fill_(mark)
        calls = [(name, module, INIT_HOOK) for name, module in own]
        # inner before outer, and a tied weight keeps its first holder's
        calls += [(name, module, "reset_parameters") for name, module in reversed(resets)]
        for ordinal, ((name, module, hook), stream) in enumerate(zip(calls, streams, strict=True)):
            torch.manual_seed(_stream_seed(base, ordinal, stream))
            getattr(module, hook)()
            called.append(f"{name or type(root).__name__}.{hook}")
        zero_padding_rows(root, materialised)
    tensors = _named_tensors(root)
    still = [n for n, t in tensors.items() if t.is_meta]
    if still:
        raise RuntimeError(f"materialising the model left {still[:4]} on the meta device")
    # an initialiser may have replaced a tensor rather than filled it (on another device, of another dtype):
    # the tensors held now are checked, all at once (one device-to-host copy on CUDA, not one per tensor)
    present = [n for n in marked if n in tensors and tensors[n].dtype in MARKS]
    if not present:
        return called, []
    flags = torch.stack([_still_marked(tensors[n]).to(device) for n in present]).tolist()
    unwritten = [n for n, bad in zip(present, flags, strict=True) if bad]
    return called, unwritten


def unwritten_error(names: list[str], called: list[str]) -> ValueError:
    """The refusal of a model whose initialisers left ``names`` (built empty) unwritten."""
    return ValueError(
        f"the model was built empty (on the meta device) and after its initialisers ({', '.join(called[:4]) or 'none'})"
        f" {len(names)} tensor(s) still hold no value: {', '.join(names[:6])}. An {INIT_HOOK}() covers everything"
        f" inside its module and must initialise these too (a rotary cache: recompute it; LitGPT's GPT does in"
        f" its reset_parameters()), or build them for real (Trainer.init_module(empty_init=True) builds buffers"
        " for real and only the parameters on meta). A checkpoint loaded after setup would overwrite them, but"
        " is not read before this check: initialise them anyway"
    )
