"""VaultGemma (``VaultGemmaForCausalLM``): Gemma 2 without the norms after the sublayers - a
(1 + weight) RMSNorm before attention (``input_layernorm``) and one before the MLP
(``pre_feedforward_layernorm``, ours ``post_attention_layernorm``) - with Gemma 2's query scale
(``query_pre_attn_scalar``), soft-caps (50 and 30 where the file leaves them out) and sliding
layers among full ones (``layer_types``); one RoPE for every layer (:mod:`.gemma`'s shared
pieces)."""

from __future__ import annotations

from typing import Any

from domino.checkpoint.families import gemma, gemma2, llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.families.weights import Link, Same
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

NAME = "VaultGemma"


def _own(config: TransformerConfig) -> list[str]:
    out = []
    if config.sandwich_norms:
        out.append(f"norms after the sublayers as well ({NAME} has them only before)")
    return out + gemma2.one_rope_obstacles(config, NAME)


def _read(keys: HFKeys) -> TransformerConfig:
    return gemma2.read_one_rope(keys, FAMILY)


def _write(config: TransformerConfig) -> dict[str, Any]:
    return {**gemma.config_json(config, FAMILY), **gemma.layers_json(config)}


def _weights(config: TransformerConfig) -> list[Link]:
    """Llama's map with the MLP's norm under VaultGemma's name."""
    return [Same(link.ours, link.theirs.replace(".post_attention_layernorm.",
                                                ".pre_feedforward_layernorm."))
            if isinstance(link, Same) else link for link in llama_like.layout(config)]


FAMILY = Family(
    model_type="vaultgemma", name=NAME, classes=("VaultGemmaForCausalLM",), group=gemma.GROUP,
    read=_read, write=_write, weights=_weights, own=_own, scalars=True, gemma=True,
    keys=gemma.KEYS)
