"""One rank of the expert-parallel test: an MoE layer sharded over the ranks against the same layer
unsharded in one process, on every rank's tokens.

Usage: ``moe_worker.py SPEC_JSON OUT_DIR``; SPEC: ``dp``, ``ep``, ``inner``, ``experts``, ``top_k``,
``balance``, ``tokens``, ``d``, ``f`` (routed experts' width); optional ``shared`` (shared expert's
width), ``router_init_std``, ``policy`` (a half dtype: both layers then run the layered precision
policy, experts and the all-to-all in that dtype). With ``balance="bias"`` both layers then update
their bias once: the sharded one from the load summed over the ranks, the reference from its own
(it saw every rank's tokens).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from rank_env import connect, finish

from lightning_commstrats.moe import MoELayer, update_expert_biases
from lightning_commstrats.precision import apply_policy, preset_rules, resolve
from lightning_commstrats.strategies.expert_parallel import layout_groups


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    comm = connect("gloo")
    rank, world = comm.rank, comm.world_size
    ep_groups, dp_groups = layout_groups(world, spec["dp"], spec["ep"], spec["inner"])
    ep_comm, dp_comm = comm.new_subgroups(ep_groups), comm.new_subgroups(dp_groups)
    d = spec["d"]
    torch.manual_seed(0)
    reference = MoELayer(
        d,
        spec["f"],
        spec["experts"],
        spec["top_k"],
        spec["balance"],
        capacity_factor=1.0,
        shared_dim=spec.get("shared", 0),
        router_init_std=spec.get("router_init_std", 0.02),
    )
    sharded = copy.deepcopy(reference)
    sharded.shard(ep_comm)
    tol = {"atol": 1e-5, "rtol": 1e-5}
    if spec.get("policy"):
        for layer in (reference, sharded):
            apply_policy(layer, resolve(layer, *preset_rules("layered", spec["policy"])))
        tol = {"atol": 2e-2, "rtol": 2e-2}  # half compute; the same rows meet other rows in the matmuls

    def data(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn(2, spec["tokens"] // 2, d, generator=g)
        x[..., 0] += 3 * (r + 1)  # ranks route differently
        return x, torch.randn(2, spec["tokens"] // 2, d, generator=g)

    # reference: every rank's tokens through the whole layer, losses summed
    ref_inputs = []
    total = 0.0
    for r in range(world):
        x, w = data(r)
        x.requires_grad_(True)
        total = total + (reference(x) * w).sum()
        ref_inputs.append(x)
    total.backward()
    ref_load = reference.load_since_update().clone() if spec["balance"] == "bias" else None  # every rank's tokens
    x, w = data(rank)
    x.requires_grad_(True)
    before = comm.stats.by_tag.get("tokens")
    before = before.bytes_sent if before else 0
    y = sharded(x)
    forward_bytes = comm.stats.by_tag["tokens"].bytes_sent - before
    (y * w).sum().backward()
    backward_bytes = comm.stats.by_tag["tokens"].bytes_sent - before - forward_bytes
    # what the routing sent: rows to other ranks' experts, and the results returned to them
    with torch.no_grad():
        y_ref = reference(data(rank)[0])
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x.grad, ref_inputs[rank].grad, **tol)
    # dense gradients (router, shared expert): summed over all ranks; experts: over each expert's replicas
    dense = {n: p for n, p in sharded.named_parameters() if not n.startswith("experts.")}
    ref_params = dict(reference.named_parameters())
    for name, p in dense.items():
        torch.testing.assert_close(comm.all_reduce(p.grad.clone(), "sum"), ref_params[name].grad, **tol)
    first, count = sharded.experts.first, sharded.experts.count
    for name in ("w1", "b1", "w2", "b2"):
        grad = dp_comm.all_reduce(getattr(sharded.experts, name).grad.clone(), "sum")
        torch.testing.assert_close(grad, getattr(reference.experts, name).grad[first : first + count], **tol)
    bias = None
    if spec["balance"] == "bias":
        update_expert_biases(sharded, lambda load: comm.all_reduce(load, "sum", tag="control"))
        reference.update_bias(ref_load)
        bias = {"sharded": sharded.expert_bias.clone(), "reference": reference.expert_bias.clone()}
    routing = sharded.routing
    per_expert = torch.bincount(routing.experts[routing.kept], minlength=spec["experts"])
    per_rank = per_expert.view(spec["ep"], -1).sum(1)
    me = ep_comm.rank
    torch.save(
        {
            "forward_bytes": forward_bytes,
            "backward_bytes": backward_bytes,
            "sent_rows": int(per_rank.sum() - per_rank[me]),
            "load": routing.load.tolist(),
            "dropped": routing.dropped,
            "element_bytes": torch.empty((), dtype=sharded.dispatch_dtype or torch.float32).element_size(),
            "dense": sorted(dense),
            "expert_dim": sharded.experts.w1.shape[-1],
            "first": first,
            "count": count,
            "bias": bias,
        },
        out / f"rank{rank}.pt",
    )
    finish(comm)


if __name__ == "__main__":
    main()
