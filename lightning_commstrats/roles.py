"""Module roles: what a submodule is, declared by the model rather than guessed from its name.

Strategies and precision plugins look roles up (``"expert"``, ``"router"``, ``"attention"``...) with
``LanguageModelBase.module_roles()``; models and layers declare them with :func:`declare`.
"""

from __future__ import annotations

from torch import nn

ROLES = ("embedding", "recurrent", "attention", "ffn", "norm", "output", "router", "expert")


def declare(module: nn.Module, role: str) -> nn.Module:
    """Mark ``module`` as playing ``role``; returns it, so it can wrap a constructor call."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not one of {ROLES}")
    module._commstrats_role = role  # type: ignore[assignment]
    return module
