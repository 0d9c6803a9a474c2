"""OLMoE: Llama's layout without biases, an MoE MLP in every layer (``mlp.experts.E.gate_proj``
/ ``up_proj`` / ``down_proj``; ``norm_topk_prob`` either way) and RMSNorm over all heads'
queries and over all keys before RoPE; heads x head size = hidden size; ``clip_qkv`` null."""

from __future__ import annotations

from functools import partial
from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    out = llama_like.dense_or_not(config, FAMILY)
    if not config.qk_layernorm_full_width:
        out.append("not query/key norms over all heads (OLMoE has them)")
    if config.add_bias_linear or config.add_qkv_bias:
        out.append("biases (OLMoE has none)")
    return out


def experts(keys: HFKeys, name: str, layers: int) -> dict[str, Any]:
    """Every layer MoE; intermediate_size is the experts'."""
    out = llama_like.read_experts(keys, ("num_experts",))
    out["moe_router_pre_softmax"] = not keys.flag("norm_topk_prob", False)
    return {**out, "moe_ffn_hidden_size": keys.integer("intermediate_size")}


def _read(keys: HFKeys) -> TransformerConfig:
    return llama_like.read_config(keys, FAMILY, window=llama_like.every_layer_window,
                                  bias=llama_like.refuse_bias, experts=experts)


def write(config: TransformerConfig) -> dict[str, Any]:
    """No head_dim key: OLMoE's query norm spans hidden_size."""
    out = llama_like.without(llama_like.config_json(config, FAMILY), "mlp_bias",
                             "pretraining_tp", "head_dim")
    return {**out, "num_experts": config.num_experts,
            "num_experts_per_tok": config.moe_router_topk,
            "intermediate_size": config.moe_ffn_hidden_size,
            "norm_topk_prob": not config.moe_router_pre_softmax, "clip_qkv": None,
            "router_aux_loss_coef": config.moe_aux_loss_coeff}


weights = partial(llama_like.layout, experts=("mlp", "gate_proj", "up_proj", "down_proj"))

FAMILY = Family(
    model_type="olmoe", name="OLMoE", classes=("OlmoeForCausalLM",), group=llama_like.GROUP,
    read=_read, write=write, weights=weights,
    own=_own, features={"qk_layernorm": True, "qk_layernorm_full_width": True}, experts=True,
    keys={**llama_like.KEYS, "moe_ffn_hidden_size": "intermediate_size"})
