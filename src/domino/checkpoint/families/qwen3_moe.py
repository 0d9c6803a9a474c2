"""Qwen3-MoE: Qwen3's layout and window with MoE MLPs after optional dense first layers
(``mlp_only_layers`` as a prefix; ``norm_topk_prob`` either way)."""

from __future__ import annotations

from functools import partial
from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import FIX_PAIR, HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    out = llama_like.dense_or_not(config, FAMILY)
    if not config.qk_layernorm or config.qk_layernorm_full_width:
        out.append("not query/key norms on each head (Qwen3-MoE has them)")
    if config.add_bias_linear or config.add_qkv_bias:
        out.append("biases (Qwen3-MoE has none)")
    return out


def _experts(keys: HFKeys, name: str, layers: int) -> dict[str, Any]:
    out = llama_like.read_experts(keys, ("num_experts", "num_local_experts"))
    out["moe_router_pre_softmax"] = not keys.flag("norm_topk_prob", False)
    step = keys.integer("decoder_sparse_step", None) or 1
    _, dense = keys.value("mlp_only_layers", None, "a list of layer numbers")
    dense = [] if dense is None else dense
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              and i >= 0 for i in dense):
        keys.wrong("mlp_only_layers", dense, "a list of layer numbers (integers >= 0)")
    if step != 1 or dense != list(range(len(dense))):
        keys.refuse(f"{name} with decoder_sparse_step={step} and mlp_only_layers={dense} is "
                    "not supported: here the dense layers come first (a prefix), then every "
                    "layer is MoE")
    if len(dense) > layers:
        keys.refuse(f'"mlp_only_layers" lists {len(dense)} layers, more than the '
                    f'"num_hidden_layers" ({layers}); {FIX_PAIR}')
    return {**out, "moe_ffn_hidden_size": keys.integer("moe_intermediate_size"),
            "moe_first_k_dense_layers": len(dense)}


def _read(keys: HFKeys) -> TransformerConfig:
    return llama_like.read_config(
        keys, FAMILY, window=llama_like.qwen_window, bias=llama_like.refuse_bias,
        experts=_experts, alternatives={"num_experts": ("num_experts", "num_local_experts")})


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = llama_like.without(llama_like.config_json(config, FAMILY), "mlp_bias",
                             "pretraining_tp")
    return {**out, **llama_like.qwen_window_json(config), "num_experts": config.num_experts,
            "num_experts_per_tok": config.moe_router_topk,
            "moe_intermediate_size": config.moe_ffn_hidden_size,
            "norm_topk_prob": not config.moe_router_pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(config.moe_first_k_dense_layers)),
            "router_aux_loss_coef": config.moe_aux_loss_coeff}


FAMILY = Family(
    model_type="qwen3_moe", name="Qwen3-MoE", classes=("Qwen3MoeForCausalLM",),
    group=llama_like.GROUP, read=_read, write=_write,
    weights=partial(llama_like.layout, experts=("mlp", "gate_proj", "up_proj", "down_proj")),
    own=_own, features={"qk_layernorm": True}, experts=True, keys=llama_like.KEYS)
