"""LitGPT's GPT as a client: built empty, sharded with FSDP2 inside groups, ``diloco`` across them.

    pip install -e ".[litgpt]"                 # LitGPT with the pins that keep `datasets` working
    python recipes/train_litgpt.py                         # pythia-160m, 4 ranks as 2 groups of 2
    python recipes/train_litgpt.py --model pythia-14m --steps 8 --sync-period 4 --bits 4   # 4-bit DiLoCo
    python recipes/train_litgpt.py --model pythia-14m --layout unsharded   # the same, every rank whole
    python recipes/train_litgpt.py --help                  # every option with its default

The LightningModule keeps LitGPT's network as ``self.model = GPT(config)``, built inside
``trainer.init_module(empty_init=True)``: with ``shard="fsdp"`` its parameters go to the meta device as
they are registered (LitGPT's rotary cache, a buffer, is built for real), the strategy shards the
model by its shard policy (every ``Block`` of ``model.transformer.h`` and the token embedding are
units; ``lm_head`` and the final norm stay with the root), gives memory to this rank's shards only, and
then calls the module's ``init_weights()``: LitGPT's own initialisation, the one its pretraining script
applies (``litgpt.pretrain.initialize_weights``: GPT-NeoX's normal initialisation of every ``Linear`` and
``Embedding``, the output projections scaled by depth), on the local shards. The steps call
``self.model(x)``, not the root's ``forward``: the strategy registers them with FSDP2, so the root's
own parameters are gathered around each step. No rank ever holds the whole model.

``--layout unsharded`` builds the model whole on every rank (``init_module(empty_init=True)`` without
sharding would leave the weights uninitialised, as ddp does) and initialises it the same way.

The data are synthetic, so the example needs neither a tokenizer nor a download: sequences that count
upwards by a step of their own through the first 1,024 token ids, each rank its own. The loss falls
from about ln(50,304) = 10.8 as the model learns which ids occur, then the counting.

While it trains, rank 0 draws a progress bar with the loss. At the end it prints the ``[comm]`` summary
(what crossed between the groups first, then everything sent) and the ``[memory]`` lines, then, per
rank: the loss at the first and last step, the kernel's peak resident memory above
the resident set before the build (``VmHWM``, via :class:`~lightning_commstrats.sharding.ProcessMemory`)
while building and sharding, and over the training, beside the whole model's size in fp32. glibc's
mmap threshold is fixed at 128 KiB (:func:`~lightning_commstrats.sharding.fix_mmap_threshold`), so the
peak follows the live tensors.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace
from typing import Any

import lightning as L
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

import lightning_commstrats  # noqa: F401  (registers the strategies)
from lightning_commstrats import CommStatsMonitor
from lightning_commstrats.sharding import ProcessMemory, fix_mmap_threshold, is_dtensor

BITS = (32, 16, 8, 4, 2, 1)  # diloco's pseudo_grad_bits


def _litgpt() -> Any:
    """LitGPT, imported when a model is built (``--help`` works without it), and before the ``build``
    phase begins: its imports are not the model's memory."""
    try:
        import litgpt
        import litgpt.pretrain
    except ImportError as e:
        raise SystemExit(f"this recipe needs LitGPT: pip install -e '.[litgpt]' ({e})") from None
    return litgpt


COUNT_IDS = 1024  # the synthetic sequences count through these token ids


class LitGPTModule(L.LightningModule):
    """LitGPT's ``GPT`` as ``self.model``, trained on next-token prediction with LitGPT's AdamW settings.

    Args:
        model_name: a LitGPT configuration (``litgpt.Config.from_name``), e.g. ``"pythia-160m"``.
        lr: AdamW's learning rate (betas 0.9/0.95 and weight decay 0.1, as LitGPT's pretraining).
        block_size: the longest sequence trained on (LitGPT's rotary cache is built this long).
    """

    def __init__(self, model_name: str = "pythia-160m", lr: float = 1e-3, block_size: int = 64) -> None:
        super().__init__()
        litgpt = _litgpt()
        self.config = litgpt.Config.from_name(model_name, block_size=block_size)
        self.lr = lr
        self.model = litgpt.GPT(self.config)
        self.losses: list[float] = []

    def init_weights(self) -> None:
        """LitGPT's initialisation, as its pretraining script applies it after building the model empty.

        The strategy calls this hook once the local shards have memory (see
        :mod:`lightning_commstrats.sharding.materialize`); on the sharded parameters every draw fills this
        rank's shard only. ``initialize_weights`` reads its ``fabric`` argument for one thing: whether
        Lightning's ``FSDPStrategy`` will reset the parameters itself after materialising; here nothing
        else will, so it resets them now."""
        initialize = _litgpt().pretrain.initialize_weights
        initialize(SimpleNamespace(strategy=None), self.model, self.config.n_layer, self.config.n_embd)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


def counting_batches(rank: int, steps: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of sequences counting upwards (each from its own start, by its own step of 1 to
    4) through the first :data:`COUNT_IDS` token ids; rank ``rank``'s own."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        start = torch.randint(COUNT_IDS, (batch_size, 1), generator=g)
        stride = torch.randint(1, 5, (batch_size, 1), generator=g)
        tokens = (start + stride * torch.arange(seq_len + 1)) % COUNT_IDS
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


class _Phases(L.Callback):
    """Ends the ``build`` phase (the model built, sharded, initialised, its optimizer made) when training
    starts, and opens ``training``."""

    def __init__(self) -> None:
        self.tracker = ProcessMemory()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.tracker.end("build")
        self.tracker.begin("training")


def train(
    model_name: str = "pythia-160m",
    layout: str = "2x2",
    devices: int = 4,
    steps: int = 4,
    sync_period: int = 2,
    batch_size: int = 2,
    seq_len: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    bits: int = 32,
    progress: bool = False,
) -> dict[str, Any]:
    """Train on ``devices`` CPU ranks; what this rank saw.

    Args:
        model_name: a LitGPT configuration name.
        layout: ``"unsharded"``, or ``"GxS"``: ``G`` groups of ``S`` ranks (``shard="fsdp", group_size=S``).
        devices: ranks (gloo on CPU).
        steps: optimizer steps.
        sync_period: ``diloco``'s inner steps between syncs.
        batch_size: sequences per rank and step.
        seq_len: tokens per sequence.
        lr: AdamW's learning rate.
        seed: the seed of the initial weights.
        bits: ``diloco``'s ``pseudo_grad_bits`` (32: fp32; fewer: quantised with error feedback).
        progress: draw Lightning's progress bar (rank 0), and print the ``[comm]`` and ``[memory]``
            summaries at the end.

    Returns:
        ``rank``, ``losses``, ``numel`` (the whole model's parameters), ``sharded`` (every parameter a
        DTensor), ``memory`` (``ProcessMemory.stats()["rss"]``: bytes at the start, the run's peak and the
        ``build`` / ``training`` phases' peaks) and ``digest`` (per parameter, the float64 sum and sum of
        squares of the whole tensor, gathered when sharded: equal on every rank once a sync made them equal).
    """
    if bits not in BITS:
        raise ValueError(f"bits={bits!r} is not one of {BITS}")
    _litgpt()
    if layout == "unsharded":
        shard: dict[str, Any] = {}
    else:
        groups, size = (int(n) for n in layout.split("x"))
        if groups * size != devices:
            raise ValueError(f"layout={layout!r} needs {groups * size} ranks, devices={devices}")
        shard = {"shard": "fsdp", "group_size": size}
    applied, why = fix_mmap_threshold()
    if not applied:
        print(f"glibc's mmap threshold left as it is: {why}")
    torch.set_num_threads(1)
    strategy = L.pytorch.strategies.StrategyRegistry["diloco"]["strategy"](
        sync_period=sync_period,
        sync_period_unit="steps",
        outer_state="host",
        pseudo_grad_bits=bits,
        **shard,
    )
    phases = _Phases()
    callbacks: list[L.Callback] = [phases]
    if progress:
        callbacks.append(CommStatsMonitor())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    L.seed_everything(seed, verbose=False)
    tracker = phases.tracker = ProcessMemory()  # its start: the resident set before the model is built
    tracker.begin("build")
    with trainer.init_module(empty_init=bool(shard)):
        module = LitGPTModule(model_name, lr=lr, block_size=seq_len)
    if not shard:
        module.init_weights()  # built whole: initialise it as LitGPT's pretraining does
    numel = sum(p.numel() for p in module.parameters())
    rank = trainer.global_rank
    batches = counting_batches(rank, steps, batch_size, seq_len)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, shuffle=False))
    tracker.close()
    digest = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            whole = (p.full_tensor() if is_dtensor(p) else p).double()
            digest[name] = (whole.sum().item(), whole.square().sum().item())
    return {
        "rank": rank,
        "losses": module.losses,
        "numel": numel,
        "sharded": all(is_dtensor(p) for p in module.parameters()),
        "memory": tracker.stats()["rss"],
        "digest": digest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", default="pythia-160m", help="a LitGPT configuration (pythia-14m, -70m, -160m...)")
    parser.add_argument("--layout", default="2x2", help='"unsharded", or GxS: G groups of S ranks')
    parser.add_argument("--devices", type=int, default=4, help="CPU ranks (gloo)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--sync-period", type=int, default=2, help="diloco's inner steps between syncs")
    parser.add_argument(
        "--bits", type=int, default=32, choices=BITS, help="bits of diloco's pseudo-gradient across the groups"
    )
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the initial weights")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    r = train(
        args.model,
        args.layout,
        args.devices,
        args.steps,
        args.sync_period,
        args.batch_size,
        args.seq_len,
        args.lr,
        args.seed,
        bits=args.bits,
        progress=True,
    )
    mib, model_bytes = 1 << 20, 4 * r["numel"]
    mem = r["memory"]
    build, training = (mem["phases"][p] - mem["start"] for p in ("build", "training"))
    print(
        f"rank {r['rank']}: {args.model} ({r['numel'] / 1e6:.1f}M parameters, {model_bytes / mib:,.0f} MiB in fp32),"
        f" {args.layout}: loss {r['losses'][0]:.2f} -> {r['losses'][-1]:.2f};"
        f" peak above the start: build {build / mib:,.0f} MiB ({build / model_bytes:.2f}x the model),"
        f" training {training / mib:,.0f} MiB ({training / model_bytes:.2f}x)"
    )


if __name__ == "__main__":
    main()
