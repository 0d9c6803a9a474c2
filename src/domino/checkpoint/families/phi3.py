"""Phi-3 and Phi-4 (``Phi3ForCausalLM``, ``model_type`` "phi3"): Llama's math (RMSNorm,
SwiGLU, RoPE in halves, grouped-query attention, no biases) with fused weights, ``qkv_proj``
(``[all q; all k; all v]`` rows) and ``gate_up_proj`` (``[gate; up]`` rows, our ``fc1`` as it
is); RoPE on the first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75); a sliding
window on every layer when ``sliding_window`` is set (Phi-3-mini-4k: 2047), none when null.

LongRoPE (``rope_scaling`` of type ``longrope``, or ``su`` / ``yarn``, which transformers reads
as longrope for Phi-3: the 128k models, Phi-3.5-mini, Phi-4-mini) is read as transformers 5
reads it: ``short_factor`` / ``long_factor`` (one per rotated channel pair), the top-level
``original_max_position_embeddings`` (Phi3Config's, default 4096: it overrides the one inside
the RoPE settings), ``factor`` (default max_position_embeddings / original) and
``attention_factor`` (default from the factor); see :mod:`domino.transformer.rope_longrope`
for when each factor set applies."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from domino.checkpoint.families import common, llama_like
from domino.checkpoint.families.family import Family, Group
from domino.checkpoint.families.weights import (
    FINAL_NORM,
    FusedQKV,
    Heads,
    Link,
    Same,
    layer,
)
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

NAME = "Phi-3"
KEYS = {**{k: v for k, v in llama_like.KEYS.items() if not k.startswith(("moe_", "num_exp"))},
        "rotary_percent": "rope_scaling.partial_rotary_factor", "hidden_dropout": "resid_pdrop",
        "rope_short_factor": "rope_scaling.short_factor",
        "rope_long_factor": "rope_scaling.long_factor",
        "rope_attention_factor": "rope_scaling.attention_factor",
        "rope_original_max_position_embeddings": "original_max_position_embeddings"}
_LONGROPE = ("longrope", "su", "yarn")  # (transformers' Phi3Config reads su and yarn as longrope)
# Our architecture fields a Phi-3 config.json sets (or that the obstacles below check); any other
# away from its default is a setting Phi-3 lacks.
_READ = {"num_layers", "hidden_size", "num_attention_heads", "vocab_size", "ffn_hidden_size",
         "kv_channels", "num_query_groups", "max_position_embeddings", "position_embedding_type",
         "rotary_percent", "rotary_base", "rotary_seq_len_interpolation_factor",
         "rope_scaling_type", "rope_scaling_factor", "rope_original_max_position_embeddings",
         "rope_short_factor", "rope_long_factor", "rope_attention_factor",
         "normalization", "activation", "add_bias_linear", "add_qkv_bias",
         "qk_layernorm", "qk_layernorm_full_width", "window_size", "layernorm_epsilon",
         "untie_embeddings_and_output_weights", "num_experts",
         "apply_residual_connection_post_layernorm", "final_layernorm",
         "decoder_num_layers"}  # (a GPT has no decoder)
_DEFAULTS = {f.name: f.default for f in fields(TransformerConfig)}


# ---- what Phi-3 cannot express ----------------------------------------------------------------


def _obstacles(config: TransformerConfig) -> list[str]:
    out = common.obstacles(config)
    if config.normalization != "RMSNorm":
        out.append(f"{config.normalization} ({NAME} has RMSNorm)")
    if config.activation != "swiglu":
        out.append(f"{config.activation} ({NAME} has SwiGLU)")
    if config.position_embedding_type != "rope":
        out.append(f"{config.position_embedding_type} positions ({NAME} has RoPE)")
    elif config.rotary_seq_len_interpolation_factor:
        out.append(f"RoPE position interpolation ({NAME} has longrope scaling or none)")
    elif config.rope_scaling_type not in (None, "longrope"):
        out.append(f"{config.rope_scaling_type} RoPE scaling ({NAME} has longrope or none)")
    if config.add_bias_linear or config.add_qkv_bias:
        out.append(f"biases ({NAME} has none)")
    if config.qk_layernorm:
        out.append(f"query/key norms ({NAME} has none)")
    if config.num_experts is not None:
        out.append(f"Mixture-of-Experts layers ({NAME} is dense)")
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        out.append(f"a head size of {config.kv_channels}, not hidden size / heads (older "
                   f"transformers' {NAME} derives it so, ignoring head_dim)")
    return out + _unread(config)


def _unread(config: TransformerConfig) -> list[str]:
    """Settings no Phi-3 config.json sets, away from the value that changes nothing."""
    return [f"{name}={value!r} ({NAME} has no such setting)"
            for name, value in config.architecture().items()
            if name not in _READ and value != _DEFAULTS.get(name, value)]


# ---- config.json ------------------------------------------------------------------------------


def _rope(keys: HFKeys) -> tuple[str, float, float, dict[str, Any]]:
    """(the key holding the RoPE settings, rope_theta, partial_rotary_factor, our LongRoPE
    settings). As Phi3Config: ``rope_scaling`` before ``rope_parameters``."""
    rope = "rope_scaling" if keys.raw.get("rope_scaling") else "rope_parameters"
    kind_keys = (f"{rope}.rope_type", f"{rope}.type")
    kind = keys.text(kind_keys, "default")
    if kind not in ("default", *_LONGROPE):
        keys.refuse(f'{NAME} {keys.found(*kind_keys)}="{kind}" is not supported (Phi-3 has '
                    "default RoPE or longrope; transformers refuses the others)")
    theta = keys.number((f"{rope}.rope_theta", "rope_theta"), 10000.0, rule="> 1")
    part = keys.number((f"{rope}.partial_rotary_factor", "partial_rotary_factor"), 1.0,
                       rule="> 0")
    return rope, theta, part, (_longrope(keys, rope) if kind in _LONGROPE else {})


def _longrope(keys: HFKeys, rope: str) -> dict[str, Any]:
    """LongRoPE's settings as transformers 5 reads them: the top-level original length (it
    overrides ``{rope}.original_max_position_embeddings``), the factor else the ratio of the
    lengths, the attention factor else derived (None)."""
    original = keys.integer("original_max_position_embeddings", 4096)
    factor = keys.number(f"{rope}.factor", None, rule="> 0")
    if factor is None:
        factor = keys.integer("max_position_embeddings", 4096) / original
    return dict(rope_scaling_type="longrope",
                rope_short_factor=keys.numbers(f"{rope}.short_factor", rule="> 0"),
                rope_long_factor=keys.numbers(f"{rope}.long_factor", rule="> 0"),
                rope_original_max_position_embeddings=original, rope_scaling_factor=factor,
                rope_attention_factor=keys.number(f"{rope}.attention_factor", None,
                                                  rule="> 0"))


def _read(keys: HFKeys) -> TransformerConfig:
    act = keys.text("hidden_act", "silu")
    if act != "silu":
        keys.refuse(f"{NAME} hidden_act={act!r} is not supported (only silu: SwiGLU)")
    tp = keys.integer("pretraining_tp", None)
    if tp not in (None, 1):  # (as Llama's: the key is not Phi-3's, its slicing not ours)
        keys.refuse(f"{NAME} pretraining_tp={tp} is not supported (only 1)")
    rope, theta, part, longrope = _rope(keys)
    positions = keys.integer("max_position_embeddings", 4096)
    return keys.build(
        FAMILY.names(rope), num_layers=keys.integer("num_hidden_layers"),
        vocab_size=keys.integer("vocab_size"), ffn_hidden_size=keys.integer("intermediate_size"),
        **llama_like.read_heads(keys), max_position_embeddings=positions,
        seq_length=min(positions, 4096), position_embedding_type="rope", rotary_base=theta,
        rotary_percent=part, normalization="RMSNorm", activation="swiglu",
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
        window_size=llama_like.every_layer_window(keys, NAME),
        layernorm_epsilon=keys.number("rms_norm_eps", 1e-5, rule="> 0"),
        hidden_dropout=keys.number("resid_pdrop", 0.0, rule="in [0, 1)"),
        attention_dropout=keys.number("attention_dropout", 0.0, rule="in [0, 1)"),
        init_method_std=keys.number("initializer_range", 0.02, rule="> 0"),
        untie_embeddings_and_output_weights=not keys.flag("tie_word_embeddings", False),
        **longrope)


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = llama_like.without(llama_like.config_json(config, FAMILY), "attention_bias",
                             "mlp_bias", "pretraining_tp")
    rope = {**out["rope_parameters"], "partial_rotary_factor": config.rotary_percent}
    if config.rope_scaling_type == "longrope":
        out.update(_longrope_json(config, rope))
        rope = out["rope_parameters"]
    return {**out, "rope_parameters": rope, "partial_rotary_factor": config.rotary_percent,
            "sliding_window": config.window_size, "resid_pdrop": config.hidden_dropout,
            "embd_pdrop": 0.0, "pad_token_id": None}  # (not Phi3Config's 32000; the tokens
    # the model has, added after this, say their own)


def _longrope_json(config: TransformerConfig, rope: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` with LongRoPE, the top-level original length (Phi3Config's, which
    wins over the one inside) and the ``rope_scaling`` transformers < 5 reads (and 5 reads
    first): the Hub's three keys where they mean the same (factor and attention factor the
    derived ones), else every key."""
    original = config.rope_original_max_position_embeddings
    rope = {**rope, "rope_type": "longrope", "short_factor": list(config.rope_short_factor),
            "long_factor": list(config.rope_long_factor), "factor": config.rope_scaling_factor,
            "original_max_position_embeddings": original}
    if config.rope_attention_factor is not None:
        rope["attention_factor"] = config.rope_attention_factor
    legacy = {"type": "longrope", "short_factor": rope["short_factor"],
              "long_factor": rope["long_factor"]}
    derived = math.isclose(config.rope_scaling_factor,
                           config.max_position_embeddings / original, rel_tol=1e-12)
    if not derived or config.rope_attention_factor is not None:
        legacy = {"type": "longrope", **{k: v for k, v in rope.items() if k != "rope_theta"}}
    return {"rope_parameters": rope, "rope_scaling": legacy,
            "original_max_position_embeddings": original}


# ---- weights ----------------------------------------------------------------------------------


def _weights(config: TransformerConfig) -> list[Link]:
    """Each layer's norms, ``qkv_proj`` (q, k, v as whole blocks), ``o_proj``, ``gate_up_proj``
    (our ``[gate; up]`` rows as they are) and ``down_proj``."""
    heads, out = Heads.of(config), []
    for i in range(config.num_layers):
        a, h = layer(i), f"model.layers.{i}."
        out += [Same(a + "input_layernorm.weight", h + "input_layernorm.weight"),
                FusedQKV(a + "self_attention.query_key_value.weight",
                         h + "self_attn.qkv_proj.weight", heads),
                Same(a + "self_attention.dense.weight", h + "self_attn.o_proj.weight"),
                Same(a + "post_attention_layernorm.weight",
                     h + "post_attention_layernorm.weight"),
                Same(a + "mlp.dense_h_to_4h.weight", h + "mlp.gate_up_proj.weight"),
                Same(a + "mlp.dense_4h_to_h.weight", h + "mlp.down_proj.weight")]
    return out + [Same(FINAL_NORM + "weight", "model.norm.weight")]


FAMILY = Family(
    model_type="phi3", name=NAME, classes=("Phi3ForCausalLM",),
    group=Group(NAME, NAME, _obstacles), read=_read, write=_write, weights=_weights,
    keys=KEYS, longrope=True)
