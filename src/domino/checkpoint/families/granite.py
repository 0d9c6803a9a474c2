"""Granite (3.x dense): the Llama layout with four scalars: the embeddings multiplied by
``embedding_multiplier``, each sublayer's output by ``residual_multiplier`` before its residual
add, the attention scores by ``attention_multiplier`` (instead of 1/sqrt(head size)) and the
logits divided by ``logits_scaling``; a bias on every linear or on none."""

from __future__ import annotations

import dataclasses
from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

# Our fields -> Granite's keys (the multipliers keep their names but the attention one).
SCALARS = {"embedding_multiplier": "embedding_multiplier",
           "residual_multiplier": "residual_multiplier", "softmax_scale": "attention_multiplier",
           "logits_scaling": "logits_scaling"}


def _own(config: TransformerConfig) -> list[str]:
    return llama_like.plain_obstacles(config, FAMILY)


def _scalar(keys: HFKeys, key: str) -> float:
    """One of the four scalars (transformers' default 1; null is not a number)."""
    value = keys.number(key, 1.0, rule="> 0")
    if value is None:
        keys.wrong(key, value, "a number > 0")
    return value


def _read(keys: HFKeys) -> TransformerConfig:
    config = llama_like.read_config(keys, FAMILY, window=llama_like.no_window,
                                    bias=llama_like.mlp_bias_too)
    return dataclasses.replace(config, **{ours: _scalar(keys, theirs)
                                          for ours, theirs in SCALARS.items()})


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = llama_like.without(llama_like.config_json(config, FAMILY), "pretraining_tp")
    scale = config.softmax_scale
    return {**out, "embedding_multiplier": config.embedding_multiplier,
            "residual_multiplier": config.residual_multiplier,
            "attention_multiplier": config.kv_channels ** -0.5 if scale is None else scale,
            "logits_scaling": config.logits_scaling}


FAMILY = Family(
    model_type="granite", name="Granite", classes=("GraniteForCausalLM",),
    group=llama_like.GROUP, read=_read, write=_write, weights=llama_like.layout, own=_own,
    scalars=True, keys={**llama_like.KEYS, **SCALARS})
