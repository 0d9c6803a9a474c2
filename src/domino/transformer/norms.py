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


def _rms_scale(weight: torch.Tensor, zero_centered: bool, in_fp32: bool) -> torch.Tensor:
    """What an RMSNorm multiplies by: its weight's compute copy, or (zero-centered, Gemma's)
    1 + that copy; in fp32 when ``in_fp32`` or zero-centered (the kernel then scales before
    rounding, as OLMo 2 and Gemma do)."""
    w = compute(weight)
    if zero_centered:
        return w.float() + 1.0
    return w.float() if in_fp32 else w


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32; ``zero_centered``: * (1 + weight),
    the weight starting at 0 (``config.layernorm_zero_centered_gamma``); ``scale_in_fp32``:
    scaled before rounding to x's dtype (``config.norm_scale_in_fp32``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, zero_centered: bool = False,
                 scale_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps, self.zero_centered, self.scale_in_fp32 = eps, zero_centered, scale_in_fp32
        self.weight = nn.Parameter(torch.full((hidden_size,), 0.0 if zero_centered else 1.0,
                                              dtype=dtype, device=device))

    @classmethod
    def build(cls, args: LayerArgs) -> RMSNorm:
        """A layer's norm over the hidden size (a part of :mod:`~domino.transformer.spec`)."""
        c = args.config
        return cls(c.hidden_size, c.layernorm_epsilon, c.params_dtype, args.device,
                   c.layernorm_zero_centered_gamma, c.norm_scale_in_fp32)

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor | NormArgs:
        args = (_rms_scale(self.weight, self.zero_centered, self.scale_in_fp32), None,
                self.eps, True)
        return args if x is None else norm(x, args)


class ShardedRMSNorm(nn.Module):
    """RMSNorm of vectors whose features are split over ``group`` (this rank holds ``size`` of
    them, the weight's matching slice): the squared sums are summed over the group, so each
    rank scales its part by the whole vector's RMS. The weight is sharded along dim 0 over TP
    (its placement: checkpoints reshard it to another TP size)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | None,
                 group: CommGroup, zero_centered: bool = False,
                 scale_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps, self.group, self.zero_centered = eps, group, zero_centered
        self.scale_in_fp32 = scale_in_fp32
        self.weight = nn.Parameter(torch.full((size,), 0.0 if zero_centered else 1.0,
                                              dtype=dtype, device=device))
        place(self.weight, Placement("tp", 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = _rms_scale(self.weight, self.zero_centered, self.scale_in_fp32)
        if self.group.size == 1:  # the whole vector is here: the plain kernel
            return norm(x, (scale, None, self.eps, True))
        xf = x.float()
        ms = sum_over(xf.pow(2).sum(-1, keepdim=True), self.group) / (
            x.shape[-1] * self.group.size)
        out = xf * torch.rsqrt(ms + self.eps)
        if scale.dtype == torch.float32:  # (the kernel's rule: see kernels.norm)
            return (out * scale).to(x.dtype)
        return out.to(x.dtype) * scale


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state-dict names) computed with the compute copies
    of its weight and bias (``domino.precision``); ``zero_centered``: scaled by
    (1 + weight), the weight starting at 0."""

    def __init__(self, *args, zero_centered: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.zero_centered = zero_centered
        if zero_centered:
            with torch.no_grad():
                self.weight.zero_()

    @classmethod
    def build(cls, args: LayerArgs) -> LayerNorm:
        """A layer's norm over the hidden size (a part of :mod:`~domino.transformer.spec`)."""
        c = args.config
        return cls(c.hidden_size, eps=c.layernorm_epsilon, dtype=c.params_dtype,
                   device=args.device, zero_centered=c.layernorm_zero_centered_gamma)

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor | NormArgs:
        weight = compute(self.weight)
        args = (weight + 1.0 if self.zero_centered else weight, compute(self.bias), self.eps,
                False)
        return args if x is None else norm(x, args)


def build_norm(config: TransformerConfig, device: torch.device | None = None,
               size: int | None = None) -> nn.Module:
    """The norm named by ``config.normalization``, over ``size`` features (default
    ``hidden_size``; a per-head query/key norm's is the head size)."""
    size = config.hidden_size if size is None else size
    zero = config.layernorm_zero_centered_gamma
    if config.normalization == "RMSNorm":
        return RMSNorm(size, config.layernorm_epsilon, config.params_dtype, device, zero,
                       config.norm_scale_in_fp32)
    return LayerNorm(size, eps=config.layernorm_epsilon, dtype=config.params_dtype,
                     device=device, zero_centered=zero)
