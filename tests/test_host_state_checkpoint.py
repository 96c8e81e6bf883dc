"""A sharded checkpoint writes host-held state from the host and reads it back there, with no trip
through the training device.

``outer_state="host"`` keeps a periodic scheme's global model and outer optimizer state on the host
(pinned on CUDA), and ``residuals="host"`` a rank's error-feedback residuals. ``DTensor.from_local``
moves a local tensor to its mesh's device, so describing that state over the training device's mesh
took it to the GPU on every save and back on every load. Without a GPU here, the training device's
mesh is a mesh over the same rank whose device type says ``"cuda"``, and a spy on ``Tensor.to`` and
``Tensor.cuda`` records every move toward it (and stands in for it, so that the run goes on)."""

import torch
from torch import nn

from lightning_commstrats.sharding import checkpoint as sharded


class _Comm:
    """One rank's communicator, as far as a sharded checkpoint needs it."""

    rank, world_size = 0, 1

    def barrier(self) -> None:
        pass

    def all_gather_object(self, obj):
        return [obj]


def _spy_on_moves(monkeypatch) -> list[tuple]:
    moves: list[tuple] = []
    real_to = torch.Tensor.to

    def target(args, kwargs):
        t = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        return None if t is None else torch.device(t)

    def to(self, *args, **kwargs):
        where = target(args, kwargs)
        if where is not None and where.type != "cpu" and self.device.type == "cpu":
            moves.append((tuple(self.shape), str(where)))
            return self
        return real_to(self, *args, **kwargs)

    def cuda(self, *args, **kwargs):
        moves.append((tuple(self.shape), "cuda"))
        return self

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "cuda", cuda)
    return moves


def test_host_state_is_saved_and_loaded_without_a_trip_through_the_device(one_rank_mesh, tmp_path, monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    device_mesh = DeviceMesh("cpu", one_rank_mesh.mesh, _init_backend=False)
    device_mesh._device_type = "cuda"  # the training device's mesh
    module = nn.Module()
    for name, shape in (("a", (4, 3)), ("b", (5,))):
        shard = torch.empty(shape, device="meta")  # its values live on the (absent) device
        dt = DTensor.from_local(shard, device_mesh=device_mesh, placements=[Shard(0)], run_check=False)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=False))
    weights = torch.arange(17.0).pin_memory() if torch.cuda.is_available() else torch.arange(17.0)
    momentum = torch.linspace(-1, 1, 17)
    residual = torch.randn(3, 4)
    state = {"outer": {"weights": [weights], "optimizer": {"state": {0: {"momentum_buffer": momentum}}}}}

    def fragments(path: tuple) -> list[str] | None:
        outer = path[:3] == ("outer", "weights", 0) or path[:4] == ("outer", "optimizer", "state", 0)
        return ["a", "b"] if outer and path[-1] in (0, "momentum_buffer") else None

    moves = _spy_on_moves(monkeypatch)
    path = str(tmp_path / "ckpt")
    scheme = {"strategy": "DiLoCoStrategy", "state": state, "rank": {"residuals": {"w": residual}}}
    sharded.save(path, {}, scheme, module=module, comm=_Comm(), group=0, group_size=1, fragments=fragments)
    assert not moves, f"saving moved host state to the device: {moves}"

    _, loaded, same = sharded.load(path, module=module, comm=_Comm(), group_size=1, device=torch.device("cuda"))
    assert same
    assert not moves, f"loading moved host state to the device: {moves}"
    got = loaded["state"]["outer"]
    assert torch.equal(got["weights"][0], weights) and got["weights"][0].device.type == "cpu"
    kept = got["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(kept, momentum) and kept.device.type == "cpu"
    res = loaded["rank"]["residuals"]["w"]
    assert torch.equal(res, residual) and res.device.type == "cpu"


def test_a_checkpoints_slow_hop_residuals_come_back_where_the_hop_keeps_them(monkeypatch):
    from types import SimpleNamespace

    from lightning_commstrats.strategies.reducer import Reducer
    from lightning_commstrats.strategies.state import TWO_LEVEL_KEY, StateStore

    loaded: list[dict] = []
    reducer = Reducer(25.0, residuals="host")
    reducer.load_state_dict = loaded.append  # what the hop is handed
    strategy = SimpleNamespace(reducer=reducer, root_device=torch.device("cuda"), world_size=2)
    strategy.wait_for_exchange = lambda: None
    residuals = {"residuals": {"grad:w#1:0": torch.randn(4, 8)}, "residuals2": {}}
    moves = _spy_on_moves(monkeypatch)
    # a checkpoint of another scheme: only the hop's residuals are restored
    StateStore(strategy)._restore({"strategy": "Other", "world_size": 2, "rank": {TWO_LEVEL_KEY: residuals}})
    assert not moves, f"restoring moved host-kept residuals to the device: {moves}"
    assert loaded and loaded[0]["residuals"]["grad:w#1:0"].device.type == "cpu"
