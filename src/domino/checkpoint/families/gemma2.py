"""Gemma 2 (``Gemma2ForCausalLM``): Gemma's pieces (:mod:`.gemma`) with a (1 + weight) RMSNorm
before and after each sublayer (``input_layernorm`` / ``post_attention_layernorm`` around
attention, ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP:
``sandwich_norms``), attention scores scaled by ``query_pre_attn_scalar`` ** -0.5 and
soft-capped (``attn_logit_softcapping``, 50 where the file leaves it out), the logits
soft-capped (``final_logit_softcapping``, 30), and layers sliding a window of
``sliding_window`` keys among full-attention ones (``layer_types``; without it every other
layer from the first slides: ``full_attention_layers``); one RoPE for every layer."""

from __future__ import annotations

from typing import Any

from domino.checkpoint.families import gemma, llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

NAME = "Gemma 2"


def one_rope_obstacles(config: TransformerConfig, name: str) -> list[str]:
    """What Gemma 2 and VaultGemma (``name``) both lack: query/key norms, a RoPE of the
    sliding layers' own, a softmax scale that is not 1/sqrt of an integer."""
    out = []
    if config.qk_layernorm:
        out.append(f"query/key norms ({name} has none)")
    if config.local_rotary_base is not None:
        out.append(f"a RoPE base of {config.local_rotary_base} on the sliding-window layers "
                   f"({name}'s layers share one RoPE)")
    return out + gemma.scale_obstacles(config, name)


def _own(config: TransformerConfig) -> list[str]:
    out = []
    if not config.sandwich_norms:
        out.append(f"norms only before the sublayers ({NAME} has them before and after)")
    return out + one_rope_obstacles(config, NAME)


def read_one_rope(keys: HFKeys, family: Family, **fields: Any) -> TransformerConfig:
    """A Gemma 2-like config.json (Gemma 2's, VaultGemma's: ``family``): one RoPE, its query
    scale, soft-caps (50 and 30 where the file leaves them out), sliding layers among full
    ones (every other one from the first where layer_types is left out); plus ``fields``."""
    base = gemma.read_base(keys, family.name, "hidden_activation", 8192)
    gemma.one_rope(keys, family.name)
    rope, theta, extra = llama_like.read_rope(keys, family.name)
    window, full = gemma.read_layers(keys, family.name, base["num_layers"], 2)
    return keys.build(family.names(rope), **base, rotary_base=theta, **extra,
                      **gemma.read_scores(keys, base["kv_channels"], (50.0, 30.0)),
                      window_size=window, full_attention_layers=full, **fields)


def _read(keys: HFKeys) -> TransformerConfig:
    return read_one_rope(keys, FAMILY, sandwich_norms=True)


def _write(config: TransformerConfig) -> dict[str, Any]:
    return {**gemma.config_json(config, FAMILY), **gemma.layers_json(config)}


FAMILY = Family(
    model_type="gemma2", name=NAME, classes=("Gemma2ForCausalLM",), group=gemma.GROUP,
    read=_read, write=_write, weights=gemma.sandwich_layout, own=_own, scalars=True,
    gemma=True, keys=gemma.KEYS)
