"""Llama (1, 2, 3): the Llama layout as it is, a bias on every linear or on none."""

from __future__ import annotations

from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    out = llama_like.dense_or_not(config, FAMILY)
    if config.qk_layernorm:
        out.append("query/key norms (Llama has none)")
    if config.add_qkv_bias and not config.add_bias_linear:
        out.append("a bias on Q/K/V only (Llama's come with the output's and the MLP's)")
    if config.window_size is not None:
        out.append("sliding-window attention (Llama has none)")
    return out


def _bias(keys: HFKeys, bias: bool, name: str) -> bool:
    if keys.flag("mlp_bias", False) != bias:
        keys.refuse("Llama attention_bias != mlp_bias is not supported: the output "
                    "projection's bias comes with the MLP's here (add_bias_linear)")
    return bias


def _read(keys: HFKeys) -> TransformerConfig:
    return llama_like.read_config(keys, FAMILY, window=llama_like.no_window, bias=_bias)


def _write(config: TransformerConfig) -> dict[str, Any]:
    return llama_like.config_json(config, FAMILY)


FAMILY = Family(
    model_type="llama", name="Llama", classes=("LlamaForCausalLM",), group=llama_like.GROUP,
    read=_read, write=_write, weights=llama_like.layout, own=_own, keys=llama_like.KEYS)
