"""Mixture of Experts: the router (:mod:`.router`), the experts and the token shuffle around
them (:mod:`.experts`) and the MoE MLP that puts them together (:mod:`.layer`)."""

from domino.transformer.moe.experts import GroupedExperts, permute, unpermute
from domino.transformer.moe.layer import MoEMLP
from domino.transformer.moe.router import RouterStats, TopKRouter, aux_losses, update_expert_bias

__all__ = ["GroupedExperts", "MoEMLP", "RouterStats", "TopKRouter", "aux_losses", "permute",
           "unpermute", "update_expert_bias"]
