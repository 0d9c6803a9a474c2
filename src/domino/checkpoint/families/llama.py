"""Llama (1, 2, 3): the Llama layout as it is, a bias on every linear or on none."""

from __future__ import annotations

from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig


def _own(config: TransformerConfig) -> list[str]:
    return llama_like.plain_obstacles(config, FAMILY)


def _read(keys: HFKeys) -> TransformerConfig:
    return llama_like.read_config(keys, FAMILY, window=llama_like.no_window,
                                   bias=llama_like.mlp_bias_too)


def _write(config: TransformerConfig) -> dict[str, Any]:
    return llama_like.config_json(config, FAMILY)


FAMILY = Family(
    model_type="llama", name="Llama", classes=("LlamaForCausalLM",), group=llama_like.GROUP,
    read=_read, write=_write, weights=llama_like.layout, own=_own, keys=llama_like.KEYS)
