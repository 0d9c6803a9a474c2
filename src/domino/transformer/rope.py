"""Rotary position embeddings (RoPE), with partial rotation and position interpolation."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Angles for RoPE. ``forward(position_ids [b, s])`` returns angles [s, b, 1, rot_dim].

    Positions are divided by ``seq_len_interpolation_factor`` when set (position interpolation),
    so a model can run on sequences longer than it was trained on.
    """

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, base: int = 10000,
                 seq_len_interpolation_factor: float | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.dim = int(kv_channels * rotary_percent)
        self.interpolation = seq_len_interpolation_factor
        inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.float32,
                                                  device=device) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        # Angles live where the positions are (the activations' device).
        pos = position_ids.to(torch.float32)
        if self.interpolation is not None:
            pos = pos / self.interpolation
        freqs = pos.unsqueeze(-1) * self.inv_freq.to(pos.device)  # [b, s, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [b, s, dim]
        return emb.transpose(0, 1).unsqueeze(2)  # [s, b, 1, dim]


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
