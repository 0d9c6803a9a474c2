"""GPT-2 (``GPT2LMHeadModel``): LayerNorm, GELU or its tanh approximation, learned positions,
a bias on every linear, one key/value head per query head; the QKV projection fused in one
``Conv1D`` (stored [in, out]); tied or untied output."""

from __future__ import annotations

import json
from typing import Any

from domino.checkpoint.families import common
from domino.checkpoint.families.family import Family, Group
from domino.checkpoint.families.weights import (
    FINAL_NORM,
    POSITIONS,
    FusedQKV,
    Heads,
    Link,
    Same,
    layer,
)
from domino.checkpoint.hf_keys import FIX_PAIR, HFKeys
from domino.config import TransformerConfig

KEYS = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
        "num_query_groups": "n_head", "kv_channels": "n_embd / n_head",
        "ffn_hidden_size": "n_inner", "max_position_embeddings": "n_positions",
        "seq_length": "n_positions", "layernorm_epsilon": "layer_norm_epsilon",
        "hidden_dropout": "resid_pdrop", "attention_dropout": "attn_pdrop",
        "init_method_std": "initializer_range"}


def _obstacles(config: TransformerConfig) -> list[str]:
    return common.obstacles(config) + _math(config) + _attention(config)


def _math(config: TransformerConfig) -> list[str]:
    """Norm, activation, positions and biases unlike GPT-2's."""
    out = []
    if config.normalization != "LayerNorm":
        out.append(f"{config.normalization} (GPT-2 has LayerNorm)")
    if config.activation not in ("gelu", "gelu_tanh"):
        out.append(f"{config.activation} (GPT-2 has GELU)")
    if config.position_embedding_type != "learned_absolute":
        out.append(f"{config.position_embedding_type} positions (GPT-2 has learned ones)")
    if not config.add_bias_linear:
        out.append("no linear biases (GPT-2 has them)")
    return out


def _attention(config: TransformerConfig) -> list[str]:
    """Attention and layers unlike GPT-2's."""
    out = []
    if config.num_query_groups != config.num_attention_heads:
        out.append("grouped-query attention (GPT-2 has one K/V per head)")
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        out.append("heads x head size != hidden size")
    if config.add_qkv_bias and not config.add_bias_linear:
        out.append("bias on Q/K/V only (GPT-2 has every bias)")
    if config.window_size is not None:
        out.append("sliding-window attention")
    if config.qk_layernorm:
        out.append("query/key norms")
    if config.num_experts is not None:
        out.append("Mixture-of-Experts layers")
    return out


GROUP = Group("GPT-2", "GPT-2", _obstacles)


def _write(config: TransformerConfig) -> dict[str, Any]:
    return {
        "model_type": "gpt2", "architectures": list(FAMILY.classes),
        "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size, "n_layer": config.num_layers,
        "n_head": config.num_attention_heads, "n_inner": config.ffn_hidden_size,
        "activation_function": "gelu" if config.activation == "gelu" else "gelu_pytorch_tanh",
        "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_range": config.init_method_std, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "torch_dtype": "float32",
    }


def _read(keys: HFKeys) -> TransformerConfig:
    for key, ok in (("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False), ("add_cross_attention", False),
                    ("scale_attn_weights", True)):
        if keys.flag(key, ok) != ok:
            keys.refuse(f"GPT-2 config {key}={json.dumps(not ok)} is not supported (only "
                        f"{json.dumps(ok)})")
    act = keys.text("activation_function", "gelu_new")
    if act not in common.GELU_FROM_HF:
        keys.refuse(f"GPT-2 activation_function={act!r} is not supported; one of "
                    f"{', '.join(common.GELU_FROM_HF)}")
    hidden, heads = keys.integer(("n_embd", "hidden_size")), keys.integer(
        ("n_head", "num_attention_heads"))
    if hidden % heads:
        keys.refuse(f'"n_embd" ({hidden}) is not divisible by "n_head" ({heads}): GPT-2 splits '
                    f"the width evenly among the heads; {FIX_PAIR}")
    positions = keys.integer(("n_positions", "max_position_embeddings"))
    return keys.build(
        KEYS, num_layers=keys.integer(("n_layer", "num_hidden_layers")),
        hidden_size=hidden, num_attention_heads=heads, vocab_size=keys.integer("vocab_size"),
        ffn_hidden_size=keys.integer("n_inner", None), max_position_embeddings=positions,
        seq_length=positions, activation=common.GELU_FROM_HF[act],
        layernorm_epsilon=keys.number("layer_norm_epsilon", 1e-5, rule="> 0"),
        hidden_dropout=keys.number("resid_pdrop", 0.0, rule="in [0, 1)"),
        attention_dropout=keys.number("attn_pdrop", 0.0, rule="in [0, 1)"),
        init_method_std=keys.number("initializer_range", 0.02, rule="> 0"),
        untie_embeddings_and_output_weights=not keys.flag("tie_word_embeddings", True))


def _weights(config: TransformerConfig) -> list[Link]:
    """Every layer's tensors, the positions and the final norm (Conv1D weights transposed)."""
    out: list[Link] = []
    heads = Heads.of(config)
    for i in range(config.num_layers):
        a, h = layer(i), f"transformer.h.{i}."
        for x in ("weight", "bias"):
            t = x == "weight"  # Conv1D stores [in, out]
            out += [Same(a + "input_layernorm." + x, h + "ln_1." + x),
                    FusedQKV(a + "self_attention.query_key_value." + x, h + "attn.c_attn." + x,
                             heads, t),
                    Same(a + "self_attention.dense." + x, h + "attn.c_proj." + x, t),
                    Same(a + "post_attention_layernorm." + x, h + "ln_2." + x),
                    Same(a + "mlp.dense_h_to_4h." + x, h + "mlp.c_fc." + x, t),
                    Same(a + "mlp.dense_4h_to_h." + x, h + "mlp.c_proj." + x, t)]
    return out + [Same(POSITIONS, "transformer.wpe.weight"),
                  Same(FINAL_NORM + "weight", "transformer.ln_f.weight"),
                  Same(FINAL_NORM + "bias", "transformer.ln_f.bias")]


FAMILY = Family(
    model_type="gpt2", name="GPT-2", classes=("GPT2LMHeadModel",), group=GROUP, read=_read,
    write=_write, weights=_weights, keys=KEYS,
    vocab=("transformer.wte.weight", "lm_head.weight"), prefix="transformer.",
    # Causal-mask constants some GPT-2 files carry next to the weights.
    buffers=(".attn.bias", ".attn.masked_bias"))
