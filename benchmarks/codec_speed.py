"""Encode + decode throughput of the column quantizers on one CPU core, next to ``clone()``.

    python benchmarks/codec_speed.py [--rows 1024 --cols 2048 --repeats 7]

Throughput is input bytes (float32) over the best time of ``repeats`` runs of encode followed by
decode; ``clone()`` of the same buffer is the memory-bandwidth reference measured in the same run.
"""

from __future__ import annotations

import argparse

import torch
from common import best_seconds

from lightning_commstrats.compression import ColumnCodec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024, help="values per column")
    parser.add_argument("--cols", type=int, default=2048, help="columns")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = torch.randn(args.cols, args.rows)
    nbytes = block.numel() * 4
    clone = nbytes / best_seconds(block.clone, args.repeats) / 1e9
    print(f"{args.cols} columns x {args.rows} values ({nbytes / 1e6:.1f} MB fp32), one core, torch {torch.__version__}")
    print("| bits | payload / fp32 | encode+decode GB/s | clone() GB/s | ratio |")
    print("|---|---|---|---|---|")
    for bits in (1, 2, 4, 8, 16):
        codec = ColumnCodec(bits)
        payload, _ = codec.encode(block)

        def round_trip(codec: ColumnCodec = codec) -> None:
            p, _ = codec.encode(block)
            codec.decode(p, args.cols, args.rows)

        speed = nbytes / best_seconds(round_trip, args.repeats) / 1e9
        print(f"| {bits} | 1/{nbytes / payload.numel():.1f} | {speed:.2f} | {clone:.2f} | {speed / clone:.3f} |")


if __name__ == "__main__":
    main()
