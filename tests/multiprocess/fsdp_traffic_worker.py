"""One rank of the advisor's in-group traffic check (started by ``tests/harness.py`` with ``script=``).

Usage: ``fsdp_traffic_worker.py SPEC_JSON OUT_DIR``. SPEC is ``{"cases": {name: case}}``; a case has
``reshard`` (``null``, ``true`` or ``false``: ``reshard_after_forward``) and ``mixed`` (gather in
bfloat16, reduce in float32 through FSDP2's ``MixedPrecisionPolicy``). Each case shards :class:`Net` (a
tied embedding kept by the root, odd-sized blocks as units: the shards are padded) over all ranks with
the package's :func:`~lightning_commstrats.sharding.policy.apply_fsdp`, runs one forward and backward,
and counts what FSDP2 hands its collectives: every all-gather's and reduce-scatter's input tensor
(numel times element size) through ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` on every
FSDP module. This rank saves ``OUT_DIR/rank<r>.pt``: ``{name: {"all_gather": [bytes, ...],
"reduce_scatter": [bytes, ...]}}`` and ``"shapes"`` (the trainable parameters' shapes in
registration order, tied ones once) and ``"units"`` (the advisor's :func:`~lightning_commstrats.advisor.fsdp_units`
of the model: which tensors each unit gathers). ``blocks.*`` also matches ``blocks.1.0``: units nest,
and a tensor belongs to the innermost.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from rank_env import save_and_leave
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 9)
        self.blocks = nn.ModuleList([nn.Linear(9, 9), nn.Sequential(nn.Linear(9, 7), nn.Linear(7, 9))])
        self.head = nn.Linear(9, 13, bias=False)
        self.head.weight = self.emb.weight  # tied: stays with the root

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def counted(base: type, sizes: list[int]) -> type:
    """``base`` (FSDP2's default all-gather or reduce-scatter) noting its input's bytes in ``sizes``."""

    class Counted(base):
        def __call__(self, output_tensor, input_tensor, *args, **kwargs):
            sizes.append(input_tensor.numel() * input_tensor.element_size())
            return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    return Counted


def main() -> None:
    spec, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from lightning_commstrats.advisor import fsdp_units
    from lightning_commstrats.sharding.policy import ShardPolicy, apply_fsdp

    mesh = init_device_mesh("cpu", (world,))
    results: dict = {}
    for name, case in spec["cases"].items():
        seen: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}

        torch.manual_seed(0)
        model = Net()
        policy = ShardPolicy(units=["blocks.*"], reshard_after_forward=case["reshard"])
        results["shapes"] = [list(p.shape) for p in model.parameters()]
        results["units"] = fsdp_units(model, policy)  # before sharding: the whole shapes
        if case.get("mixed"):  # the package's apply_fsdp takes no policy: shard by hand the same way
            from torch.distributed.fsdp import fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for _, unit in policy.select(model):
                fully_shard(unit, mesh=mesh, reshard_after_forward=case["reshard"], mp_policy=mp)
            fully_shard(model, mesh=mesh, reshard_after_forward=case["reshard"], mp_policy=mp)
        else:
            apply_fsdp(model, mesh, policy)
        for module in model.modules():
            if hasattr(module, "set_custom_all_gather"):
                module.set_custom_all_gather(counted(DefaultAllGather, seen["all_gather"])())
                module.set_custom_reduce_scatter(counted(DefaultReduceScatter, seen["reduce_scatter"])())
        x = torch.randint(13, (2, 5), generator=torch.Generator().manual_seed(rank))
        model(x).float().square().mean().backward()
        results[name] = seen
    save_and_leave(results, out, rank)


if __name__ == "__main__":
    main()
