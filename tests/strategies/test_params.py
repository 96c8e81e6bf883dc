"""ParamSet: the parameters by name with their kind, tied parameters once, lookups by the object, and
local tensors that are always the shards (resharded after a forward that left them gathered)."""

import pytest
import torch
from torch import nn

from lightning_commstrats.sharding import ShardPolicy, apply_fsdp, local
from lightning_commstrats.strategies.params import EXPERT, SHARD, WHOLE, ParamSet


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight  # tied: one parameter, two names


def test_names_kinds_and_tied_parameters():
    model = Tied()
    params = ParamSet(model, expert=lambda name, p: name.startswith("experts."))
    assert params.names == ["embed.weight", "experts.0.weight", "experts.0.bias", "experts.1.weight", "experts.1.bias"]
    assert params.kinds["embed.weight"] == WHOLE and params.kinds["experts.1.bias"] == EXPERT
    assert params.name_of(model.out.weight) == "embed.weight"  # the tied one under its first name
    assert params.name_of(model.embed.weight.detach()) is None  # an equal tensor is not the parameter
    assert params["experts.0.weight"] is model.experts[0].weight and len(params) == 5
    assert not params.sharded
    assert set(params.local_tensors((EXPERT,))) == {
        "experts.0.weight",
        "experts.0.bias",
        "experts.1.weight",
        "experts.1.bias",
    }


@pytest.fixture
def mesh(one_rank_mesh):
    return one_rank_mesh


def test_local_tensors_are_the_shards_and_what_is_written_there_is_what_the_next_forward_uses(mesh):
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    apply_fsdp(net, mesh, ShardPolicy(units=[nn.Linear], reshard_after_forward=False))
    params = ParamSet(net)
    assert set(params.kinds.values()) == {SHARD} and params.sharded
    shards = {n: local(params[n]) for n in params}
    x = torch.randn(2, 8)
    with torch.no_grad():
        net(x)  # no backward: FSDP2 leaves every module gathered
    gathered = [n for n, p in net.named_parameters() if not hasattr(p, "device_mesh")]
    assert gathered, "the forward left plain (gathered) tensors registered"
    mine = params.local_tensors()
    for name, shard in shards.items():
        assert mine[name].data_ptr() == shard.data_ptr(), name  # the shard itself, not a gathered copy
    with torch.no_grad():
        for t in mine.values():
            t.zero_()  # as a strategy writes the global model into the shards
        out = net(x)
    # the next forward gathers the shards just written (a module left gathered would use its stale copy)
    torch.testing.assert_close(out, torch.zeros_like(out), atol=0, rtol=0)
