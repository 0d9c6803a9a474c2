"""Rotary position embeddings (RoPE), with partial rotation, position interpolation, Llama 3's
frequency scaling and LongRoPE (:mod:`~domino.transformer.rope_longrope`).

Channels are rotated in halves (``x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``, the
convention of GPT-NeoX and Hugging Face's Llama), so Llama weights map over without permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from domino.transformer.rope_longrope import LongRope, attention_factor


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


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (``rope_type: yarn``, transformers' ``_compute_yarn_parameters``): pair i's
    frequency blends the original (extrapolated) one with it divided by ``factor``
    (interpolated) by a ramp over the pairs that turn between ``beta_fast`` and ``beta_slow``
    times in ``original_max_position_embeddings`` positions (its ends rounded outwards when
    ``truncate``); cos and sin are multiplied by :attr:`scale`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    base: float
    dim: int
    attention_factor: float | None = None

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        def pair(rotations: float) -> float:  # the pair turning that often in the old context
            return (self.dim * math.log(self.original_max_position_embeddings
                                        / (rotations * 2 * math.pi))
                    / (2 * math.log(self.base)))

        low, high = pair(self.beta_fast), pair(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001  # (transformers' guard against a zero-width ramp)
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # the share of the extrapolated frequency
        return inv_freq / self.factor * (1 - keep) + inv_freq * keep

    @property
    def scale(self) -> float:
        """The attention factor: given, else 0.1 ln(factor) + 1 (1 for a factor <= 1)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    @classmethod
    def of(cls, config) -> YarnScaling:
        return cls(config.rope_scaling_factor, config.rope_original_max_position_embeddings,
                   config.rope_yarn_beta_fast, config.rope_yarn_beta_slow,
                   config.rope_yarn_truncate, config.rotary_base,
                   int(config.kv_channels * config.rotary_percent), config.rope_attention_factor)


class RotaryEmbedding(nn.Module):
    """Angles for RoPE. ``forward(position_ids [b, s])`` returns angles [s, b, 1, rot_dim].

    Positions are divided by ``seq_len_interpolation_factor`` when set (position interpolation),
    so a model can run on sequences longer than it was trained on; ``scaling`` rescales the
    frequencies instead (Llama 3). With ``local_base`` (Gemma 3's sliding layers) the angles
    are [s, b, 2, rot_dim]: index 0 these, index 1 those of base ``local_base`` without
    interpolation or scaling (see :func:`layer_angles`). With ``longrope`` (Phi-3's) each
    forward takes one of two frequency sets by its largest position (``group``: see
    :meth:`~domino.transformer.rope_longrope.LongRope.choose`).
    """

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, base: float = 10000.0,
                 seq_len_interpolation_factor: float | None = None,
                 device: torch.device | None = None,
                 scaling: Llama3Scaling | YarnScaling | None = None,
                 local_base: float | None = None, longrope: LongRope | None = None) -> None:
        super().__init__()
        self.dim = int(kv_channels * rotary_percent)
        self.interpolation = seq_len_interpolation_factor
        inv_freq = _inv_freq(base, self.dim)
        self.longrope = longrope  # (the short set is inv_freq, the long one long_inv_freq)
        if longrope is not None:
            inv_freq, long = longrope.inv_freqs(base, self.dim)
            self.register_buffer("long_inv_freq", long.to(device), persistent=False)
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
        elif config.rope_scaling_type == "yarn":
            scaling = YarnScaling.of(config)
        return cls(config.kv_channels, config.rotary_percent, config.rotary_base,
                   config.rotary_seq_len_interpolation_factor, device=device, scaling=scaling,
                   local_base=config.local_rotary_base, longrope=LongRope.of(config))

    def forward(self, position_ids: torch.Tensor, group=None) -> torch.Tensor:
        """``group``: with LongRoPE, the context-parallel group whose ranks hold shards of
        these sequences (see :meth:`LongRope.choose`)."""
        # Angles live where the positions are (the activations' device).
        pos = position_ids.to(torch.float32)
        scaled = pos / self.interpolation if self.interpolation is not None else pos
        inv_freq = self.inv_freq
        if self.longrope is not None:
            inv_freq = self.longrope.choose(position_ids, inv_freq, self.long_inv_freq, group)
        angles = _angles(scaled, inv_freq)
        if self.local_inv_freq is None:
            return angles
        return torch.cat([angles, _angles(pos, self.local_inv_freq)], dim=2)


def cos_sin_scale(config) -> float:
    """What a config's RoPE scaling multiplies cos and sin by (its attention factor; 1 without
    one): the ``scale`` of :func:`apply_rotary`."""
    if config.position_embedding_type == "rope" and config.rope_scaling_type == "longrope":
        return attention_factor(config)
    if config.position_embedding_type == "rope" and config.rope_scaling_type == "yarn":
        return YarnScaling.of(config).scale
    return 1.0


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


def rotary_cos_sin(angles: torch.Tensor, dtype: torch.dtype,
                   scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of angles [s, b, 1, rot_dim] times ``scale`` (in fp32, before rounding to
    ``dtype``, as transformers does: a scaling's attention factor, :func:`cos_sin_scale`)."""
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor, scale: float = 1.0,
                 cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rotate the first ``rot_dim`` channels of x [s, b, heads, d] by angles [s, b, 1, rot_dim]
    (their :func:`rotary_cos_sin` with ``scale``, or ``cos_sin`` when given: computed and
    rounded once for a layer's queries and keys)."""
    rot = angles.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos_sin if cos_sin is not None else rotary_cos_sin(angles, x.dtype, scale)
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat([x_rot, x_pass], dim=-1) if x_pass.shape[-1] else x_rot
