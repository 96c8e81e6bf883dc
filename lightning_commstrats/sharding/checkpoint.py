"""Sharded checkpoints: the whole Lightning checkpoint of a ``shard="fsdp"`` run through
``torch.distributed.checkpoint`` (DCP), resumed bit for bit or onto another layout.

A checkpoint is a directory: DCP's files (every rank writes its own shards, each tensor once) and
``meta.pt``, written by rank 0 after every rank's data is down, which makes the directory complete.
What goes where:

- *shared* (the same on every group; DCP keeps one copy): the model (for the periodic schemes the
  global model), and the scheme's shared state (the global model of each fragment, the outer
  optimizer's state, an exchange in flight). Tensors that are flat vectors of a fragment's local
  shards are cut back into one DTensor per parameter, so that DCP can re-split them over another
  ``group_size`` or number of groups.
- *per group* (keys ``g<k>/...``): the inner optimizers and each rank's local weights of a periodic
  scheme: per-parameter DTensors too. On another number of groups, group ``k`` resumes from old
  group ``k mod G_old``'s.
- *per rank* (keys ``r<k>/...``): every other tensor of a rank's state (error-feedback residuals,
  whose shapes follow the rank's shard and the codec's stripes; a slow hop's residuals). Restored on
  the same layout; on another one rank ``r`` reads its source rank's (the first of old group
  ``k mod G_old``), and the scheme's ``resharded_rank_state`` rule drops the residuals.
- everything else (counters, loops, callbacks, hyperparameters, 0-d tensors) is pickled in ``meta.pt``,
  and so are the other entries of the checkpoint (a Fabric checkpoint's model and optimizers: their
  DTensors per group, their plain tensors per rank).

No Lightning here: the strategy hands in the checkpoint dict and gets one back.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_commstrats._logging import log_rank_zero
from lightning_commstrats.sharding.layout import is_dtensor, local

log = logging.getLogger(__name__)

META = "meta.pt"
INNER = "i*/"  # the key prefix of an entry rank i of every group holds alike, filled in at load
_PH = "__commstrats_dcp__"  # marks a placeholder in a skeleton


def dtensor_zeros(shape: tuple, **kwargs: Any) -> Tensor:
    from torch.distributed.tensor import zeros

    return zeros(*shape, **kwargs)


_HOST_MESHES: dict[int, Any] = {}  # id of a device's mesh -> (that mesh, its host twin)


def host_mesh(mesh: Any) -> Any:
    """A mesh over the same ranks as ``mesh`` whose device is the host (``mesh`` itself when it is):
    what host-held state (``outer_state="host"``: the global model, the outer optimizer's state, in
    pinned memory on CUDA) is described with. ``DTensor.from_local`` moves a local tensor to its mesh's
    device, so a CUDA mesh would take such state to the GPU and back on every save and load. The twin
    makes no process group: DCP reads only its ranks' coordinates, and its own collectives (plans, a
    few objects) go over the default group."""
    if mesh.device_type == "cpu":
        return mesh
    known = _HOST_MESHES.get(id(mesh))
    if known is None or known[0] is not mesh:
        from torch.distributed.device_mesh import DeviceMesh

        twin = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False)
        known = _HOST_MESHES[id(mesh)] = (mesh, twin)
    return known[1]


def _dtensor_like(shard: Tensor, param: Tensor) -> Tensor:
    """``shard`` (this rank's part, shaped like ``param``'s local shard) as a DTensor sharded as ``param``,
    where ``shard`` is: a shard on the host stays there (see :func:`host_mesh`)."""
    from torch.distributed.tensor import DTensor

    mesh = host_mesh(param.device_mesh) if shard.device.type == "cpu" else param.device_mesh
    return DTensor.from_local(
        shard.detach().reshape(local(param).shape).contiguous(),
        device_mesh=mesh,
        placements=param.placements,
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )


class _Encoder:
    """Turns a nested state into a skeleton (placeholders for tensors) and the DCP items to write."""

    def __init__(self, params: dict[str, Tensor], group: int, rank: int, index: int = 0) -> None:
        self.params, self.group, self.rank, self.index = params, group, rank, index
        self.items: dict[str, Tensor] = {}

    def put(self, key: str, tensor: Tensor, kind: str) -> dict[str, Any]:
        """``kind``: ``"shared"``/``"group"`` (a DTensor), ``"plain"`` (a tensor every rank holds alike)
        or ``"rank"`` (this rank's)."""
        self.items[key] = tensor
        # a DTensor: how it is split over a group, for a template on this or another layout's mesh
        placements = tuple(tensor.placements) if kind in ("shared", "group") else None
        return {
            _PH: kind,
            "key": key,
            "placements": placements,
            "shape": tuple(tensor.shape),
            "dtype": tensor.dtype,
            # a rank's own state held on the host (residuals="host"): read back there, not to the device
            "host": kind == "rank" and tensor.device.type == "cpu",
        }

    def split(self, key: str, flat: Tensor, names: list[str], scope: str) -> dict[str, Any]:
        """A flat vector of the local shards of ``names`` (in order): one DTensor per parameter."""
        out, offset = {}, 0
        for name in names:
            p = self.params[name]
            n = local(p).numel()
            if is_dtensor(p):
                out[name] = self.put(f"{key}/{name}", _dtensor_like(flat[offset : offset + n], p), scope)
            else:  # a parameter FSDP2 leaves whole (an expert): the same on rank i of every group
                part = flat[offset : offset + n].detach().reshape(p.shape).contiguous()
                out[name] = self.put(f"i{self.index}/{key}/{name}", part, "inner")
                out[name]["key"] = f"{INNER}{key}/{name}"  # read by rank i of any group as its own
            # held on the host (outer_state="host"): read back there (see host_mesh)
            out[name]["host"] = flat.device.type == "cpu"
            offset += n
        return {_PH: "split", "parts": out, "dtype": flat.dtype}

    def encode(
        self,
        obj: Any,
        key: str,
        scope: str,
        fragments: Callable[[tuple], list[str] | None],
        path: tuple = (),
        plain: bool = False,
    ) -> Any:
        """``scope``: ``"shared"`` or ``"group"``; ``plain``: tensors that are neither DTensors nor
        shards are the same on every rank (the model's buffers), not this rank's own."""
        prefix = "s" if scope == "shared" else f"g{self.group}"
        if isinstance(obj, Tensor):
            if is_dtensor(obj):
                return self.put(f"{prefix}/{key}", obj, scope)
            if obj.dim() == 0:
                return obj.detach().cpu().clone()
            names = fragments(path)
            if names is not None:
                return self.split(f"{prefix}/{key}", obj, names, scope)
            if plain:
                return self.put(f"{prefix}/{key}", obj.detach().contiguous(), "plain")
            # this rank's own (error-feedback residuals: their shapes follow the rank's shard and the
            # codec's choices, which ranks of a group need not share); a scheme re-splits none of them
            return self.put(f"r{self.rank}/{key}", obj.detach().contiguous(), "rank")
        if isinstance(obj, dict):
            return {k: self.encode(v, f"{key}/{k}", scope, fragments, (*path, k), plain) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            out = [self.encode(v, f"{key}/{i}", scope, fragments, (*path, i), plain) for i, v in enumerate(obj)]
            return out if isinstance(obj, list) else tuple(out)
        return obj


def _placeholders(skeleton: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def visit(o: Any) -> None:
        if isinstance(o, dict):
            if o.get(_PH) == "split":
                visit(o["parts"])
            elif _PH in o:
                found.append(o)
            else:
                for v in o.values():
                    visit(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)

    visit(skeleton)
    return found


def template(ph: dict[str, Any], mesh: Any) -> Tensor:
    """The tensor DCP reads placeholder ``ph`` into: a plain host tensor for a rank's own or a plain
    entry, else a DTensor over ``mesh``, or over its host twin when it was saved from the host (read
    where the strategy keeps it, with no trip through the device)."""
    if ph[_PH] in ("rank", "plain", "inner"):
        return torch.empty(ph["shape"], dtype=ph["dtype"])
    on = host_mesh(mesh) if ph.get("host", False) else mesh
    return dtensor_zeros(ph["shape"], dtype=ph["dtype"], device_mesh=on, placements=ph["placements"])


def _decode(skeleton: Any, loaded: dict[str, Tensor], device: torch.device) -> Any:
    if isinstance(skeleton, dict):
        kind = skeleton.get(_PH)
        if kind == "split":
            parts = [_decode(v, loaded, device) for v in skeleton["parts"].values()]
            if any(p is None for p in parts):
                return None
            return torch.cat([local(p).reshape(-1) for p in parts]).to(skeleton["dtype"]) if parts else None
        if kind is not None:
            t = loaded.get(skeleton["key"])
            if t is None:
                return None
            # a DTensor stays one (a split's parts are put back together from their local shards); a
            # tensor saved from the host stays there (placeholders written before the mark: the device)
            return t.to(device) if kind in ("rank", "plain", "inner") and not skeleton.get("host", False) else t
        return {k: _decode(v, loaded, device) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_decode(v, loaded, device) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_decode(v, loaded, device) for v in skeleton)
    return skeleton


def periodic_fragments(strategy: Any, state: dict[str, Any]) -> Callable[[tuple], list[str] | None]:
    """Which flat tensors of a periodic scheme's state are fragments of local shards (and of which
    parameters): the global model and outer optimizer state per fragment, the exchange in flight,
    each rank's local weights and the launched weights of an overlapped exchange."""
    if not hasattr(strategy, "fragment_params"):
        return lambda path: None
    by_name = dict(strategy.lightning_module.named_parameters())
    inflight = state.get("inflight") or {}

    def names_of(fragment: int | None) -> list[str]:
        params = strategy.params if fragment is None else strategy.fragment_params(fragment)
        return [strategy.param_name(p) for p in params]

    def fragments(path: tuple) -> list[str] | None:
        if path[:2] == ("outer", "weights") and len(path) == 3:
            return names_of(path[2])
        if path[:3] == ("outer", "optimizer", "state") and len(path) == 5:
            names = names_of(path[3])
            size = sum(local(by_name[n]).numel() for n in names)
            return names if size and _numel_at(state, path) == size else None
        if path == ("inflight", "grad"):
            return names_of(inflight["fragment"])
        if path == ("weights",):
            return names_of(None)
        if path == ("launched",) and inflight:
            return names_of(inflight["fragment"])
        return None

    return fragments


def _numel_at(obj: Any, path: tuple) -> int:
    for k in path:
        obj = obj[k]
    return obj.numel() if isinstance(obj, Tensor) else -1


def save(
    path: str,
    checkpoint: dict[str, Any],
    scheme: dict[str, Any],
    *,
    module: nn.Module,
    comm: Any,
    group: int,
    group_size: int,
    fragments: Callable[[tuple], list[str] | None],
    own: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Collective. Write the Lightning ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` of
    DTensors) and the ``scheme`` entry (``state``: shared, ``rank``: this rank's) to the directory ``path``.
    ``own``: the model's entries this rank holds whole and as its own (the experts of expert
    parallelism, which FSDP2 leaves alone): saved per rank, read back by the rank that takes its place."""
    import torch.distributed.checkpoint as dcp

    params = dict(module.named_parameters())
    enc = _Encoder(params, group, comm.rank, comm.rank % group_size)
    # the rest (Lightning's loops and callbacks; a Fabric checkpoint's own entries: a model, optimizers)
    # per group: a model's DTensors are the same in every group, an optimizer's may not be
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    others = enc.encode(rest, "rest", "group", lambda p: None)
    model_state = checkpoint.get("state_dict", {})
    shared = {k: v for k, v in model_state.items() if k not in own}
    model = enc.encode(shared, "model", "shared", lambda p: None, plain=True)
    model_own = {
        k: enc.put(f"r{comm.rank}/model/{k}", v.detach().contiguous(), "rank")
        for k, v in model_state.items()
        if k in own
    }
    optimizers = enc.encode(checkpoint.get("optimizer_states", []), "optimizers", "group", lambda p: None)
    state = enc.encode(scheme["state"], "scheme", "shared", fragments)
    rank = enc.encode(scheme["rank"], "scheme_rank", "group", fragments)
    # written beside, then put in place: an older checkpoint under this name stays whole until then
    writing = f"{path}.writing"
    if comm.rank == 0:
        remove(writing)
    comm.barrier()
    dcp.save(enc.items, checkpoint_id=writing)
    skeletons = comm.all_gather_object({"optimizers": optimizers, "rank": rank, "rest": others, "model": model_own})
    if comm.rank == 0:
        meta = {
            "model": model,
            "state": state,
            "strategy": scheme["strategy"],
            "world_size": comm.world_size,
            "group_size": group_size,
            "ranks": skeletons,
        }
        torch.save(meta, os.path.join(writing, META))  # the new checkpoint is complete from here
        remove(path)
        os.replace(writing, path)
    comm.barrier()


def load(
    path: str, *, module: nn.Module, comm: Any, group_size: int, device: torch.device
) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Collective. Read the checkpoint directory ``path``: the model and inner optimizers as Lightning
    loads them (in ``state_dict`` / ``optimizer_states``, DTensors on this layout), the scheme's
    entry (``state``, ``rank``, ``world_size``), and whether the layout (ranks and group size) is
    the one it was saved with."""
    import torch.distributed.checkpoint as dcp

    meta_path = os.path.join(path, META)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(
            f"{path} is not a complete sharded checkpoint (no {META}): it was not written by a shard='fsdp' run,"
            " or its writing stopped before the end"
        )
    meta = torch.load(meta_path, weights_only=False)
    same = meta["world_size"] == comm.world_size and meta["group_size"] == group_size
    old_groups = meta["world_size"] // meta["group_size"]
    group = comm.rank // group_size
    # On another layout rank i of group k reads old group (k mod G_old)'s rank i: the same place in a
    # group of the same size holds the same experts (a rank's own entries) and dense shard. Experts are
    # not re-split over groups of another size (a rank would hold other experts than any saved rank).
    kept_whole = any(r.get("model") for r in meta["ranks"])
    if not same and kept_whole and meta["group_size"] != group_size:
        raise ValueError(
            f"{path} holds experts kept whole per rank in groups of {meta['group_size']} ranks: they resume on"
            f" groups of the same size only (this run has group_size={group_size}); another number of groups"
            " is fine"
        )
    place = comm.rank % group_size if meta["group_size"] == group_size else 0
    source = comm.rank if same else (group % old_groups) * meta["group_size"] + place
    mine = meta["ranks"][source]
    wanted: dict[str, Tensor] = {}
    mesh = next(p.device_mesh for p in module.parameters() if is_dtensor(p))
    # mine: the source rank's optimizers, rank state and the rest; on another layout its own entries
    # come too (buffers a Fabric checkpoint holds), and the scheme's reshard rule drops what it must
    for ph in _placeholders([meta["model"], meta["state"], mine]):
        if ph[_PH] == "inner":  # an entry of rank i of a group: this rank's place in its group
            ph["key"] = ph["key"].replace(INNER, f"i{comm.rank % group_size}/", 1)
        wanted[ph["key"]] = template(ph, mesh)
    dcp.load(wanted, checkpoint_id=path)
    checkpoint = _decode(mine["rest"], wanted, device)
    checkpoint["state_dict"] = _decode(meta["model"], wanted, device)
    checkpoint["state_dict"].update(_decode(mine.get("model", {}), wanted, device))  # this rank's own entries
    checkpoint["optimizer_states"] = _decode(mine["optimizers"], wanted, device)
    scheme = {
        "strategy": meta["strategy"],
        "world_size": meta["world_size"],
        "state": _decode(meta["state"], wanted, device),
        "rank": _decode(mine["rank"], wanted, device),
        "group_size": meta["group_size"],
    }
    return checkpoint, scheme, same


def global_state_dict(state: dict[str, Any], module: nn.Module, global_shards: dict[str, Tensor]) -> dict[str, Any]:
    """``state`` (a module state dict of DTensors) with every parameter, under each of its names (tied
    ones too), replaced by the DTensor of its ``global_shards`` entry (this rank's part of the global model)."""
    slices = {}
    for name, p in module.named_parameters():
        if is_dtensor(p):
            slices[(local(p).data_ptr(), p.shape)] = _dtensor_like(global_shards[name], p)
        else:  # a parameter FSDP2 leaves whole (an expert this rank owns): its global value as it is
            slices[(p.data_ptr(), p.shape)] = global_shards[name].reshape(p.shape)
    out = dict(state)
    for key, value in state.items():
        if isinstance(value, Tensor):
            match = slices.get((local(value).data_ptr(), value.shape))
            if match is not None:
                out[key] = match.to(value.dtype)
    return out


def check_destination(path: str, storage_options: Any | None) -> None:
    """A sharded checkpoint is a directory on a filesystem every rank writes into and rank 0 then
    completes and renames: refuse what it cannot honour, before any rank writes (every rank is given
    the same arguments, so all raise together)."""
    if storage_options is not None:
        raise ValueError(
            f"shard='fsdp' checkpoints do not take storage_options (got {storage_options!r}): they are written"
            " through torch.distributed.checkpoint to a directory every rank shares"
        )
    if "://" in str(path):
        raise ValueError(
            f"shard='fsdp' checkpoints are written to a directory every rank shares (a shared or local"
            f" filesystem path), not to a remote URL: got {path!r}. Save to a shared mount and copy it"
        )


def check_visible(path: str, comm: Any) -> None:
    """Collective. Every rank must see the completed checkpoint directory; without a filesystem the
    ranks share, rank 0's rename happened on its node only. Raises on every rank, naming those that
    cannot see it."""
    seen = torch.tensor([1 if os.path.exists(os.path.join(path, META)) else 0], dtype=torch.int32)
    every = comm.all_gather(seen, tag="control").reshape(-1).tolist()
    blind = [r for r, ok in enumerate(every) if not ok]
    if blind:
        raise RuntimeError(
            f"the sharded checkpoint {path} is not visible on ranks {blind}: shard='fsdp' checkpoints need a"
            " directory every rank shares (a shared filesystem); each rank writes its shards into it and rank 0"
            " completes it"
        )


def save_strategy(strategy: Any, checkpoint: dict[str, Any], path: str, storage_options: Any | None = None) -> None:
    """Collective. A ``shard="fsdp"`` strategy's checkpoint (Trainer or Fabric): ``checkpoint`` and the
    scheme's state (shared, and this rank's) into the directory ``path``, which every rank must share
    (see :func:`check_destination`, :func:`check_visible`)."""
    check_destination(path, storage_options)
    sharding = strategy.sharding
    with strategy.states.transaction():  # the exchange in flight lands before the state is read
        state = strategy.state_dict()
    save(
        path,
        checkpoint,
        {"strategy": type(strategy).__name__, "state": state, "rank": strategy.states.rank_state()},
        module=strategy.lightning_module,
        comm=strategy.comm,
        group=sharding.group,
        group_size=sharding.mesh.shape[1],
        fragments=periodic_fragments(strategy, state),
        own=own_entries(strategy),
    )
    check_visible(path, strategy.comm)


def own_entries(strategy: Any) -> set[str]:
    """The model's state-dict entries a strategy's rank holds as its own (``params_kept_whole``)."""
    kept = {id(p) for p in strategy.params_kept_whole()}
    return {n for n, p in strategy.lightning_module.named_parameters(remove_duplicate=False) if id(p) in kept}


def load_strategy(strategy: Any, path: str) -> dict[str, Any]:
    """Collective. Read ``path`` for a ``shard="fsdp"`` strategy: returns the checkpoint for Lightning
    to load (model, inner optimizers), and leaves the scheme's state pending on the strategy until
    training starts. Another layout (number of groups, group size) follows its ``resume_mismatch``:
    ``"error"`` raises, ``"reset"`` starts the scheme's state afresh, ``"reshard"`` re-splits it."""
    sharding = strategy.sharding
    checkpoint, scheme, same = load(
        path,
        module=strategy.lightning_module,
        comm=strategy.comm,
        group_size=sharding.mesh.shape[1],
        device=strategy.root_device,
    )
    name = type(strategy).__name__
    if scheme["strategy"] == name and not same:
        saved = f"{scheme['world_size'] // scheme['group_size']} x {scheme['group_size']}"
        problem = (
            f"it was saved by {saved} ranks (groups x shards) and this run is"
            f" {sharding.num_groups} x {sharding.mesh.shape[1]}"
        )
        if strategy.resume_mismatch == "error":
            raise ValueError(
                f"{name} cannot restore its state from the checkpoint: {problem}. Pass {name}(resume_mismatch="
                "'reshard') to re-split it over these ranks, or 'reset' to start that state afresh"
            )
        if strategy.resume_mismatch == "reset":
            log_rank_zero(log, logging.WARNING, "%s: %s; its state starts afresh", name, problem)
            strategy.states.pending = None
            return checkpoint
        scheme["rank"] = strategy.resharded_rank_state(scheme["state"], scheme["rank"], scheme["world_size"])
        log_rank_zero(log, logging.WARNING, "%s: %s; its state was re-split over this run's ranks", name, problem)
    scheme["world_size"] = strategy.world_size  # in this run's layout now
    strategy.states.pending = scheme
    return checkpoint


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
