"""Two sites, a model built empty: FSDP2 inside each site, 4-bit DiLoCo across the sites.

Four CPU ranks (gloo) stand for two sites of two ranks each (``group_size=2``). Inside a site FSDP2
shards the parameters, gradients and AdamW's state over the site's ranks. Between the sites DiLoCo
sends each rank's own shard of the pseudo-gradient in 4 bits every 8 steps, rank i with rank i. The
model is built on the meta device: no rank ever holds it whole. ``python two_sites.py`` runs it.
"""

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_commstrats import CommStatsMonitor, DiLoCoStrategy
from lightning_commstrats.sharding import local

VOCAB, DIM, SEQ = 256, 64, 16


class TinyLM(L.LightningModule):
    """An embedding, two residual MLP blocks and an output layer: next-token prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h.flatten(0, 1))  # logits of every token: (batch x SEQ, VOCAB)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)  # the inner optimizer, inside each site

    def train_dataloader(self) -> DataLoader:
        x = torch.randint(VOCAB, (512, SEQ), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, (7 * x + 3) % VOCAB), batch_size=8)  # a map to learn


if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,  # on real sites: devices=<GPUs per node>, num_nodes=<nodes>
        strategy=DiLoCoStrategy(sync_period=8, pseudo_grad_bits=4, shard="fsdp", group_size=2),
        max_steps=16,
        callbacks=[CommStatsMonitor()],  # [comm] and [memory] lines at the end of fit
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module(empty_init=True):  # parameters on the meta device: no memory yet
        model = TinyLM()
    trainer.fit(model)  # each rank gives memory to its own shards, then resets them
    held = sum(local(p).numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    if trainer.global_rank == 0:
        print(f"rank 0 holds {held:,} of the model's {whole:,} parameter values")
