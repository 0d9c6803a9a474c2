"""FlexOlmo: OLMoE's Mixture of Experts in every layer (its experts, router and
``norm_topk_prob``) under OLMo 2's layer: norms after attention and after the MLP (no input
norm), RMSNorm over all heads' queries and over all keys, the norms scaling in fp32; no
biases, no window."""

from __future__ import annotations

from typing import Any

from domino.checkpoint.families import llama_like, olmo2, olmoe
from domino.checkpoint.families.family import Family
from domino.checkpoint.families.weights import Link
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    out = llama_like.dense_or_not(config, FAMILY)
    if not config.norm_after_sublayer:
        out.append("norms before the sublayers (FlexOlmo has them after)")
    if not config.qk_layernorm_full_width:
        out.append("not query/key norms over all heads (FlexOlmo has them)")
    if config.add_bias_linear or config.add_qkv_bias:
        out.append("biases (FlexOlmo has none)")
    return out


def _read(keys: HFKeys) -> TransformerConfig:
    return llama_like.read_config(keys, FAMILY, window=llama_like.no_window,
                                  bias=olmo2.refuse_attention_bias, experts=olmoe.experts)


def _write(config: TransformerConfig) -> dict[str, Any]:
    """OLMoE's keys (no head_dim: the query norm spans hidden_size) under FlexOlmo's type."""
    return {**olmoe.write(config), "model_type": FAMILY.model_type,
            "architectures": list(FAMILY.classes)}


def _weights(config: TransformerConfig) -> list[Link]:
    return olmo2.norms_after(olmoe.weights(config), config)


FAMILY = Family(
    model_type="flex_olmo", name="FlexOlmo", classes=("FlexOlmoForCausalLM",),
    group=llama_like.GROUP, read=_read, write=_write, weights=_weights, own=_own,
    features={"qk_layernorm": True, "qk_layernorm_full_width": True,
              "norm_after_sublayer": True, "norm_scale_in_fp32": True},
    experts=True, norms_after=True,
    keys={**llama_like.KEYS, "moe_ffn_hidden_size": "intermediate_size"})
