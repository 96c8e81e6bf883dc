"""Feed-forward n-gram language model (Bengio et al., 2003; the 5-gram FFN LM of the 2018 paper)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lightning_commstrats.models.base import LanguageModelBase, check_common, declare, tie


@dataclass
class FFNConfig:
    vocab_size: int
    order: int = 5  # n: n-1 context words
    embed_dim: int = 128
    hidden_dim: int = 512
    num_layers: int = 1
    dropout: float = 0.0
    tie_weights: bool = False  # needs hidden_dim == embed_dim


class FFNLM(LanguageModelBase):
    """Concatenated embeddings of the ``n-1`` previous words -> tanh layers -> softmax over the next word.

    Input ``[batch, n-1]`` context ids; output ``[batch, 1, vocab]`` logits.
    """

    def __init__(self, config: FFNConfig) -> None:
        super().__init__()
        check_common(config.vocab_size, config.dropout)
        if config.order < 2:
            raise ValueError(f"order (n-gram order) must be >= 2, got {config.order}")
        if config.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {config.num_layers}")
        self.config = config
        self.embedding = declare(nn.Embedding(config.vocab_size, config.embed_dim), "embedding")
        layers: list[nn.Module] = []
        width = (config.order - 1) * config.embed_dim
        for _ in range(config.num_layers):
            layers += [nn.Linear(width, config.hidden_dim), nn.Tanh(), nn.Dropout(config.dropout)]
            width = config.hidden_dim
        self.hidden = declare(nn.Sequential(*layers), "ffn")
        self.output = declare(nn.Linear(config.hidden_dim, config.vocab_size), "output")
        if config.tie_weights:
            tie(self.output, self.embedding)

    def forward(self, context: Tensor) -> Tensor:
        if context.shape[-1] != self.config.order - 1:
            raise ValueError(f"expected {self.config.order - 1} context words, got {context.shape[-1]}")
        e = self.embedding(context).flatten(1)
        return self.output(self.hidden(e)).unsqueeze(1)
