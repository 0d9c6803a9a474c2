"""OLMo 2: the Llama layout without biases, with its two norms after the sublayers instead of
before them (``h + post_attention_layernorm(attention(h))``,
``h + post_feedforward_layernorm(mlp(h))``; no ``input_layernorm``) and RMSNorm over all
heads' queries and over all keys before RoPE (as OLMoE's); heads x head size = hidden size.
Its RMSNorms scale in fp32 before rounding (``norm_scale_in_fp32``: bf16 runs match)."""

from __future__ import annotations

import dataclasses
from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.families.weights import Link, Same, layer
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    out = llama_like.dense_or_not(config, FAMILY)
    if not config.norm_after_sublayer:
        out.append("norms before the sublayers (OLMo 2 has them after)")
    if not config.qk_layernorm_full_width:
        out.append("not query/key norms over all heads (OLMo 2 has them)")
    if config.add_bias_linear or config.add_qkv_bias:
        out.append("biases (OLMo 2 has none)")
    return out


def refuse_attention_bias(keys: HFKeys, bias: bool, name: str) -> bool:
    """OLMo 2's attention_bias puts biases on Q, K, V and the output only (its MLP has none)."""
    if bias:
        keys.refuse(f"{name} attention_bias=true is not supported: a bias on the attention's "
                    "projections without one on the MLP's is not expressed here; set "
                    "attention_bias to false")
    return False


def _read(keys: HFKeys) -> TransformerConfig:
    config = llama_like.read_config(keys, FAMILY, window=llama_like.no_window,
                                    bias=refuse_attention_bias)
    if "rms_norm_eps" not in keys.raw:  # Olmo2Config's default, not Llama's
        config = dataclasses.replace(config, layernorm_epsilon=1e-5)
    return config


def _write(config: TransformerConfig) -> dict[str, Any]:
    """No head_dim key: OLMo 2's query norm spans hidden_size."""
    return llama_like.without(llama_like.config_json(config, FAMILY), "mlp_bias",
                              "pretraining_tp", "head_dim")


def norms_after(links: list[Link], config: TransformerConfig) -> list[Link]:
    """A Llama-layout map with OLMo 2's norms: ``post_attention_layernorm`` (ours: the
    attention block's, after it) and ``post_feedforward_layernorm`` (the MLP's), no input
    norm (FlexOlmo's too)."""
    out = [link for link in links
           if not (isinstance(link, Same) and ".input_layernorm." in link.ours)]
    return out + [Same(f"{layer(i)}post_feedforward_layernorm.weight",
                       f"model.layers.{i}.post_feedforward_layernorm.weight")
                  for i in range(config.num_layers)]


def _weights(config: TransformerConfig) -> list[Link]:
    return norms_after(llama_like.layout(config), config)


FAMILY = Family(
    model_type="olmo2", name="OLMo 2", classes=("Olmo2ForCausalLM",), group=llama_like.GROUP,
    read=_read, write=_write, weights=_weights, own=_own,
    features={"qk_layernorm": True, "qk_layernorm_full_width": True,
              "norm_after_sublayer": True, "norm_scale_in_fp32": True},
    norms_after=True, keys=llama_like.KEYS)
