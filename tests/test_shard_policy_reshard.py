"""``ShardPolicy.reshard_after_forward``: its default is FSDP2's own (``None``: units reshard after
forward, the root keeps its parameters gathered for backward, one all-gather a step fewer), and
``True``/``False`` apply to every module, the root included. On a one-rank gloo group in this process."""

import pytest
import torch
from torch import nn

from lightning_commstrats.sharding import ShardPolicy, apply_fsdp


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


@pytest.fixture
def mesh(one_rank_mesh):
    return one_rank_mesh


def _gathered_after_forward(mesh, policy: ShardPolicy) -> tuple[bool, list[bool]]:
    """Whether the root's and each unit's parameters are still gathered after a forward (no backward)."""
    net = Net()
    units = apply_fsdp(net, mesh, policy)
    assert units == ["blocks.1", "blocks.0"]
    net(torch.randn(3, 8))
    state = net._get_fsdp_state()._fsdp_param_group  # FSDP2 has no public accessor for this
    return state.is_unsharded, [b._get_fsdp_state()._fsdp_param_group.is_unsharded for b in net.blocks]


def test_the_default_is_fsdp2s_own_the_root_stays_gathered_for_backward(mesh):
    assert _gathered_after_forward(mesh, ShardPolicy(min_unit_numel=1)) == (True, [False, False])
    assert ShardPolicy().reshard_after_forward is None
    resharded = ShardPolicy(min_unit_numel=1, reshard_after_forward=True)
    assert _gathered_after_forward(mesh, resharded) == (False, [False, False])
    gathered = ShardPolicy(min_unit_numel=1, reshard_after_forward=False)
    assert _gathered_after_forward(mesh, gathered) == (True, [True, True])


def test_reshard_after_forward_takes_none_true_or_false():
    for value in (None, True, False):
        assert ShardPolicy.of({"reshard_after_forward": value}).reshard_after_forward is value
    with pytest.raises(ValueError, match=r"reshard_after_forward must be None, True or False, got 2"):
        ShardPolicy(reshard_after_forward=2)
