"""StarCoder2 (``Starcoder2ForCausalLM``): LayerNorm with a bias, a GELU MLP without a gate
(``c_fc`` / ``c_proj``), RoPE, grouped-query attention, a bias on every linear or on none
(``use_bias``), a sliding window on every layer or none. No new math: GPT-2's norm and MLP on
Llama's attention, in the Llama layout."""

from __future__ import annotations

from functools import partial
from typing import Any

from domino.checkpoint.families import common, llama_like
from domino.checkpoint.families.family import Family, Group
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

KEYS = {**{k: v for k, v in llama_like.KEYS.items() if not k.startswith(("moe_", "num_exp"))},
        "layernorm_epsilon": "norm_epsilon", "hidden_dropout": "residual_dropout",
        "add_bias_linear": "use_bias"}


def _obstacles(config: TransformerConfig) -> list[str]:
    out = common.obstacles(config)
    if config.normalization != "LayerNorm":
        out.append(f"{config.normalization} (StarCoder2 has LayerNorm)")
    if config.activation not in common.GELU_TO_HF:
        out.append(f"{config.activation} (StarCoder2 has GELU)")
    out += llama_like.rope_obstacles(config, "StarCoder2")
    if config.add_qkv_bias and not config.add_bias_linear:
        out.append("a bias on Q/K/V only (StarCoder2 has every bias or none)")
    if config.qk_layernorm:
        out.append("query/key norms (StarCoder2 has none)")
    if config.num_experts is not None:
        out.append("Mixture-of-Experts layers (StarCoder2 is dense)")
    return out


def _read(keys: HFKeys) -> TransformerConfig:
    act = keys.text("hidden_act", "gelu_pytorch_tanh")
    if act not in common.GELU_FROM_HF:
        keys.refuse(f"StarCoder2 hidden_act={act!r} is not supported; one of "
                    f"{', '.join(common.GELU_FROM_HF)}")
    rope, theta, extra = llama_like.read_rope(keys, "StarCoder2")
    positions = keys.integer("max_position_embeddings", 4096)
    return keys.build(
        FAMILY.names(rope), num_layers=keys.integer("num_hidden_layers"),
        vocab_size=keys.integer("vocab_size"), ffn_hidden_size=keys.integer("intermediate_size"),
        **llama_like.read_heads(keys), max_position_embeddings=positions,
        seq_length=min(positions, 4096), position_embedding_type="rope", rotary_base=theta,
        normalization="LayerNorm", activation=common.GELU_FROM_HF[act],
        add_bias_linear=keys.flag("use_bias", True),
        window_size=llama_like.every_layer_window(keys, "StarCoder2"),
        layernorm_epsilon=keys.number("norm_epsilon", 1e-5, rule="> 0"),
        hidden_dropout=keys.number("residual_dropout", 0.0, rule="in [0, 1)"),
        attention_dropout=keys.number("attention_dropout", 0.0, rule="in [0, 1)"),
        init_method_std=keys.number("initializer_range", 0.018042, rule="> 0"),
        untie_embeddings_and_output_weights=not keys.flag("tie_word_embeddings", True),
        **extra)


def _write(config: TransformerConfig) -> dict[str, Any]:
    return {
        "model_type": "starcoder2", "architectures": list(FAMILY.classes),
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "hidden_act": common.GELU_TO_HF[config.activation],
        "max_position_embeddings": config.max_position_embeddings,
        "norm_epsilon": config.layernorm_epsilon, "initializer_range": config.init_method_std,
        "use_bias": config.add_bias_linear, "sliding_window": config.window_size,
        "attention_dropout": config.attention_dropout,
        "residual_dropout": config.hidden_dropout, "embedding_dropout": config.hidden_dropout,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        **llama_like.rope_json(config), "torch_dtype": "float32",
    }


FAMILY = Family(
    model_type="starcoder2", name="StarCoder2", classes=("Starcoder2ForCausalLM",),
    group=Group("StarCoder2", "StarCoder2", _obstacles), read=_read, write=_write,
    weights=partial(llama_like.layout, mlp=("c_fc", "c_proj")), keys=KEYS)
