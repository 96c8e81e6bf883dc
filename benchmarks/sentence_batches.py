"""Sentence batches: padding and training tokens per second with and without length bucketing.

One process, the LSTM LM of ``lstm_demo.yaml`` (vocabulary 10k, 256 wide), AdamW, batches of 32.
For each way of serving the Brown train split it reports the share of padded positions over the
whole split (exact, every batch of an epoch) and the real (non-padded) tokens per second of
forward + backward + optimizer step over the same number of batches:

- ``stream``: contiguous windows of 35 tokens across sentence boundaries (no padding but the last);
- ``sentences``: one sentence per example (at most 35 predictions; longer ones cut in pieces),
  batches padded to their longest sentence;
- ``sentences, bucketed``: the same examples grouped by length within pools of 50 batches.

    python benchmarks/sentence_batches.py [--batches 60] [--out benchmarks/results/sentences/speed.md]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time
from pathlib import Path

import torch

from lightning_commstrats.data import IGNORE_INDEX, LMDataModule
from lightning_commstrats.data.corpus import padding_fraction
from lightning_commstrats.models.module import build_model, lm_loss

SETTINGS = {
    "stream": {"mode": "stream"},
    "sentences": {"mode": "sentences"},
    "sentences, bucketed": {"mode": "sentences", "bucket_by_length": True},
}


def tokens_per_second(data: LMDataModule, batches: int, warmup: int = 5) -> tuple[float, float]:
    """(real tokens / s, mean batch width) over ``batches`` training batches after ``warmup``."""
    torch.manual_seed(0)
    net = build_model("lstm", data.vocab_size, 256, 256, 1, 0.0, True, 5, 1, 1, 35)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    loader = iter(data.train_dataloader())
    tokens, seconds, widths = 0, 0.0, []
    for i, (x, y) in enumerate(itertools.islice(loader, warmup + batches)):
        start = time.perf_counter()
        loss = lm_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            seconds += time.perf_counter() - start
            tokens += int((y != IGNORE_INDEX).sum())
            widths.append(x.shape[1])
    return tokens / seconds, sum(widths) / len(widths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--out", default="benchmarks/results/sentences/speed.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, kwargs in SETTINGS.items():
        data = LMDataModule(batch_size=32, seq_len=35, max_vocab_size=10000, **kwargs)
        pad = padding_fraction(data.train_dataloader())
        rate, width = tokens_per_second(data, args.batches)
        rows.append((name, pad, width, rate))
        print(f"{name}: padding {100 * pad:.1f}%, mean width {width:.1f}, {rate:,.0f} tokens/s", flush=True)
    base = rows[1][3]
    lines = [
        "# Sentence batches: padding and training speed",
        "",
        f"`python benchmarks/sentence_batches.py --batches {args.batches}` on {platform.machine()}, torch "
        f"{torch.__version__}, 1 thread: LSTM LM of `lstm_demo.yaml`, AdamW, 32 examples a batch, at most 35 "
        f"predictions an example; padding over one whole epoch of the Brown train split, speed over "
        f"{args.batches} batches (after 5 warm-up batches), real tokens only.",
        "",
        "| batches | padded positions | mean batch width | real tokens/s | vs unbucketed sentences |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {100 * p:.1f}% | {w:.1f} | {r:,.0f} | {r / base:.2f}x |" for n, p, w, r in rows]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
