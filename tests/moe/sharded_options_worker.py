"""One rank of the expert-parallel test of the MoE layer's options (shared expert, fine-grained
experts, router initialisation): the layer sharded over the ranks against the same layer unsharded
in one process, on every rank's tokens.

Usage: ``sharded_options_worker.py SPEC_JSON OUT_DIR``; SPEC: ``experts``, ``top_k``, ``expert_dim``,
``shared``, ``router_init_std``, ``tokens``, ``d``. All ranks form one expert-parallel group.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

from lightning_commstrats.comm import create_communicator, destroy_process_group
from lightning_commstrats.moe import MoELayer


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    comm = create_communicator(
        "gloo",
        rank=int(os.environ["LOCAL_RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        device=torch.device("cpu"),
        main_address=os.environ["MASTER_ADDR"],
        main_port=int(os.environ["MASTER_PORT"]),
    )
    rank, world = comm.rank, comm.world_size
    d = spec["d"]
    torch.manual_seed(0)
    reference = MoELayer(
        d,
        spec["expert_dim"],
        spec["experts"],
        spec["top_k"],
        shared_dim=spec["shared"],
        router_init_std=spec["router_init_std"],
    )
    sharded = copy.deepcopy(reference)
    sharded.shard(comm)

    def data(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn(2, spec["tokens"] // 2, d, generator=g)
        x[..., 0] += 3 * (r + 1)  # ranks route differently
        return x, torch.randn(2, spec["tokens"] // 2, d, generator=g)

    ref_inputs = []
    total = 0.0
    for r in range(world):
        x, w = data(r)
        x.requires_grad_(True)
        total = total + (reference(x) * w).sum()
        ref_inputs.append(x)
    total.backward()
    x, w = data(rank)
    x.requires_grad_(True)
    y = sharded(x)
    (y * w).sum().backward()
    with torch.no_grad():
        y_ref = reference(data(rank)[0])
    tol = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x.grad, ref_inputs[rank].grad, **tol)
    # dense parameters (router, shared expert): each rank holds its own tokens' share of the gradient
    dense = {n: p for n, p in sharded.named_parameters() if not n.startswith("experts.")}
    ref_params = dict(reference.named_parameters())
    for name, p in dense.items():
        torch.testing.assert_close(comm.all_reduce(p.grad.clone(), "sum"), ref_params[name].grad, **tol)
    # experts: the owner's gradient already holds every rank's tokens
    first, count = sharded.experts.first, sharded.experts.count
    for name in ("w1", "b1", "w2", "b2"):
        torch.testing.assert_close(
            getattr(sharded.experts, name).grad, getattr(reference.experts, name).grad[first : first + count], **tol
        )
    torch.save(
        {"dense": sorted(dense), "first": first, "count": count, "expert_dim": sharded.experts.w1.shape[-1]},
        out / f"rank{rank}.pt",
    )
    comm.barrier()  # leave together: a rank that exits early aborts its peer's gloo threads
    destroy_process_group()


if __name__ == "__main__":
    main()
