"""Bytes per step of ``sampled_vocab`` against ``allreduce`` as the vocabulary grows.

For each vocabulary size it trains the LM recipe for a few steps with both strategies on the same
data and prints the measured bytes per step and rank (from ``comm_stats``) and their ratio. The
rows sent depend on the minibatch, not on the vocabulary, so the ratio falls as ``V`` grows.

    python benchmarks/vocab_sweep.py --vocab 2000 10000 60000 --alpha 2000 --beta 1000 --steps 10
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import write_results
from lm_compare import REPO, run
from recorded import portable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "lightning_commstrats" / "configs" / "lstm_demo.yaml"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--vocab", type=int, nargs="+", default=[2000, 10000, 60000], help="max_vocab_size values")
    parser.add_argument("--alpha", type=float, default=2000)
    parser.add_argument("--beta", type=float, default=1000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vocab_sweep"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for v in args.vocab:
        extra = [f"--data.max_vocab_size={v}", f"--trainer.max_steps={args.steps}", "--trainer.limit_val_batches=0"]
        alpha = int(args.alpha) if args.alpha >= 1 else args.alpha
        beta = int(args.beta) if args.beta >= 1 else args.beta
        # a vocabulary smaller than alpha + beta is exchanged whole
        alpha, beta = (min(alpha, v), min(beta, v)) if isinstance(alpha, int) else (alpha, beta)
        sv = {"alpha": alpha, "beta": beta}
        sub = argparse.Namespace(config=args.config, devices=args.devices, out=str(Path(args.out) / f"V{v}"))
        ar = run("allreduce", "allreduce", {}, sub, extra)
        sampled = run("sampled_vocab", "sampled_vocab", sv, sub, extra)
        per_step = [
            sum(r["ranks"][0][k] for k in r["ranks"][0] if k.endswith("/bytes_sent") and not k.startswith("setup"))
            / r["ranks"][0]["steps"]
            for r in (ar, sampled)
        ]
        vocab = ar["hparams"]["vocab_size"]
        rows.append(
            {"vocab": vocab, "allreduce": per_step[0], "sampled_vocab": per_step[1], "ratio": per_step[1] / per_step[0]}
        )
    lines = [
        f"alpha={args.alpha}, beta={args.beta}, {args.devices} ranks, {args.steps} steps,"
        f" config `{portable(args.config)}`",
        "",
        "| vocabulary | allreduce MB/step/rank | sampled_vocab MB/step/rank | ratio |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['vocab']} | {r['allreduce'] / 1e6:.2f} | {r['sampled_vocab'] / 1e6:.2f} | {r['ratio']:.3f} |"
        for r in rows
    ]
    write_results(args.out, "\n".join(lines), rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
