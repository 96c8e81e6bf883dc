"""Forward + backward tokens/s of one MoE layer on the CPU, against the implementations it replaced.

    python benchmarks/moe_layer_speed.py [--rounds 9 --iters 5 --threads 1]

"after" is the package's ``MoELayer`` (experts as torch's grouped GEMM or one padded ``baddbmm``
per weight, SWIPE on full-length masked tensors); "before" is the same layer with the former
``Experts.forward`` (a loop over the experts) and the former ``swipe_assign`` (rounds over the
tokens still waiting, gathered with ``nonzero``), both kept below as references. Each case builds
one layer and one batch of skewed tokens; the two variants run on them in interleaved rounds (the order
alternating), ``iters`` forward + backward passes a round, and the table gives the median over the
rounds of a round's mean. Both variants give the same output (checked). One process, no expert
parallelism: the all-to-alls are not timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
from torch import Tensor
from torch.nn import functional as F

from lightning_commstrats.moe import MoELayer, gating
from lightning_commstrats.moe.layer import Experts, grouped_mm_fits


def former_experts_forward(self: Experts, x: Tensor, counts: list[int]) -> Tensor:
    """``Experts.forward`` before it was batched: one pair of ``addmm`` per expert."""
    outs = []
    for e, chunk in enumerate(x.split(counts)):
        h = F.gelu(torch.addmm(self.b1[e], chunk, self.w1[e]))
        outs.append(torch.addmm(self.b2[e], h, self.w2[e]))
    return torch.cat(outs)


def former_swipe_assign(probs: Tensor) -> Tensor:
    """``swipe_assign`` before it ran without host round trips: each round gathers the waiting tokens."""
    t, e = probs.shape
    share = torch.full((e,), t // e, dtype=torch.long, device=probs.device)
    share[: t % e] += 1
    order = probs.argsort(dim=-1, descending=True)
    assigned = torch.full((t,), -1, dtype=torch.long, device=probs.device)
    room = share.clone()
    for r in range(e):
        waiting = (assigned < 0).nonzero().squeeze(1)
        if waiting.numel() == 0:
            break
        choice = order[waiting, r]
        score = probs[waiting, choice]
        by_score = torch.argsort(score, descending=True, stable=True)
        by_expert = torch.argsort(choice[by_score], stable=True)
        ranked = by_score[by_expert]
        chosen = choice[ranked]
        starts = torch.searchsorted(chosen, torch.arange(e, device=probs.device))
        rank_in_expert = torch.arange(ranked.numel(), device=probs.device) - starts[chosen]
        accept = rank_in_expert < room[chosen]
        assigned[waiting[ranked[accept]]] = chosen[accept]
        room -= torch.bincount(chosen[accept], minlength=e)
    return assigned


@contextmanager
def former() -> Iterator[None]:
    with (
        mock.patch.object(Experts, "forward", former_experts_forward),
        mock.patch.object(gating, "swipe_assign", former_swipe_assign),
    ):
        yield


@contextmanager
def current() -> Iterator[None]:
    yield


@dataclass
class Case:
    name: str
    d: int
    f: int
    experts: int
    top_k: int
    balance: str
    tokens: int = 32 * 35  # one batch of the Brown recipes: 32 sequences of 35 tokens
    autocast: bool = False


CASES = [
    Case("moe_demo: 4 x 512, top-1, aux", 128, 512, 4, 1, "aux"),
    Case("moe_demo: 4 x 512, top-1, swipe", 128, 512, 4, 1, "swipe"),
    Case("moe_shared routed: 16 x 64, top-4, aux", 128, 64, 16, 4, "aux"),
    Case("64 x 32, top-1, aux", 128, 32, 64, 1, "aux"),
    Case("64 x 32, top-1, swipe", 128, 32, 64, 1, "swipe"),
    Case("moe_demo, bf16 autocast", 128, 512, 4, 1, "aux", autocast=True),
    # rows of 510 floats are no multiple of 16 bytes: the padded bmm, as on CUDA
    Case("4 x 510, top-1, aux", 128, 510, 4, 1, "aux"),
    Case("4 x 510, top-1, swipe", 128, 510, 4, 1, "swipe"),
]


def median_seconds(fns: dict[str, Callable[[], object]], rounds: int, iters: int) -> dict[str, float]:
    """Median over ``rounds`` of each function's mean seconds over ``iters`` calls, interleaved."""
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fns[name]()  # warm
            start = time.perf_counter()
            for _ in range(iters):
                fns[name]()
            seconds[name].append((time.perf_counter() - start) / iters)
    return {name: statistics.median(v) for name, v in seconds.items()}


def measure_swipe(tokens: int, experts: int, rounds: int, iters: int) -> dict[str, float]:
    """``swipe_assign`` alone on skewed probabilities, the former against the current."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 0] += 2.0
    probs = logits.softmax(-1)
    assert torch.equal(former_swipe_assign(probs), gating.swipe_assign(probs))
    t = median_seconds(
        {"before": lambda: former_swipe_assign(probs), "after": lambda: gating.swipe_assign(probs)}, rounds, iters
    )
    return {k: tokens / v for k, v in t.items()}


def measure(case: Case, rounds: int, iters: int) -> dict[str, object]:
    torch.manual_seed(0)
    # skewed tokens, as in the routing notebook: words of a 1,000-word vocabulary drawn with Zipf
    # frequencies, each a fixed random embedding, so every occurrence of a frequent word routes the
    # same way; a router with preferences (std 0.3): the loads are uneven, as with real text
    layer = MoELayer(case.d, case.f, case.experts, case.top_k, case.balance, router_init_std=0.3)
    zipf = 1.0 / torch.arange(1, 1001) ** 1.1
    words = torch.multinomial(zipf / zipf.sum(), case.tokens, replacement=True)
    x = torch.randn(1000, case.d)[words].requires_grad_()
    weight = torch.randn(case.tokens, case.d)

    def step() -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast):
            y = layer(x)
        (y.float() * weight).sum().backward()
        return y.detach()

    outputs = {}
    for name, variant in (("before", former), ("after", current)):
        with variant():
            outputs[name] = step()
    tol = {"atol": 2e-2, "rtol": 2e-2} if case.autocast else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(outputs["after"], outputs["before"], **tol)
    load = layer.routing.load.float()

    def under(variant: Callable) -> Callable[[], None]:
        def run() -> None:
            with variant():
                step()

        return run

    seconds = median_seconds({"before": under(former), "after": under(current)}, rounds, iters)
    before, after = seconds["before"], seconds["after"]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast):
        grouped = grouped_mm_fits(x, layer.experts.w1)
    return {
        "case": case.name,
        "balance": (load.max() / load.mean()).item(),
        "experts": "grouped GEMM" if grouped else "padded bmm",
        "before": case.tokens / before,
        "after": case.tokens / after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=5, help="forward + backward passes per round and variant")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds x {args.iters} passes,"
        f" load average at start {load:.2f}"
    )
    print("| case | max/mean load | experts run as | before tokens/s | after tokens/s | after / before |")
    print("|---|---|---|---|---|---|")
    for case in CASES:
        r = measure(case, args.rounds, args.iters)
        print(
            f"| {r['case']} | {r['balance']:.2f} | {r['experts']} | {r['before']:,.0f} | {r['after']:,.0f}"
            f" | {r['after'] / r['before']:.2f} |",
            flush=True,
        )
    print()
    print("| swipe_assign alone | before tokens/s | after tokens/s | after / before |")
    print("|---|---|---|---|")
    for tokens, experts in ((1120, 4), (1120, 64), (8960, 16)):
        r = measure_swipe(tokens, experts, args.rounds, args.iters)
        print(
            f"| {tokens} tokens, {experts} experts | {r['before']:,.0f} | {r['after']:,.0f}"
            f" | {r['after'] / r['before']:.2f} |",
            flush=True,
        )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
