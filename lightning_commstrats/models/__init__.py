"""Language models that declare their vocabulary matrices and module roles, and their LightningModule."""

from lightning_commstrats.models.base import ROLES, LanguageModelBase, declare
from lightning_commstrats.models.ffn import FFNLM, FFNConfig
from lightning_commstrats.models.lstm import LSTMLM, LSTMConfig
from lightning_commstrats.models.module import LanguageModel, build_model, lm_loss
from lightning_commstrats.models.transformer import TransformerConfig, TransformerLM

__all__ = [
    "FFNLM",
    "LSTMLM",
    "ROLES",
    "FFNConfig",
    "LSTMConfig",
    "LanguageModel",
    "LanguageModelBase",
    "TransformerConfig",
    "TransformerLM",
    "build_model",
    "declare",
    "lm_loss",
]
