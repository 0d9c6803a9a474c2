"""LayerNorm and RMSNorm (replicated on every TP rank), and an RMSNorm over features split
across the TP ranks (OLMoE's query/key norms).

Called on a tensor, a norm normalises it. Called without one, it returns what the norm kernel
reads (:data:`~domino.transformer.kernels.NormArgs`: its weights' compute copies and eps) for a
local piece that fuses the norm with the residual work before it
(:func:`~domino.transformer.kernels.local`). Either way it is a module call, so forward
pre-hooks on the norm still run before its parameters are used (ZeRO's parameter gather waits
there: ``Block.first_module``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from domino.config import TransformerConfig
from domino.precision import compute
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.mappings import sum_over
from domino.tensor_parallel.placement import Placement, place
from domino.transformer.kernels import NormArgs, norm

if TYPE_CHECKING:
    from domino.transformer.spec import LayerArgs


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    @classmethod
    def build(cls, args: LayerArgs) -> RMSNorm:
        """A layer's norm over the hidden size (a part of :mod:`~domino.transformer.spec`)."""
        c = args.config
        return cls(c.hidden_size, c.layernorm_epsilon, c.params_dtype, args.device)

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor | NormArgs:
        args = (compute(self.weight), None, self.eps, True)
        return args if x is None else norm(x, args)


class ShardedRMSNorm(nn.Module):
    """RMSNorm of vectors whose features are split over ``group`` (this rank holds ``size`` of
    them, the weight's matching slice): the squared sums are summed over the group, so each
    rank scales its part by the whole vector's RMS. The weight is sharded along dim 0 over TP
    (its placement: checkpoints reshard it to another TP size)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | None,
                 group: CommGroup) -> None:
        super().__init__()
        self.eps, self.group = eps, group
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        place(self.weight, Placement("tp", 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:  # the whole vector is here: the plain kernel
            return norm(x, (compute(self.weight), None, self.eps, True))
        xf = x.float()
        ms = sum_over(xf.pow(2).sum(-1, keepdim=True), self.group) / (
            x.shape[-1] * self.group.size)
        return (xf * torch.rsqrt(ms + self.eps)).to(x.dtype) * compute(self.weight)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state-dict names) computed with the compute copies
    of its weight and bias (``domino.precision``)."""

    @classmethod
    def build(cls, args: LayerArgs) -> LayerNorm:
        """A layer's norm over the hidden size (a part of :mod:`~domino.transformer.spec`)."""
        c = args.config
        return cls(c.hidden_size, eps=c.layernorm_epsilon, dtype=c.params_dtype,
                   device=args.device)

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor | NormArgs:
        args = (compute(self.weight), compute(self.bias), self.eps, False)
        return args if x is None else norm(x, args)


def build_norm(config: TransformerConfig, device: torch.device | None = None,
               size: int | None = None) -> nn.Module:
    """The norm named by ``config.normalization``, over ``size`` features (default
    ``hidden_size``; a per-head query/key norm's is the head size)."""
    size = config.hidden_size if size is None else size
    if config.normalization == "RMSNorm":
        return RMSNorm(size, config.layernorm_epsilon, config.params_dtype, device)
    return LayerNorm(size, eps=config.layernorm_epsilon, dtype=config.params_dtype,
                     device=device)
