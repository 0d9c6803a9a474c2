"""LongRoPE (``rope_type: longrope``: Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini), as transformers
computes it.

Each rotated channel pair i has two wavelength factors: ``short_factor[i]`` and
``long_factor[i]``; its frequency is ``1 / (factor[i] * base^(2i / rot_dim))``. One set applies
to a whole forward pass: the long one when the pass's largest position + 1 (the longest
sequence it holds, counted from position 0) exceeds ``original_max_position_embeddings``,
else the short one. cos and sin are multiplied by the attention factor whatever the set:
``sqrt(1 + ln(factor) / ln(original_max))`` (1 when the factor is <= 1) unless given.

The choice must be the same on every rank that computes one forward pass: TP and SP ranks see
the same positions, pipeline stages get the same position ids, and context-parallel ranks, each
holding a shard of the sequence, take the largest position over their group
(:meth:`LongRope.choose`). Decoding with a KV cache, transformers' Phi-3 recomputes the cache
once, when the text first grows past ``original_max`` (its keys were rotated with the short
set); :func:`domino.inference.sampling.generate` does the same (:func:`switch_length`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class LongRope:
    """A :class:`~domino.config.TransformerConfig`'s LongRoPE settings."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    @classmethod
    def of(cls, config) -> LongRope | None:
        """The config's LongRoPE, None when its RoPE has none."""
        if config.rope_scaling_type != "longrope":
            return None
        return cls(tuple(config.rope_short_factor), tuple(config.rope_long_factor),
                   config.rope_original_max_position_embeddings, attention_factor(config))

    def inv_freqs(self, base: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(short, long) inverse frequencies [dim / 2], in transformers' order of operations
        (the factor times the base's power, then the reciprocal) so they round alike."""
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        power = float(base) ** shape
        short = 1.0 / (torch.tensor(self.short_factor, dtype=torch.float32) * power)
        long = 1.0 / (torch.tensor(self.long_factor, dtype=torch.float32) * power)
        return short, long

    def choose(self, position_ids: torch.Tensor, short: torch.Tensor, long: torch.Tensor,
               group=None) -> torch.Tensor:
        """The inverse frequencies of a forward over ``position_ids`` [b, s]: ``long`` when its
        largest position + 1 exceeds ``original_max_position_embeddings``. ``group``: the
        context-parallel group whose ranks hold shards of the same sequences (the largest
        position is taken over it). No host sync: the choice stays on the device."""
        longest = position_ids.max().to(torch.int64) + 1
        if group is not None and group.size > 1:
            group.all_reduce(longest, op=dist.ReduceOp.MAX, name="longrope length")
        return torch.where(longest > self.original_max_position_embeddings,
                           long.to(position_ids.device), short.to(position_ids.device))


def attention_factor(config) -> float:
    """What LongRoPE multiplies cos and sin by: ``rope_attention_factor`` when set, else
    sqrt(1 + ln(factor) / ln(original_max)) for a ``rope_scaling_factor`` above 1, else 1
    (transformers' ``_compute_longrope_parameters``)."""
    if config.rope_attention_factor is not None:
        return float(config.rope_attention_factor)
    factor = config.rope_scaling_factor
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(config.rope_original_max_position_embeddings))


def switch_length(model: nn.Module) -> int | None:
    """The text length past which ``model``'s RoPE angles change (LongRoPE's
    ``original_max_position_embeddings``: a KV cache filled within it must be recomputed once
    the text grows past it), None when they never do."""
    for module in model.modules():
        longrope = getattr(module, "longrope", None)
        if isinstance(longrope, LongRope):
            return longrope.original_max_position_embeddings
    return None
