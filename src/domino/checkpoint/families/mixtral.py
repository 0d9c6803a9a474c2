"""Mixtral: Mistral's layout and window with an MoE MLP in every layer (softmax top-k,
re-normalised; the Hub's per-expert ``block_sparse_moe.experts.E.w1`` / ``w3`` / ``w2``)."""

from __future__ import annotations

from functools import partial
from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    out = llama_like.dense_or_not(config, FAMILY)
    if config.qk_layernorm:
        out.append("query/key norms (Mixtral has none)")
    if config.add_bias_linear or config.add_qkv_bias:
        # transformers' Mixtral has no bias parameters: it would drop ours on load.
        out.append("biases (Mixtral has none)")
    return out


def _experts(keys: HFKeys, name: str, layers: int) -> dict[str, Any]:
    return llama_like.read_experts(keys, ("num_local_experts",))


def _read(keys: HFKeys) -> TransformerConfig:
    return llama_like.read_config(keys, FAMILY, window=llama_like.every_layer_window,
                                  experts=_experts)


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = llama_like.without(llama_like.config_json(config, FAMILY), "attention_bias",
                             "mlp_bias", "pretraining_tp")
    return {**out, "sliding_window": config.window_size, "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.moe_router_topk,
            "intermediate_size": config.moe_ffn_hidden_size,
            "router_aux_loss_coef": config.moe_aux_loss_coeff}


FAMILY = Family(
    model_type="mixtral", name="Mixtral", classes=("MixtralForCausalLM",),
    group=llama_like.GROUP, read=_read, write=_write,
    weights=partial(llama_like.layout, experts=("block_sparse_moe", "w1", "w3", "w2")),
    own=_own, experts=True,
    keys={**llama_like.KEYS, "num_experts": "num_local_experts",
          "moe_ffn_hidden_size": "intermediate_size"})
