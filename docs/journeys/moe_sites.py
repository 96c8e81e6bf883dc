"""Mixture of experts across two sites: experts and FSDP2 inside each site, 4-bit DiLoCo across.

Four CPU ranks (gloo) stand for two sites of two ranks each (``group_size=2``). Each site holds every
expert once, two per rank, and its tokens' all-to-all never leaves the site. FSDP2 shards the dense
part over the same ranks. Every 8 steps DiLoCo sends each rank's experts and dense shard in 4 bits
to the rank at the same place in the other site. ``python moe_sites.py`` runs it.
"""

import sys

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_commstrats import CommStatsMonitor, DiLoCoStrategy
from lightning_commstrats.moe import MoELayer

VOCAB, DIM, SEQ, EXPERTS = 256, 32, 16, 4


class TinyMoE(L.LightningModule):
    """An embedding, two blocks with a mixture-of-experts layer each (top-1) and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        self.moes = nn.ModuleList(MoELayer(DIM, 2 * DIM, EXPERTS) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for norm, moe in zip(self.norms, self.moes, strict=True):
            h = h + moe(norm(h))
        return self.head(h.flatten(0, 1))  # logits of every token: (batch x SEQ, VOCAB)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y.flatten())
        return loss + 0.01 * sum(moe.aux_loss for moe in self.moes)  # the load-balancing loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        x = torch.randint(VOCAB, (512, SEQ), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, (7 * x + 3) % VOCAB), batch_size=8)


if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=DiLoCoStrategy(sync_period=8, pseudo_grad_bits=4, shard="fsdp", group_size=2, expert_parallel=True),
        max_steps=16,
        callbacks=[CommStatsMonitor()],  # the [comm] line: tokens and fsdp_* stay inside the sites
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyMoE()
    trainer.fit(model)
    experts = model.moes[0].experts
    last = experts.first + experts.count - 1
    line = f"rank {trainer.global_rank} holds experts {experts.first}-{last} of {EXPERTS} in each MoE layer"
    sys.stdout.write(line + "\n")  # one write: the four ranks share this terminal
