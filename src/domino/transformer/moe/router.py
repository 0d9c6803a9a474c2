"""The MoE router: which experts each token goes to, with what weight, and the statistics its
auxiliary losses are computed from.

Scores are computed in fp32 (a router's logits are small differences of large sums). Two scoring
functions:

* ``softmax`` (Mixtral, Qwen-MoE): probabilities over all experts; the top-k weights are
  re-normalised to sum to one when ``renormalize`` (Mixtral, Qwen3-MoE ``norm_topk_prob``), else
  kept as they are (Qwen1.5/2-MoE);
* ``sigmoid`` (DeepSeek-V3): independent scores, the top-k weights re-normalised (with k > 1:
  a single expert keeps its score, as Megatron does), then scaled by ``scaling``. With
  ``expert_bias`` the aux-loss-free balancing bias is added to the scores for the *choice* of
  experts only, never to the weights; it is updated outside autograd from the tokens each expert
  received (:func:`update_expert_bias`).

A ``bias`` (GPT-OSS's router bias) is another thing: a learned parameter added to the logits,
so it shifts the scores, the choice and the weights alike (GPT-OSS's softmax over the top-k
logits is the softmax over all experts re-normalised over the top k).

The auxiliary losses are not computed here but from :class:`RouterStats`, which add up over the
pieces of a micro-batch: the load-balancing loss of a whole micro-batch is a product of two means
over its tokens, so a schedule that splits the micro-batch (Domino) sums the pieces' statistics
first and gets the unsplit loss (:func:`aux_losses`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One piece's routing: each token's ``k`` experts [T, k] (long) and their weights [T, k]
    (fp32, with the gradient path to the router)."""

    experts: torch.Tensor
    weights: torch.Tensor


@dataclass
class RouterStats:
    """What the auxiliary losses need of some tokens, additive over pieces of a micro-batch:
    tokens, each expert's assignments (no gradient), each expert's summed normalised score
    (with gradient) and the summed squared log-partition (with gradient)."""

    tokens: int
    counts: torch.Tensor  # [E] float, (token, slot) assignments per expert
    score_sum: torch.Tensor  # [E] fp32
    z_sum: torch.Tensor  # [] fp32

    def __add__(self, other: RouterStats) -> RouterStats:
        return RouterStats(self.tokens + other.tokens, self.counts + other.counts,
                           self.score_sum + other.score_sum, self.z_sum + other.z_sum)


class TopKRouter(nn.Module):
    """Scores ``num_experts`` experts for each token and keeps the ``topk`` best (see the
    module docstring). ``weight`` [E, h] (and ``bias`` [E], with ``bias=True``) is replicated
    on every rank of a TP group."""

    def __init__(self, hidden_size: int, num_experts: int, topk: int, *,
                 score_function: str = "softmax", renormalize: bool = True,
                 scaling: float = 1.0, expert_bias: bool = False,
                 init_method_std: float = 0.02, params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, force_balance: bool = False,
                 bias: bool = False) -> None:
        super().__init__()
        self.force_balance = force_balance  # benchmarks: random logits, even loads on average
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function={score_function!r} must be one of "
                             f"{', '.join(SCORE_FUNCTIONS)}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk={topk} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.topk = num_experts, topk
        self.score_function, self.renormalize, self.scaling = score_function, renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype,
                                               device=device))
        if not self.weight.is_meta:
            with torch.no_grad():
                self.weight.normal_(0.0, init_method_std)
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=params_dtype, device=device)) \
            if bias else None
        # Aux-loss-free balancing: moved by update_expert_bias, never by gradients; a frozen
        # parameter (not a buffer) so that checkpoints hold it and a resume continues exactly.
        self.expert_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32,
                                                    device=device), requires_grad=False) \
            if expert_bias else None

    def forward(self, x: torch.Tensor) -> tuple[Routing, RouterStats]:
        """x [T, h] -> the routing of its T tokens and their statistics."""
        logits = x.float() @ self.weight.float().t()  # [T, E]
        if self.bias is not None:
            logits = logits + self.bias.float()
        if self.force_balance:
            logits = torch.randn_like(logits)
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
            normalised = scores
        else:
            scores = torch.sigmoid(logits)
            normalised = scores / scores.sum(-1, keepdim=True)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        experts = choice.topk(self.topk, dim=-1).indices  # [T, k]
        weights = scores.gather(-1, experts)
        if self.renormalize if self.score_function == "softmax" else self.topk > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts).float()
        stats = RouterStats(x.shape[0], counts, normalised.sum(0),
                            torch.logsumexp(logits, dim=-1).pow(2).sum())
        return Routing(experts, weights), stats


def aux_losses(stats: RouterStats, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of the tokens ``stats`` cover, unscaled by coefficients.

    Load balancing (Switch / GShard, Megatron's ``aux_loss``): ``E * sum_e f_e * P_e`` with
    ``f_e`` the fraction of the ``T * k`` assignments that went to expert e and ``P_e`` its mean
    normalised score over the T tokens; 1 when perfectly balanced. z-loss (ST-MoE): the mean over
    tokens of ``logsumexp(logits)^2``. Gradients flow through the scores, not the counts."""
    n = max(stats.tokens, 1)
    e = stats.counts.numel()
    balance = e * (stats.counts / (n * topk) * (stats.score_sum / n)).sum()
    return balance, stats.z_sum / n


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's aux-loss-free balancing: each expert's bias moves by ``rate`` towards the
    mean load (up when it received fewer assignments than the mean, down when more), from the
    ``counts`` of a whole step (summed over every rank that routed)."""
    bias.add_(rate * torch.sign(counts.float().mean() - counts.float()))
