"""Rotary position embeddings (RoPE), with partial rotation, position interpolation and Llama 3's
frequency scaling.

Channels are rotated in halves (``x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``, the
convention of GPT-NeoX and Hugging Face's Llama), so Llama weights map over without permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3``): wavelengths longer than the
    original context / ``low_freq_factor`` are stretched by ``factor``, those shorter than the
    original context / ``high_freq_factor`` are kept, and the band between is interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old = float(self.original_max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Angles for RoPE. ``forward(position_ids [b, s])`` returns angles [s, b, 1, rot_dim].

    Positions are divided by ``seq_len_interpolation_factor`` when set (position interpolation),
    so a model can run on sequences longer than it was trained on; ``scaling`` rescales the
    frequencies instead (Llama 3). With ``local_base`` (Gemma 3's sliding layers) the angles
    are [s, b, 2, rot_dim]: index 0 these, index 1 those of base ``local_base`` without
    interpolation or scaling (see :func:`layer_angles`).
    """

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, base: float = 10000.0,
                 seq_len_interpolation_factor: float | None = None,
                 device: torch.device | None = None,
                 scaling: Llama3Scaling | None = None,
                 local_base: float | None = None) -> None:
        super().__init__()
        self.dim = int(kv_channels * rotary_percent)
        self.interpolation = seq_len_interpolation_factor
        inv_freq = _inv_freq(base, self.dim)
        if scaling is not None:
            inv_freq = scaling.apply(inv_freq)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.local_inv_freq = None if local_base is None else _inv_freq(local_base, self.dim)

    @classmethod
    def of(cls, config, device: torch.device | None = None) -> RotaryEmbedding:
        """The RoPE a :class:`~domino.config.TransformerConfig` describes."""
        scaling = None
        if config.rope_scaling_type == "llama3":
            scaling = Llama3Scaling(config.rope_scaling_factor, config.rope_low_freq_factor,
                                    config.rope_high_freq_factor,
                                    config.rope_original_max_position_embeddings)
        return cls(config.kv_channels, config.rotary_percent, config.rotary_base,
                   config.rotary_seq_len_interpolation_factor, device=device, scaling=scaling,
                   local_base=config.local_rotary_base)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        # Angles live where the positions are (the activations' device).
        pos = position_ids.to(torch.float32)
        scaled = pos / self.interpolation if self.interpolation is not None else pos
        angles = _angles(scaled, self.inv_freq)
        if self.local_inv_freq is None:
            return angles
        return torch.cat([angles, _angles(pos, self.local_inv_freq)], dim=2)


def _inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (float(base) ** exponents)


def _angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Positions [b, s] -> angles [s, b, 1, dim]."""
    freqs = pos.unsqueeze(-1) * inv_freq.to(pos.device)  # [b, s, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [b, s, dim]
    return emb.transpose(0, 1).unsqueeze(2)  # [s, b, 1, dim]


def layer_angles(angles: torch.Tensor, local: bool) -> torch.Tensor:
    """A layer's angles [s, b, 1, dim] from the model's (:class:`RotaryEmbedding`): the
    sliding layers' (``local``) where the model has two sets, else its only set."""
    if angles.shape[2] == 1:
        return angles
    return angles[:, :, 1:] if local else angles[:, :, :1]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rot_dim`` channels of x [s, b, heads, d] by angles [s, b, 1, rot_dim]."""
    rot = angles.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat([x_rot, x_pass], dim=-1) if x_pass.shape[-1] else x_rot
