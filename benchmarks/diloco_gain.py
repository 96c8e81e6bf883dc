"""DiLoCo's outer step against DDP on the recipe's Transformer trained from scratch: the table and plot of
``benchmarks/results/diloco_defaults/`` from the runs ``lm_compare.py`` wrote there.

Every run: ``transformer_small`` (4 blocks of d_model 256, 10k words, 5.75M parameters), 2 ranks, 480
optimizer steps of 32 sequences of 64 words per rank (equal samples for every entry), validation on 40
batches at step 480. The outer step's steady-state gain is ``outer_lr / (1 - outer_momentum)``: how far
it moves the global model per unit of a pseudo-gradient that keeps its direction from sync to sync.

    python benchmarks/diloco_gain.py            # reads the results, writes gain.md and gain.png

The commands that made the runs are in ``benchmarks/results/diloco_defaults/README.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OUT = Path(__file__).resolve().parent / "results" / "diloco_defaults"
PAPER = (0.7, 0.9)  # the outer step of the paper, the package's default until this benchmark


def outer(kwargs: dict) -> tuple[float, float]:
    """The run's outer (lr, momentum); a run without them ran at the default of its time."""
    if "outer_lr" in kwargs or "outer_momentum" in kwargs:
        return kwargs.get("outer_lr", 0.7), kwargs.get("outer_momentum", 0.5)
    return PAPER if kwargs.get("_paper_default") else (0.7, 0.5)


def load(folder: Path, paper_default: bool = False) -> list[dict]:
    runs = json.loads((folder / "results.json").read_text())
    for r in runs:
        if paper_default:
            r["kwargs"]["_paper_default"] = True
    return runs


def main() -> None:
    runs = [r for d in ("d16",) for r in load(OUT / "explore" / d, paper_default=True)]
    runs += [r for d in ("a07m05", "a14m0", "a10m05") for r in load(OUT / "explore" / d)]
    base = next(r for r in load(OUT / "seed0") if r["strategy"] == "allreduce")
    rows = []
    for r in runs:
        lr, m = outer(r["kwargs"])
        rows.append((lr / (1 - m), lr, m, r["val_ppl"]))
    rows.sort()
    lines = [
        f"allreduce (DDP): {base['val_ppl']:.2f} (seed 0)",
        "",
        "| outer lr | outer momentum | gain lr/(1-m) | val ppl | vs allreduce |",
        "|---|---|---|---|---|",
    ]
    for gain, lr, m, ppl in rows:
        lines.append(f"| {lr} | {m} | {gain:.2f} | {ppl:.2f} | {100 * (ppl / base['val_ppl'] - 1):+.1f}% |")
    (OUT / "gain.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([g for g, *_ in rows], [p for *_, p in rows], "o", label="diloco, H 16")
    for gain, lr, m, ppl in rows:
        ax.annotate(f"{lr}/{m}", (gain, ppl), textcoords="offset points", xytext=(6, -3), fontsize=8)
    ax.axhline(base["val_ppl"], color="gray", ls="--", label="allreduce (DDP)")
    ax.axhline(base["val_ppl"] * 1.05, color="gray", ls=":", label="DDP + 5%")
    ax.set_xlabel("outer step's steady-state gain, lr / (1 - momentum)")
    ax.set_ylabel("validation perplexity at step 480")
    ax.set_title("transformer_small, 2 ranks, equal samples, seed 0")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "gain.png", dpi=120)
    print("\n".join(lines))
    after()


def after() -> None:
    """``after.md``: the entries at the new defaults against ``allreduce`` of the same seed, with the
    bytes each rank sent over the whole run (the initial broadcast included) and how many times fewer
    than ``allreduce``'s fp32 gradients."""
    lines = [
        "| seed | strategy | val ppl | vs allreduce | bytes sent per rank over the run | fewer than allreduce |",
        "|---|---|---|---|---|---|",
    ]
    bases = {}
    for folder, seed in (("seed0", 0), ("seed1", 1), ("periods", 0)):
        if not (OUT / folder / "results.json").exists():
            continue
        for r in load(OUT / folder):
            if r["strategy"] == "allreduce":
                bases[seed] = r
            base = bases[seed]
            sent = r["ranks"][0]["bytes_sent"]
            ratio = base["ranks"][0]["bytes_sent"] / sent
            lines.append(
                f"| {seed} | {r['label']} | {r['val_ppl']:.2f} | {100 * (r['val_ppl'] / base['val_ppl'] - 1):+.1f}% |"
                f" {sent / 1e6:,.1f} MB | {ratio:.0f}x |"
            )
    (OUT / "after.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
