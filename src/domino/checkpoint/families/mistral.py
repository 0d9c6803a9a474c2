"""Mistral: Llama's layout without biases, with a sliding window on every layer (or none)."""

from __future__ import annotations

from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    out = llama_like.dense_or_not(config, FAMILY)
    if config.qk_layernorm:
        out.append("query/key norms (Mistral has none)")
    if config.add_bias_linear or config.add_qkv_bias:
        out.append("biases (Mistral has none)")
    return out


def _read(keys: HFKeys) -> TransformerConfig:
    return llama_like.read_config(keys, FAMILY, window=llama_like.every_layer_window)


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = llama_like.without(llama_like.config_json(config, FAMILY), "attention_bias",
                             "mlp_bias", "pretraining_tp")
    return {**out, "sliding_window": config.window_size}


FAMILY = Family(
    model_type="mistral", name="Mistral", classes=("MistralForCausalLM",),
    group=llama_like.GROUP, read=_read, write=_write, weights=llama_like.layout, own=_own,
    keys=llama_like.KEYS)
