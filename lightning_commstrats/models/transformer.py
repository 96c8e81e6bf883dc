"""Decoder-only Transformer language model (pre-norm, learned positions, causal attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_commstrats.models.base import LanguageModelBase, check_common, declare, tie
from lightning_commstrats.moe.layer import MoELayer


@dataclass
class TransformerConfig:
    vocab_size: int
    d_model: int = 256
    num_heads: int = 4
    num_layers: int = 2
    ffn_dim: int = 1024
    max_seq_len: int = 512
    dropout: float = 0.1
    tie_weights: bool = True
    num_experts: int = 0  # > 0: mixture-of-experts FFNs
    moe_every: int = 1  # every k-th block gets the MoE FFN (k = 2: blocks 2, 4, ...)
    top_k: int = 1
    capacity_factor: float = 1.25
    balance: str = "aux"  # "aux", "capacity", "swipe" or "bias"
    expert_dim: int | None = None  # routed experts' hidden width; None: ffn_dim
    shared_expert_dim: int = 0  # > 0: a shared expert of this width in every MoE layer
    router_init_std: float = 0.02
    bias_update_rate: float | None = None  # balance="bias": the bias's step (None: the rule's default)
    bias_update_rule: str = "sign"  # balance="bias": "sign" or "quantile" (see MoELayer)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, ffn_dim)
        self.down = nn.Linear(ffn_dim, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, c: TransformerConfig, moe: bool = False) -> None:
        super().__init__()
        self.norm1 = declare(nn.LayerNorm(c.d_model), "norm")
        self.attn = declare(CausalSelfAttention(c.d_model, c.num_heads, c.dropout), "attention")
        self.norm2 = declare(nn.LayerNorm(c.d_model), "norm")
        if moe:  # its experts and router declare their own roles
            self.ffn: nn.Module = MoELayer(
                c.d_model,
                c.ffn_dim if c.expert_dim is None else c.expert_dim,
                c.num_experts,
                c.top_k,
                c.balance,
                c.capacity_factor,
                c.shared_expert_dim,
                c.router_init_std,
                c.bias_update_rate,
                c.bias_update_rule,
            )
        else:
            self.ffn = declare(FeedForward(c.d_model, c.ffn_dim, c.dropout), "ffn")
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.ffn(self.norm2(x))


class TransformerLM(LanguageModelBase):
    """Token + position embeddings -> pre-norm blocks (causal attention, GELU FFN) -> norm -> softmax."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        check_common(config.vocab_size, config.dropout)
        if config.d_model % config.num_heads:
            raise ValueError(f"d_model={config.d_model} must be divisible by num_heads={config.num_heads}")
        if config.num_layers < 1 or config.max_seq_len < 1:
            raise ValueError("num_layers and max_seq_len must be >= 1")
        if config.num_experts < 0 or config.moe_every < 1:
            raise ValueError(f"need num_experts >= 0 and moe_every >= 1, got {config.num_experts}, {config.moe_every}")
        if config.expert_dim is not None and config.expert_dim < 1:
            raise ValueError(f"expert_dim must be >= 1 (or None for ffn_dim), got {config.expert_dim}")
        if config.shared_expert_dim < 0:
            raise ValueError(f"shared_expert_dim must be >= 0, got {config.shared_expert_dim}")
        if not config.router_init_std > 0:
            raise ValueError(f"router_init_std must be > 0, got {config.router_init_std}")
        self.config = config
        self.embedding = declare(nn.Embedding(config.vocab_size, config.d_model), "embedding")
        self.position = declare(nn.Embedding(config.max_seq_len, config.d_model), "embedding")
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(config, moe=config.num_experts > 0 and (i + 1) % config.moe_every == 0)
            for i in range(config.num_layers)
        )
        self.norm = declare(nn.LayerNorm(config.d_model), "norm")
        self.output = declare(nn.Linear(config.d_model, config.vocab_size), "output")
        self.apply(_init)
        if config.tie_weights:
            tie(self.output, self.embedding)

    def init_weights(self) -> None:
        """Draw the weights as ``__init__`` does (the hook a model built on the meta device is
        initialised by, shard by shard: see :mod:`lightning_commstrats.sharding.materialize`)."""
        for m in reversed(list(self.modules())):  # norms, experts, routers: inner modules first
            if m is not self and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
        self.apply(_init)

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    @property
    def aux_loss(self) -> Tensor:
        """The MoE layers' load-balancing losses of the last forward, summed (0 for a dense model)."""
        return sum((m.aux_loss for m in self.moe_layers()), torch.zeros(()))

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.config.max_seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.embedding(tokens) + self.position(pos))
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


def _init(m: nn.Module) -> None:  # the experts initialise themselves the same way, routers with their own std
    if getattr(m, "_commstrats_role", None) == "router":
        return
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
