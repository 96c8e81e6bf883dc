"""What every LM in the package declares: its vocabulary matrices and the role of its submodules.

Strategies (``sampled_vocab`` exchanges only rows of the vocabulary matrices) and precision plugins
(``layered`` picks a dtype per role) ask the model instead of guessing from parameter names.
"""

from __future__ import annotations

from torch import nn

from lightning_commstrats.roles import ROLES, declare

__all__ = ["ROLES", "LanguageModelBase", "check_common", "declare", "tie"]


class LanguageModelBase(nn.Module):
    """Base of the package's LMs: token ids in, next-token logits ``[batch, time, vocab]`` out."""

    embedding: nn.Embedding
    output: nn.Linear

    def vocab_parameters(self) -> dict[str, nn.Parameter]:
        """The vocabulary matrices: ``input_embedding`` (``V x E``), ``output_weight`` (``V x H``) and
        ``output_bias`` (``V``). With tied embeddings the first two are the same ``Parameter``."""
        params = {"input_embedding": self.embedding.weight, "output_weight": self.output.weight}
        if self.output.bias is not None:
            params["output_bias"] = self.output.bias
        return params

    def module_roles(self) -> dict[str, list[str]]:
        """Role -> names (as in ``named_modules``) of the submodules declared with that role."""
        roles: dict[str, list[str]] = {}
        for name, module in self.named_modules():
            role = getattr(module, "_commstrats_role", None)
            if role is not None:
                roles.setdefault(role, []).append(name)
        return roles


def declared_vocabulary(module: nn.Module) -> list[nn.Parameter]:
    """The distinct vocabulary matrices that ``module`` (or a submodule) declares with
    ``vocab_parameters()`` (a tied matrix once); empty when none declares any."""
    declared = next((m.vocab_parameters() for m in module.modules() if hasattr(m, "vocab_parameters")), None)
    return list({id(p): p for p in (declared or {}).values()}.values())


def tie(output: nn.Linear, embedding: nn.Embedding) -> None:
    if output.weight.shape != embedding.weight.shape:
        raise ValueError(
            f"tie_weights needs the output layer's input size to equal the embedding size,"
            f" got {output.weight.shape[1]} and {embedding.weight.shape[1]}"
        )
    output.weight = embedding.weight


def check_common(vocab_size: int, dropout: float) -> None:
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
