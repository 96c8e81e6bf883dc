"""``LanguageModel``: the LightningModule that trains any of the package's LMs.

Cross-entropy on next-token prediction (padding masked), perplexity with ``torchmetrics`` on
validation and test, SGD or Adam(W) with warm-up and a constant, cosine or per-epoch decay schedule.
Gradient clipping is the Trainer's (``gradient_clip_val``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.nn import functional as F
from torchmetrics.text import Perplexity

from lightning_commstrats.comm import Communicator
from lightning_commstrats.data.corpus import IGNORE_INDEX
from lightning_commstrats.models.base import LanguageModelBase
from lightning_commstrats.models.ffn import FFNLM, FFNConfig
from lightning_commstrats.models.lstm import LSTMLM, LSTMConfig
from lightning_commstrats.models.transformer import TransformerConfig, TransformerLM
from lightning_commstrats.moe import update_expert_biases

# Sharded with FSDP2, this model is the root unit; its output (a Linear's, a view) is read only by the
# loss and the metrics, out of place, so FSDP2's warning about in-place ops on a view does not apply
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPLanguageModel\) returned a view tensor")

ARCHS = ("lstm", "ffn", "transformer")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "epoch_decay")


def build_model(
    arch: str,
    vocab_size: int,
    embed_dim: int,
    hidden_dim: int,
    num_layers: int,
    dropout: float,
    tie_weights: bool,
    order: int,
    num_heads: int,
    ffn_dim: int,
    max_seq_len: int,
    moe: dict | None = None,
) -> LanguageModelBase:
    """Build an LM by name; for the Transformer ``hidden_dim`` is ``d_model`` and ``embed_dim`` is unused.

    ``moe`` (``num_experts``, ``moe_every``, ``top_k``, ``capacity_factor``, ``balance``,
    ``expert_dim``, ``shared_expert_dim``, ``router_init_std``, ``bias_update_rate``,
    ``bias_update_rule``) turns the
    Transformer's FFNs into mixture-of-experts layers.
    """
    moe = moe or {}
    if moe.get("num_experts", 0) and arch != "transformer":
        raise ValueError(f"num_experts > 0 needs arch='transformer', got arch={arch!r}")
    if arch == "lstm":
        return LSTMLM(LSTMConfig(vocab_size, embed_dim, hidden_dim, num_layers, dropout, tie_weights))
    if arch == "ffn":
        return FFNLM(FFNConfig(vocab_size, order, embed_dim, hidden_dim, num_layers, dropout, tie_weights))
    if arch == "transformer":
        return TransformerLM(
            TransformerConfig(
                vocab_size, hidden_dim, num_heads, num_layers, ffn_dim, max_seq_len, dropout, tie_weights, **moe
            )
        )
    raise ValueError(f"arch={arch!r} is not supported; choose one of {ARCHS}")


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the positions whose target is not ``IGNORE_INDEX``."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


class LanguageModel(L.LightningModule):
    """Next-token language model training.

    Args:
        arch: ``"lstm"``, ``"ffn"`` (feed-forward n-gram) or ``"transformer"``.
        vocab_size: vocabulary entries (the CLI links it from the DataModule).
        embed_dim: word embedding size (LSTM, FFN).
        hidden_dim: LSTM state size, FFN hidden width, Transformer ``d_model``.
        num_layers: LSTM layers, FFN hidden layers or Transformer blocks.
        dropout: dropout probability.
        tie_weights: share the input embedding and output matrices.
        order: n-gram order of the FFN LM (linked from the DataModule).
        num_heads: attention heads (Transformer).
        ffn_dim: Transformer feed-forward width.
        max_seq_len: Transformer positions (the CLI links it to the DataModule's ``seq_len``).
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: L2 (SGD, Adam) or decoupled (AdamW) weight decay.
        lr_schedule: ``"constant"``, ``"cosine"`` (to 0 over the run) or ``"epoch_decay"``
            (multiply by ``lr_decay`` after every epoch).
        warmup_steps: linear warm-up from 0, in optimizer steps.
        lr_decay: factor per epoch for ``"epoch_decay"``.
        num_experts: > 0 makes the Transformer's FFNs mixtures of this many experts.
        moe_every: every k-th block gets the MoE FFN.
        top_k: experts per token (1: Switch, 2: GShard).
        capacity_factor: expert capacity relative to an even share (``balance="capacity"``).
        balance: ``"aux"`` (dropless, auxiliary loss only), ``"capacity"`` (drop beyond capacity),
            ``"swipe"`` (every expert gets exactly its share, nothing dropped) or ``"bias"``
            (auxiliary-loss-free, DeepSeek-V3: a per-expert bias on the routing scores, updated
            after every optimizer step from the load over all ranks; dropless).
        aux_loss_weight: weight of the load-balancing loss in the training loss (default None:
            0.01, or 0 with ``balance="bias"``, which needs no auxiliary loss).
        expert_dim: hidden width of every routed expert (default None: ``ffn_dim``). With
            ``top_k`` experts per token, ``expert_dim = (ffn_dim - shared_expert_dim) / top_k``
            keeps the active size of the dense FFN (DeepSeekMoE's fine-grained experts).
        shared_expert_dim: hidden width of a shared expert every token goes through, added to the
            routed output (default 0: none).
        router_init_std: standard deviation of the routers' normal initialisation (default 0.02).
        bias_update_rate: ``balance="bias"``: how far every expert's bias moves per optimizer step
            (default None: 1e-3, DeepSeek-V3's, with the ``"sign"`` rule; 1.0, the largest gain, with ``"quantile"``;
            see :class:`~lightning_commstrats.moe.MoELayer`).
        bias_update_rule: ``balance="bias"``: ``"sign"`` (default, DeepSeek-V3's fixed step) or
            ``"quantile"`` (the change that would have balanced the last step's tokens, scored by the
            router after the optimizer step, times an adaptive gain; on the Brown MoE recipe it holds
            max/mean expert load near 1.09 from step 100, where the sign rule needs hundreds of steps
            to undo the router's collapse during the learning-rate warm-up).
    """

    def __init__(
        self,
        arch: str = "lstm",
        vocab_size: int = 10000,
        embed_dim: int = 256,
        hidden_dim: int = 256,
        num_layers: int = 1,
        dropout: float = 0.0,
        tie_weights: bool = False,
        order: int = 5,
        num_heads: int = 4,
        ffn_dim: int = 1024,
        max_seq_len: int = 512,
        optimizer: str = "adam",
        lr: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        lr_decay: float = 0.5,
        num_experts: int = 0,
        moe_every: int = 1,
        top_k: int = 1,
        capacity_factor: float = 1.25,
        balance: str = "aux",
        aux_loss_weight: float | None = None,
        expert_dim: int | None = None,
        shared_expert_dim: int = 0,
        router_init_std: float = 0.02,
        bias_update_rate: float | None = None,
        bias_update_rule: str = "sign",
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not supported; choose one of {OPTIMIZERS}")
        if lr_schedule not in SCHEDULES:
            raise ValueError(f"lr_schedule={lr_schedule!r} is not supported; choose one of {SCHEDULES}")
        if lr <= 0 or warmup_steps < 0 or not 0 < lr_decay <= 1:
            raise ValueError(f"need lr > 0, warmup_steps >= 0, 0 < lr_decay <= 1; got {lr}, {warmup_steps}, {lr_decay}")
        if aux_loss_weight is not None and not 0 <= aux_loss_weight < math.inf:
            raise ValueError(f"aux_loss_weight must be a finite number >= 0 (or None), got {aux_loss_weight!r}")
        self.save_hyperparameters()
        if aux_loss_weight is None:
            aux_loss_weight = 0.0 if balance == "bias" else 0.01
        self.aux_loss_weight = aux_loss_weight
        self.net = build_model(
            arch,
            vocab_size,
            embed_dim,
            hidden_dim,
            num_layers,
            dropout,
            tie_weights,
            order,
            num_heads,
            ffn_dim,
            max_seq_len,
            moe=None
            if not num_experts
            else {
                "num_experts": num_experts,
                "moe_every": moe_every,
                "top_k": top_k,
                "capacity_factor": capacity_factor,
                "balance": balance,
                "expert_dim": expert_dim,
                "shared_expert_dim": shared_expert_dim,
                "router_init_std": router_init_std,
                "bias_update_rate": bias_update_rate,
                "bias_update_rule": bias_update_rule,
            },
        )
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.test_ppl = Perplexity(ignore_index=IGNORE_INDEX)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/ppl", loss.detach().exp())
        if self.hparams.num_experts:
            aux = self.net.aux_loss
            self._log_moe(aux)
            return loss + self.aux_loss_weight * aux
        return loss

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """The step, then the expert biases of bias balancing: once per optimizer step (also with
        gradient accumulation), from the load of the step's forwards summed over all ranks."""
        super().optimizer_step(*args, **kwargs)
        update_expert_biases(self.net, self._sum_over_ranks)

    def _sum_over_ranks(self, counts: Tensor) -> Tensor:
        strategy = self.trainer.strategy
        comm = getattr(strategy, "comm", None)
        if isinstance(comm, Communicator):  # a lightning_commstrats strategy: charged as control traffic
            return comm.all_reduce(counts, "sum", tag="control")
        return strategy.reduce(counts, reduce_op="sum")

    def _log_moe(self, aux: Tensor) -> None:
        """Tokens per expert (summed over MoE layers), balance (max / mean load), dropped slots, aux loss."""
        layers = self.net.moe_layers()
        load = sum(m.routing.load for m in layers).float()
        self.log_dict(
            {
                "moe/aux_loss": aux.detach(),
                "moe/max_load": load.max(),
                "moe/mean_load": load.mean(),
                "moe/balance": load.max() / load.mean(),
                "moe/dropped": float(sum(m.routing.dropped for m in layers)),
            }
        )

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_ppl.update(logits.float(), y)
        self.log("val/loss", lm_loss(logits, y), sync_dist=True)
        self.log("val/ppl", self.val_ppl, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_ppl.update(logits.float(), y)
        self.log("test/loss", lm_loss(logits, y), sync_dist=True)
        self.log("test/ppl", self.test_ppl)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = self.parameters()
        if hp.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        elif hp.optimizer == "adam":
            opt = torch.optim.Adam(params, lr=hp.lr, weight_decay=hp.weight_decay)
        else:
            opt = torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1) if hp.lr_schedule == "cosine" else 0
        steps_per_epoch = self._steps_per_epoch() if hp.lr_schedule == "epoch_decay" else 1

        def factor(step: int) -> float:
            warm = min(1.0, (step + 1) / hp.warmup_steps) if hp.warmup_steps else 1.0
            if hp.lr_schedule == "cosine":
                return warm * 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0)))
            if hp.lr_schedule == "epoch_decay":
                return warm * hp.lr_decay ** (step // steps_per_epoch)
            return warm

        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _steps_per_epoch(self) -> int:
        trainer = self.trainer
        total = trainer.estimated_stepping_batches
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1
        return max(int(total // epochs), 1) if math.isfinite(total) else 1
