"""Qwen3: Llama's layout without biases, with RMSNorm on each head's queries and keys before
RoPE (``q_norm`` / ``k_norm``); a sliding window on every layer or none, as Qwen2's."""

from __future__ import annotations

from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    out = llama_like.dense_or_not(config, FAMILY)
    if not config.qk_layernorm or config.qk_layernorm_full_width:
        out.append("not query/key norms on each head (Qwen3 has them)")
    if config.add_bias_linear or config.add_qkv_bias:
        out.append("biases (Qwen3 has none)")
    return out


def _read(keys: HFKeys) -> TransformerConfig:
    return llama_like.read_config(keys, FAMILY, window=llama_like.qwen_window,
                                  bias=llama_like.refuse_bias)


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = llama_like.without(llama_like.config_json(config, FAMILY), "mlp_bias",
                             "pretraining_tp")
    return {**out, **llama_like.qwen_window_json(config)}


FAMILY = Family(
    model_type="qwen3", name="Qwen3", classes=("Qwen3ForCausalLM",), group=llama_like.GROUP,
    read=_read, write=_write, weights=llama_like.layout, own=_own,
    features={"qk_layernorm": True}, keys=llama_like.KEYS)
