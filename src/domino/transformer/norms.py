"""LayerNorm and RMSNorm (replicated on every TP rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from domino.config import TransformerConfig
from domino.precision import compute


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * compute(self.weight)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state-dict names) computed with the compute copies
    of its weight and bias (``domino.precision``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, compute(self.weight), compute(self.bias),
                            self.eps)


def build_norm(config: TransformerConfig, device: torch.device | None = None) -> nn.Module:
    """The norm named by ``config.normalization``."""
    if config.normalization == "RMSNorm":
        return RMSNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype, device)
    return LayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                     dtype=config.params_dtype, device=device)
