"""Qwen2 and Qwen2.5: Llama's layout with a bias on the Q/K/V projections only; a sliding
window on every layer or none (``use_sliding_window``, ``max_window_layers``)."""

from __future__ import annotations

from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    out = llama_like.dense_or_not(config, FAMILY)
    if config.qk_layernorm:
        out.append("query/key norms (Qwen2 has none)")
    if not config.add_qkv_bias or config.add_bias_linear:
        out.append("not a bias on Q/K/V alone (Qwen2 has one there and nowhere else)")
    return out


def _read(keys: HFKeys) -> TransformerConfig:
    return llama_like.read_config(keys, FAMILY, window=llama_like.qwen_window)


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = llama_like.config_json(config, FAMILY)
    out = llama_like.without(out, "mlp_bias", "pretraining_tp", "attention_bias")
    return {**out, **llama_like.qwen_window_json(config)}


FAMILY = Family(
    model_type="qwen2", name="Qwen2", classes=("Qwen2ForCausalLM",), group=llama_like.GROUP,
    read=_read, write=_write, weights=llama_like.layout, own=_own,
    features={"add_qkv_bias": True}, keys=llama_like.KEYS)
