"""Mixture of experts: gates with capacity, SWIPE and bias balancing, and the (expert-parallel) MoE layer."""

from lightning_commstrats.moe.gating import BALANCE_MODES, Routing, capacity, load_balancing_loss, route, swipe_assign
from lightning_commstrats.moe.layer import AllToAll, Experts, MoELayer, update_expert_biases

__all__ = [
    "BALANCE_MODES",
    "AllToAll",
    "Experts",
    "MoELayer",
    "Routing",
    "capacity",
    "load_balancing_loss",
    "route",
    "swipe_assign",
    "update_expert_biases",
]
