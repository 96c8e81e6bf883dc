"""The pseudo-gradient codecs on real DiLoCo pseudo-gradients: error, bytes and time per codec.

    python benchmarks/codec_quality.py [--workers 2 --blocks 6 --sync-period 30] [--out DIR] [--cache FILE]

First it runs DiLoCo in one process to capture real pseudo-gradients: ``--workers`` copies of the
LSTM language model of ``lstm_demo`` (Brown, 10,000 words, 256 units, tied embedding; inner Adam,
lr 0.003, clipping 1.0) each train ``--sync-period`` steps on their own batches from the global
model, then the fp32 average of their pseudo-gradients ``G = w - w_local`` takes one outer Nesterov
step (lr 0.7, momentum 0.9), ``--blocks`` times. Then every codec quantizes the captured matrices
(the tensors the exchange quantizes: 2-D, more than 1024 values; rows as lines, the periodic
schemes' default ``pseudo_grad_scales="rows"``) and the script reports, per codec:

- one encode/decode of a worker's ``G``: the relative L2 error ``|deq - G| / |G|`` (mean over blocks
  and workers; the worst block in brackets), and per tensor;
- error feedback over the blocks, one worker: the error of each round's sent value against that
  round's ``G`` (the residual of the round before is in what is sent), and of the sum of everything
  sent against the sum of the ``G`` (what the outer optimizer integrates; only the last residual is
  missing);
- the exchange's two stages on ``--workers`` ranks with error feedback (stripes of rows, each owner
  re-quantizes the sum, as :class:`~lightning_commstrats.compression.QuantizedAllReduce`): the
  error of the averaged ``G`` per round, against the fp32 average;
- payload bytes per value (codes and scales, from the payloads) and encode + decode time of one
  ``G`` on one CPU thread (best of ``--repeats``).

The captured trajectory is the fp32 one: the errors are those of the codecs on the same inputs,
not of a training run that fed the quantized average back (``lm_compare.py`` does that).
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from common import best_seconds, write_results
from recorded import portable_args

from lightning_commstrats.compression import ColumnCodec, E3M0Codec
from lightning_commstrats.data import LMDataModule
from lightning_commstrats.models import LanguageModel, lm_loss

CODECS = {
    "uniform 4-bit": lambda: ColumnCodec(4),
    "e3m0 4-bit": E3M0Codec,
    "uniform 2-bit": lambda: ColumnCodec(2),
    "uniform 8-bit": lambda: ColumnCodec(8),
}


def capture(args: argparse.Namespace) -> tuple[list[list[dict[str, torch.Tensor]]], float]:
    """``G[k][r]``: worker ``r``'s pseudo-gradient of block ``k`` (the quantized matrices only), and the
    validation loss of the global model at the end."""
    torch.manual_seed(args.seed)
    data = LMDataModule(max_vocab_size=args.vocab, seq_len=35, batch_size=32)
    model = LanguageModel(
        arch="lstm", vocab_size=data.vocab_size, embed_dim=256, hidden_dim=256, tie_weights=True, lr=0.003
    )
    net = model.net
    names = [n for n, p in net.named_parameters() if p.dim() >= 2 and p.numel() > 1024]
    workers = [copy.deepcopy(net) for _ in range(args.workers)]
    inner = [torch.optim.Adam(w.parameters(), lr=0.003) for w in workers]
    outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    batches = endless(data.train_dataloader())
    captured = []
    for block in range(args.blocks):
        start = time.perf_counter()
        grads = []
        for worker, opt in zip(workers, inner, strict=True):
            worker.load_state_dict(net.state_dict())
            for _ in range(args.sync_period):
                x, y = next(batches)  # the workers take turns: each its own batches
                opt.zero_grad()
                lm_loss(worker(x), y).backward()
                torch.nn.utils.clip_grad_norm_(worker.parameters(), 1.0)
                opt.step()
            local = dict(worker.named_parameters())
            grads.append({n: (p.detach() - local[n].detach()) for n, p in net.named_parameters()})
        outer.zero_grad()
        for n, p in net.named_parameters():
            p.grad = sum(g[n] for g in grads) / len(grads)
        outer.step()
        captured.append([{n: g[n] for n in names} for g in grads])
        print(f"block {block + 1}/{args.blocks}: {time.perf_counter() - start:.0f} s", flush=True)
    with torch.no_grad():
        val = iter(data.val_dataloader())
        loss = sum(lm_loss(net(x), y).item() for x, y in (next(val) for _ in range(20))) / 20
    return captured, loss


def endless(loader):
    while True:
        yield from loader


def lines(t: torch.Tensor) -> torch.Tensor:
    """A matrix as the exchange sees it with scales per row: ``[rows, values]``, contiguous float32."""
    return t.reshape(t.shape[0], -1).contiguous().float()


def round_trip(codec, t: torch.Tensor) -> tuple[torch.Tensor, int]:
    block = lines(t)
    payload, deq = codec.encode(block)
    return deq.reshape(t.shape), payload.numel()


def norm(tensors: dict[str, torch.Tensor]) -> float:
    return sum(float(t.double().norm() ** 2) for t in tensors.values()) ** 0.5


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return norm({n: a[n] - b[n] for n in a}) / norm(b)


def two_stage(codec, named: list[dict[str, torch.Tensor]], res1: dict, res2: dict) -> dict[str, torch.Tensor]:
    """One exchange of the ranks' tensors as the package's two stages do it, with error feedback."""
    world = len(named)
    out = {}
    for name, first in named[0].items():
        block0 = lines(first)
        rows, width = block0.shape
        size = -(-rows // world)
        stripes = [(min(k * size, rows), min((k + 1) * size, rows)) for k in range(world)]
        sent = {}
        for j in range(world):
            v = lines(named[j][name]) + res1.get((j, name), 0)
            for k, (a, b) in enumerate(stripes):
                if b > a:
                    payload, deq = codec.encode(v[a:b].contiguous())
                    sent[j, k] = payload
                    v[a:b] -= deq
            res1[j, name] = v
        total = torch.zeros(rows, width)
        for k, (a, b) in enumerate(stripes):
            if b == a:
                continue
            part = sum(codec.decode(sent[j, k], b - a, width) for j in range(world)) + res2.get((k, name), 0)
            payload, deq = codec.encode(part)
            res2[k, name] = part - deq
            total[a:b] = codec.decode(payload, b - a, width)
        out[name] = (total / world).reshape(first.shape)
    return out


def measure(codec_name: str, captured: list[list[dict[str, torch.Tensor]]], repeats: int) -> dict:
    codec = CODECS[codec_name]()
    one_shot, per_tensor = [], {}
    nbytes = nvalues = 0
    for block in captured:
        for g in block:
            deq = {}
            for n, t in g.items():
                deq[n], size = round_trip(codec, t)
                per_tensor.setdefault(n, []).append(float((deq[n] - t).norm() / t.norm()))
                nbytes, nvalues = nbytes + size, nvalues + t.numel()
            one_shot.append(rel(deq, g))
    # error feedback, worker 0 alone
    residual: dict[str, torch.Tensor] = {}
    sent_sum = {n: torch.zeros_like(t) for n, t in captured[0][0].items()}
    true_sum = {n: torch.zeros_like(t) for n, t in captured[0][0].items()}
    ef_rounds = []
    for block in captured:
        g = block[0]
        sent = {}
        for n, t in g.items():
            v = t + residual.get(n, 0)
            sent[n], _ = round_trip(codec, v)
            residual[n] = v - sent[n]
            sent_sum[n] += sent[n]
            true_sum[n] += t
        ef_rounds.append(rel(sent, g))
    # the two stages on every worker, error feedback in both
    res1: dict = {}
    res2: dict = {}
    avg_rounds = []
    for block in captured:
        mean = {n: sum(g[n] for g in block) / len(block) for n in block[0]}
        avg_rounds.append(rel(two_stage(codec, block, res1, res2), mean))

    g = captured[-1][0]

    def encode_decode() -> None:
        for t in g.values():
            block = lines(t)
            payload, _ = codec.encode(block)
            codec.decode(payload, *block.shape)

    seconds = best_seconds(encode_decode, repeats)
    values = sum(t.numel() for t in g.values())
    return {
        "codec": codec_name,
        "one_shot_mean": sum(one_shot) / len(one_shot),
        "one_shot_worst": max(one_shot),
        "per_tensor": {n: sum(v) / len(v) for n, v in per_tensor.items()},
        "ef_round_mean": sum(ef_rounds) / len(ef_rounds),
        "ef_cumulative": rel(sent_sum, true_sum),
        "two_stage_first": avg_rounds[0],
        "two_stage_mean": sum(avg_rounds) / len(avg_rounds),
        "bytes_per_value": nbytes / nvalues,
        "encode_decode_ms": 1e3 * seconds,
        "mb_per_s": values * 4 / seconds / 1e6,
    }


def tables(results: list[dict], names: list[str], shapes: dict[str, list[int]]) -> str:
    out = [
        "| codec | bytes / value | one encode/decode: rel. error, mean (worst) | error feedback, 1 worker:"
        " per round | ... sum over rounds | two stages, all workers, EF: first round | ... mean over rounds"
        " | encode+decode of one G, ms (MB/s fp32) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        out.append(
            f"| {r['codec']} | {r['bytes_per_value']:.4f} | {r['one_shot_mean']:.3f} ({r['one_shot_worst']:.3f}) |"
            f" {r['ef_round_mean']:.3f} | {r['ef_cumulative']:.4f} | {r['two_stage_first']:.3f} |"
            f" {r['two_stage_mean']:.3f} | {r['encode_decode_ms']:.0f} ({r['mb_per_s']:.0f}) |"
        )
    out += ["", "One encode/decode, mean relative error per tensor:", ""]
    out.append("| codec | " + " | ".join(f"{n} {shapes[n]}" for n in names) + " |")
    out.append("|---|" + "---|" * len(names))
    for r in results:
        out.append(f"| {r['codec']} | " + " | ".join(f"{r['per_tensor'][n]:.3f}" for n in names) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=6, help="outer steps (syncs) to capture")
    parser.add_argument("--sync-period", type=int, default=30, help="inner steps per block")
    parser.add_argument("--vocab", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the capture (timings use one)")
    parser.add_argument("--out", default=None, help="folder for results.json and results.md")
    parser.add_argument("--cache", default=None, help="a .pt file: load the captured pseudo-gradients, or save them")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.cache and Path(args.cache).exists():
        captured, val_loss = torch.load(args.cache)
    else:
        captured, val_loss = capture(args)
        if args.cache:
            torch.save((captured, val_loss), args.cache)
    torch.set_num_threads(1)
    names = list(captured[0][0])
    shapes = {n: list(t.shape) for n, t in captured[0][0].items()}
    results = [measure(name, captured, args.repeats) for name in CODECS]
    head = (
        f"{args.workers} workers, {args.blocks} blocks of {args.sync_period} inner steps, LSTM 256 on Brown"
        f" ({args.vocab} words), torch {torch.__version__}, one thread; global model's validation loss after the"
        f" last block {val_loss:.3f} (ppl {torch.tensor(val_loss).exp():.0f}); {time.perf_counter() - start:.0f} s"
    )
    md = head + "\n\n" + tables(results, names, shapes)
    print(md)
    if args.out:
        write_results(args.out, md, {"args": portable_args(args), "results": results})


if __name__ == "__main__":
    main()
