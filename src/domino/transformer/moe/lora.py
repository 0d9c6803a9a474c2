"""LoRA adapters on the routed experts' fc1 and fc2 (``--lora-target-modules fc1,fc2`` on a
Mixture-of-Experts model).

Each expert ``e`` of a stacked weight ``W`` [E, in, out] (the grouped GEMM's layout: ``x W``)
gets its own ``A_e`` [in, r] and ``B_e`` [r, out]: ``x W_e + (alpha / r) x A_e B_e``, two
grouped GEMMs over the same sorted rows. Experts are whole on a rank (split over EP by expert,
replicated over TP), so the adapters are split like the weights: by expert over EP, their
gradients reduced over expert-DP with the experts' own; they add no collective. The adapters'
weight gradients are computed in the backward at once (they are small); the frozen experts'
own are not computed at all.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from domino.precision import compute_dtype_of, set_compute_dtype
from domino.tensor_parallel.placement import place, placement_of
from domino.transformer.moe.grouped import grouped_linear


class ExpertLora(nn.Module):
    """The adapters of one :class:`~domino.transformer.moe.experts.GroupedExperts`'s ``fc1``
    and/or ``fc2`` (``which``), for this rank's experts (``ep_rank`` of ``ep_size``)."""

    def __init__(self, experts: nn.Module, which: tuple[str, ...], rank: int, alpha: float,
                 ep_rank: int, ep_size: int) -> None:
        super().__init__()
        self.which, self.rank, self.alpha, self.scale = which, rank, alpha, alpha / rank
        self.dropout = 0.0  # (refused above zero for experts: lora_flags)
        self.ep_rank, self.ep_size = ep_rank, ep_size
        for name in which:
            weight = getattr(experts, name)
            local, fan_in, fan_out = weight.shape
            a = nn.Parameter(torch.zeros(local, fan_in, rank, device=weight.device))
            b = nn.Parameter(torch.zeros(local, rank, fan_out, device=weight.device))
            for p in (a, b):  # by expert over EP, reduced over expert-DP: the weight's
                place(p, placement_of(weight))
            self.register_parameter(f"{name}_a", a)
            self.register_parameter(f"{name}_b", b)
        # The grouped GEMM multiplies in the experts' compute dtype (fp32 masters stay).
        set_compute_dtype(self, compute_dtype_of(getattr(experts, which[0])))

    def extra_repr(self) -> str:
        return f"{','.join(self.which)}, rank={self.rank}, alpha={self.alpha:g}"

    @torch.no_grad()
    def reset(self, generator: torch.Generator) -> None:
        """Every A Kaiming-uniform (PEFT's start, a = sqrt(5): bound 1 / sqrt(in)) drawn for
        all experts and cut to this rank's, every B zero: the same start at any EP size."""
        for name in self.which:
            a = getattr(self, f"{name}_a")
            full = torch.empty(a.shape[0] * self.ep_size, *a.shape[1:])
            full.uniform_(-1.0 / math.sqrt(a.shape[1]), 1.0 / math.sqrt(a.shape[1]),
                          generator=generator)
            a.copy_(full.chunk(self.ep_size)[self.ep_rank])
            getattr(self, f"{name}_b").zero_()

    def delta(self, name: str, x: torch.Tensor, offs: torch.Tensor,
              experts: slice) -> torch.Tensor | None:
        """``scale * x A_e B_e`` for rows ``x`` sorted by expert (None: ``name`` unadapted)."""
        if name not in self.which:
            return None
        down = grouped_linear(x, getattr(self, f"{name}_a"), offs, experts)
        return grouped_linear(down, getattr(self, f"{name}_b"), offs, experts) * self.scale
