"""LSTM language model (the RNN LM of the 2018 multi-GPU NLM paper: hidden size 1024)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lightning_commstrats.models.base import LanguageModelBase, check_common, declare, tie


@dataclass
class LSTMConfig:
    vocab_size: int
    embed_dim: int = 256
    hidden_dim: int = 256
    num_layers: int = 1
    dropout: float = 0.0
    tie_weights: bool = False  # needs embed_dim == hidden_dim


class LSTMLM(LanguageModelBase):
    """Embedding -> LSTM -> linear softmax layer; every window starts from a zero state."""

    def __init__(self, config: LSTMConfig) -> None:
        super().__init__()
        check_common(config.vocab_size, config.dropout)
        if config.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {config.num_layers}")
        self.config = config
        self.embedding = declare(nn.Embedding(config.vocab_size, config.embed_dim), "embedding")
        self.drop = nn.Dropout(config.dropout)
        self.lstm = declare(
            nn.LSTM(
                config.embed_dim,
                config.hidden_dim,
                config.num_layers,
                batch_first=True,
                dropout=config.dropout if config.num_layers > 1 else 0.0,
            ),
            "recurrent",
        )
        self.output = declare(nn.Linear(config.hidden_dim, config.vocab_size), "output")
        if config.tie_weights:
            tie(self.output, self.embedding)

    def forward(self, tokens: Tensor) -> Tensor:
        h, _ = self.lstm(self.drop(self.embedding(tokens)))
        return self.output(self.drop(h))
