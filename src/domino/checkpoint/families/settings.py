"""What the keys of a Hugging Face ``config.json`` set, for the refusal of a ``model_type`` no
family reads (:mod:`~domino.checkpoint.families.unknown`): each key that changes what a model
computes, in words, with the values at which it changes nothing (inert) and whether no family
domino reads has it (then the key alone refuses the file) or some family has it (then it is
weighed against each family's reading). Keys that never change the forward pass are
:func:`~domino.checkpoint.families.unknown.harmless`; a key in neither list is "a setting
domino does not read"."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Raw = dict[str, Any]
Test = Callable[[Any, Raw], bool]


def _never(value: Any, raw: Raw) -> bool:
    return False


def _always(value: Any, raw: Raw) -> bool:
    return True


def _off(value: Any, raw: Raw) -> bool:
    return value in (None, False, 0, "", [], {})


def _not_false(value: Any, raw: Raw) -> bool:
    return value is not False


def _unit(value: Any, raw: Raw) -> bool:
    return value is None or value == 1


def head_dim(raw: Raw) -> float:
    """The head size: head_dim, else the width over the heads (0 when neither is known)."""
    hidden = raw.get("hidden_size") or raw.get("d_model") or 0
    heads = raw.get("num_attention_heads") or raw.get("n_head") or 0
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (hidden, heads))
    size = raw.get("head_dim") or (hidden / heads if numbers and heads else 0)
    return size if isinstance(size, int | float) and not isinstance(size, bool) else 0


@dataclass(frozen=True)
class Setting:
    """What a key sets (``meaning``, or a function of the value and the whole config), when
    its value changes nothing (``inert``), when no family domino reads has it (``lacks``),
    and ``group``: keys of one feature, named once."""

    meaning: str | Callable[[Any, Raw], str]
    inert: Test = _never
    lacks: Test = _always
    group: str | None = None


def _lacking(meaning: str | Callable[[Any, Raw], str], inert: Test = _off,
             group: str | None = None) -> Setting:
    return Setting(meaning, inert, _always, group)


def _ours(meaning: str | Callable[[Any, Raw], str], inert: Test = _never) -> Setting:
    return Setting(meaning, inert, _never)


# ---- the keys with a value-dependent meaning -------------------------------------------------

_KINDS = {"full_attention", "sliding_attention"}
_KIND_WORDS = {"linear_attention": "linear attention", "mamba": "Mamba state-space layers",
               "conv": "short convolutions", "chunked_attention": "chunked attention",
               "mlp": "layers without attention", "moe": "layers without attention"}


def _layer_kinds(value: Any) -> list[str]:
    return sorted({str(v) for v in value}) if isinstance(value, list) else []


def _layer_types(value: Any, raw: Raw) -> str:
    kinds = _layer_kinds(value)
    other = [k for k in kinds if k not in _KINDS]
    if other:
        words = ", ".join(_KIND_WORDS[k] for k in other if k in _KIND_WORDS)
        return f"layer_types with {' and '.join(other)} layers" + (f" ({words})" if words
                                                                  else "")
    return ("layer_types mixing full_attention and sliding_attention layers (local and global "
            "attention alternating)")


def _layer_types_lack(value: Any, raw: Raw) -> bool:
    """Kinds of layer other than full and sliding attention (Gemma 2/3 mix those two)."""
    return any(k not in _KINDS for k in _layer_kinds(value))


def rope_dict(value: Any) -> Raw:
    """A RoPE settings object with ``type`` spelled ``rope_type`` (transformers 4's name)."""
    if not isinstance(value, dict):
        return {}
    return {("rope_type" if k == "type" else k): v for k, v in value.items()}


def _rope_per_layer(rope: Raw) -> bool:
    return bool(rope) and all(isinstance(v, dict) or v is None for v in rope.values())


# RoPE types some family reads (Phi-3's su is its longrope; GPT-OSS reads yarn).
_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su", "yarn")


def _rope_type(rope: Raw) -> str:
    return str(rope.get("rope_type") or "default")


def _rope_inert(value: Any, raw: Raw) -> bool:
    """RoPE settings some family reads: one RoPE for all layers, rotating whole heads."""
    rope = rope_dict(value)
    return not (_rope_per_layer(rope) or _rope_type(rope) not in _ROPE_TYPES
                or rope.get("rope_interleave")) and rope.get("partial_rotary_factor") in (
        None, 1, 1.0)


def _rope_lacks(value: Any, raw: Raw) -> bool:
    """RoPE settings no family reads: those per kind of layer are Gemma 3's when the kinds
    are full and sliding attention and each kind's settings are read."""
    rope = rope_dict(value)
    if not _rope_per_layer(rope):
        return not _rope_inert(value, raw)
    return not set(rope) <= _KINDS or not all(v is not None and _rope_inert(v, raw)
                                              for v in rope.values())


def _rope(value: Any, raw: Raw) -> str:
    rope = rope_dict(value)
    if _rope_per_layer(rope):
        odd = [v for v in rope.values() if v is not None and not _rope_inert(v, raw)]
        bare = [k for k, v in rope.items() if v is None]
        if bare:  # (Ergo's: its full-attention layers have no RoPE)
            return f"no RoPE on {', '.join(bare)} layers"
        if set(rope) <= _KINDS:
            return (f"{', '.join(rope)} layers' RoPE with {_rope(odd[0], raw)}" if odd else
                    f"RoPE settings per kind of layer: {', '.join(rope)} (Gemma 3's)")
        return (f"RoPE settings per kind of layer: {', '.join(rope)}; domino has them only for "
                "full_attention and sliding_attention layers (Gemma 3's)")
    if _rope_type(rope) not in _ROPE_TYPES:
        return (f"{_rope_type(rope)} RoPE scaling; domino has linear, llama3, longrope and "
                "yarn")
    if rope.get("rope_interleave"):
        return "RoPE on interleaved channel pairs"
    return f"RoPE on {_fraction(rope.get('partial_rotary_factor'))} of each head"


def _fraction(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, int | float) else str(value)


def _partial(value: Any, raw: Raw) -> str:
    return f"RoPE on {_fraction(value)} of each head"


def _no_rope(value: Any, raw: Raw) -> str:
    off = [i for i, on in enumerate(value) if not on]
    shown = ", ".join(map(str, off[:6])) + (", ..." if len(off) > 6 else "")
    return f"no RoPE on layers {shown}"


def _no_rope_inert(value: Any, raw: Raw) -> bool:
    return not isinstance(value, list) or all(value)


def _head_scale(value: Any, raw: Raw) -> bool:
    size = head_dim(raw)
    return value is None or (size > 0 and isinstance(value, int | float)
                             and math.isclose(value, size ** -0.5, rel_tol=1e-6))


def _query_scalar(value: Any, raw: Raw) -> bool:
    return value is None or value == head_dim(raw)


def _same_width(value: Any, raw: Raw) -> bool:
    return value is None or value == (raw.get("hidden_size") or raw.get("d_model"))


def _parts(value: Any, raw: Raw) -> str:
    parts = [k for k, v in raw.items() if isinstance(v, dict) and k in COMPOSITE]
    return (f"a model in several parts ({', '.join(parts)}; domino import reads a text "
            "decoder's own config.json)")


def _activation(value: Any, raw: Raw) -> bool:
    """An activation no family has (GELU's spellings and SiLU are read)."""
    return isinstance(value, str) and value not in ("silu", "swish", "gelu", "gelu_new",
                                                    "gelu_pytorch_tanh", "gelu_fast")


def _nested(value: Any, raw: Raw) -> str:
    if isinstance(value, dict) and value.get("alibi"):
        return "ALiBi position biases (attn_config.alibi)"
    return "settings nested in attn_config / ffn_config (DBRX's and MPT's layout)"


def _quantized(value: Any, raw: Raw) -> str:
    method = value.get("quant_method") if isinstance(value, dict) else None
    return f"quantized weights ({method or 'quantization_config'}); save it unquantized"


def _scaled(what: str) -> Callable[[Any, Raw], str]:
    return lambda value, raw: f"{what} {value}"


def _without_sliding(value: Any, raw: Raw) -> bool:
    """Inert where a Qwen-style use_sliding_window turns the window off."""
    return value is None or raw.get("use_sliding_window") is False


# ---- the table --------------------------------------------------------------------------------

COMPOSITE = ("text_config", "vision_config", "audio_config", "vq_config", "encoder_config",
             "decoder_config", "patcher_config", "global_config", "audio_encoder_config",
             "depth_decoder_config", "text_encoder", "audio_encoder", "decoder")

SETTINGS: dict[str, Setting] = {
    # scales and multipliers (Granite's four are read)
    "embedding_multiplier": _ours(_scaled("the embeddings multiplied by"), _unit),
    "embedding_scale": _lacking(_scaled("the embeddings multiplied by"), _unit),
    "scale_emb": _lacking(_scaled("the embeddings multiplied by"), _unit),
    "scale_embedding": _lacking("the embeddings multiplied by sqrt(hidden size)"),
    "residual_multiplier": _ours(_scaled("each sublayer's output multiplied by"), _unit),
    "scale_depth": _lacking("each sublayer's output scaled by scale_depth / sqrt(layers)"),
    "attention_multiplier": _ours(lambda value, raw: f"attention scores scaled by {value}, "
                                  "not 1/sqrt(head_dim)", _head_scale),
    "query_pre_attn_scalar": _ours("attention scaled by 1/sqrt(query_pre_attn_scalar), "
                                   "not 1/sqrt(head_dim)", _query_scalar),  # (Gemma 2/3's)
    "logits_scaling": _ours(_scaled("the logits divided by"), _unit),
    "logit_scale": _lacking(_scaled("the logits multiplied by"), _unit),
    "lm_head_multiplier": _lacking(_scaled("the logits multiplied by"), _unit),
    "dim_model_base": _lacking("the logits divided by hidden_size / dim_model_base", _same_width),
    "mup_enabled": _lacking("muP multipliers"),
    "attn_temperature_tuning": _lacking("attention temperature tuning on long inputs"),
    "attention_value_scale": _lacking(_scaled("attention values scaled by"), _unit),
    # soft-capping (Gemma 2/3's are read)
    "attn_logit_softcapping": _ours("attention logit soft-capping"),
    "final_logit_softcapping": _ours("final logit soft-capping"),
    "logit_softcapping": _ours("final logit soft-capping"),
    "logits_soft_cap": _ours("final logit soft-capping"),
    "output_logit_soft_cap": _ours("final logit soft-capping"),
    "mlp_gate_softcap": _lacking("MLP soft-capping"),
    "moe_router_logit_softcapping": _lacking("router logit soft-capping"),
    # norms
    "use_post_norm": _lacking("norms after the sublayers as well"),
    "use_sandwich_norm": _lacking("norms before and after each sublayer"),
    "use_post_attention_norm": _lacking("a norm after attention"),
    "use_post_feedforward_norm": _lacking("a norm after the MLP"),
    "apply_residual_connection_post_layernorm": _lacking("the residual taken after the norm"),
    "do_layer_norm_before": _lacking("norms after the sublayers (post-LN)", _not_false),
    "layernorm_embedding": _lacking("a norm on the embeddings"),
    "layer_norm_eps": _ours("LayerNorm's epsilon"),
    "layer_norm_epsilon": _ours("LayerNorm's epsilon"),
    "qk_layernorm": _ours("norms on queries and keys", _off),
    "use_qk_norm": _ours("norms on queries and keys", _off),
    "qk_norm": _ours("norms on queries and keys", _off),
    # biases
    "qkv_bias": _ours("a bias on Q/K/V"),
    "attention_bias": _ours("biases in attention"),
    "attention_out_bias": _ours("a bias on the attention output"),
    "mlp_bias": _ours("biases in the MLP"),
    "use_bias": _ours("biases"),
    # attention and positions
    "rope_parameters": Setting(_rope, _rope_inert, _rope_lacks),
    "rope_scaling": Setting(_rope, _rope_inert, _rope_lacks),
    "partial_rotary_factor": _lacking(_partial, lambda value, raw: _unit(value, raw) or (
        "partial_rotary_factor" in rope_dict(raw.get("rope_parameters")))),  # (named there)
    "rotary_pct": _lacking(_partial, _unit),
    "rotary_dim": _lacking("RoPE on the first rotary_dim channels of each head"),
    "rope_interleave": _lacking("RoPE on interleaved channel pairs"),
    "no_rope_layers": _ours(_no_rope, _no_rope_inert),  # (SmolLM3's)
    "no_rope_layer_interval": _ours(
        "no RoPE on every no_rope_layer_interval-th layer",
        lambda value, raw: "no_rope_layers" in raw or not value),
    "layer_types": Setting(_layer_types, lambda value, raw: _layer_kinds(value) in (
        [], ["full_attention"]), _layer_types_lack),
    "sliding_window_pattern": _ours("local and global attention alternating",
                                    lambda value, raw: "layer_types" in raw or _unit(value,
                                                                                     raw)),
    "attention_types": _lacking("local attention on some layers",
                                lambda value, raw: "local" not in str(value)),
    "attn_layers": _lacking("Reformer's LSH and local attention"),
    "attn_type": _lacking("XLNet's two-stream relative attention"),
    "causal": _lacking("bidirectional attention", _not_false),
    "use_lang_emb": _lacking("language embeddings"),
    "position_bias_num_buckets": _lacking("relative position biases"),
    "segment_types": _lacking("segment embeddings", _unit),
    "attn_config": _lacking(_nested, lambda value, raw: not isinstance(value, dict)),
    "ffn_config": _lacking(_nested, lambda value, raw: not isinstance(value, dict)),
    "attention_chunk_size": _lacking("chunked attention"),
    "use_bidirectional_attention": _lacking("bidirectional attention"),
    "clip_qkv": _lacking("queries, keys and values clipped"),
    "alibi": _lacking("ALiBi position biases"),
    "use_parallel_residual": _lacking("attention and MLP side by side on one input"),
    "parallel_attn": _lacking("attention and MLP side by side on one input"),
    "scale_attn_weights": _lacking("attention scores not scaled by 1/sqrt(head size)",
                                   _not_false),
    "scale_attn_by_inverse_layer_idx": _lacking("attention scaled by 1/layer number"),
    "use_attention_gate": _lacking("a gate on the attention output"),
    "kv_lora_rank": _lacking("multi-head latent attention: keys and values through a "
                             "low-rank latent", group="mla"),
    "q_lora_rank": _lacking("queries through a low-rank projection", group="mla"),
    "index_topk": _lacking("sparse attention chosen by an indexer"),
    "lambda_std_dev": _lacking("differential attention"),
    "sliding_window": _ours("a sliding window", _without_sliding),
    "max_window_layers": _ours("the first layer with a sliding window",
                               lambda value, raw: not raw.get("use_sliding_window")),
    "use_sliding_window": _ours("sliding-window attention", _off),
    "multi_query": _ours("one key/value head", _off),
    "position_embedding_type": _ours("the kind of positions"),
    # MLP
    "hidden_act": Setting("the MLP's activation", lacks=_activation),
    "hidden_activation": Setting("the MLP's activation", lacks=_activation),
    "activation_function": Setting("the MLP's activation", lacks=_activation),
    "swiglu_limit": _ours("SwiGLU clamped"),  # (GPT-OSS's)
    "swiglu_alpha": _ours("SwiGLU with a scaled gate", _unit),
    "activation_sparsity_pattern": _lacking(
        "activation sparsity", lambda value, raw: not value or isinstance(value, list)
        and not any(value)),
    # Mixture of Experts
    "num_experts": _ours("experts (Mixture of Experts)"),
    "num_local_experts": _ours("experts (Mixture of Experts)"),
    "n_routed_experts": _ours("experts (Mixture of Experts)"),
    "moe_num_experts": _ours("experts (Mixture of Experts)"),
    "num_experts_per_tok": _ours("experts per token"),
    "moe_topk": _ours("experts per token"),
    "moe_k": _ours("experts per token"),
    "moe_intermediate_size": _ours("each expert's MLP width"),
    "norm_topk_prob": _ours("whether the top-k weights are re-normalised"),
    "first_k_dense_replace": _ours("dense layers before the MoE ones", _off),
    "n_shared_experts": _lacking("shared experts", group="shared"),
    "num_shared_experts": _lacking("shared experts", group="shared"),
    "moe_num_shared_experts": _lacking("shared experts", group="shared"),
    "shared_expert_intermediate_size": _lacking("a shared expert", group="shared"),
    "moe_shared_expert_intermediate_size": _lacking("a shared expert", group="shared"),
    "routed_scaling_factor": _lacking(_scaled("the expert weights multiplied by"), _unit),
    "router_scaling_factor": _lacking(_scaled("the expert weights multiplied by"), _unit),
    "n_group": _lacking("grouped top-k routing: experts chosen within the best groups",
                        _unit, "groups"),
    "topk_group": _lacking("grouped top-k routing: experts chosen within the best groups",
                           _unit, "groups"),
    "zero_expert_num": _lacking("zero (identity) experts"),
    "moe_apply_router_weight_on_input": _lacking("router weights applied to the experts' "
                                                 "input"),
    "scoring_func": _lacking(lambda value, raw: f"{value} router scores, not softmax",
                             lambda value, raw: value in (None, "softmax")),
    "topk_method": _lacking("experts chosen with a per-expert bias (DeepSeek's noaux_tc)",
                            lambda value, raw: value in (None, "greedy")),
    # other layers than attention and MLPs
    "mamba_d_state": _lacking("Mamba state-space layers", group="ssm"),
    "state_size": _lacking("state-space layers", group="ssm"),
    "ssm_state_size": _lacking("state-space layers", group="ssm"),
    "linear_num_key_heads": _lacking("linear-attention layers", group="linear"),
    "linear_conv_kernel_dim": _lacking("linear-attention layers", group="linear"),
    "conv_L_cache": _lacking("short convolution layers", group="conv"),
    "block_types": _lacking("recurrent blocks", lambda value, raw: "recurrent" not in str(value)),
    "lru_width": _lacking("recurrent (RG-LRU) blocks"),
    "attention_hidden_size": _lacking("attention of another width than the layers",
                                      _same_width),
    "rescale_every": _lacking("RWKV time mixing instead of attention"),
    "qk_dim_factor": _lacking("xLSTM blocks instead of attention"),
    "hybrid_layer_ids": _lacking("attention on some layers only", group="hybrid"),
    "attn_layer_period": _lacking("attention on some layers only", group="hybrid"),
    "layers_block_type": _lacking("layers of several kinds", group="hybrid"),
    "attn_layer_indices": _lacking("attention on some layers only", group="hybrid"),
    # whole-model shapes
    "is_encoder_decoder": _lacking("an encoder-decoder model; domino reads decoders alone",
                                   group="encdec"),
    "add_cross_attention": _lacking("cross-attention"),
    "encoder_layers": _lacking("an encoder-decoder model; domino reads decoders alone",
                               group="encdec"),
    "decoder_layers": _lacking("an encoder-decoder model's decoder", group="encdec"),
    "type_vocab_size": _lacking("token-type embeddings"),
    "embedding_size": _lacking("embeddings of another width than the layers", _same_width),
    "word_embed_proj_dim": _lacking("embeddings of another width than the layers", _same_width),
    "hidden_size_per_layer_input": _lacking("an input embedding per layer"),
    "altup_num_inputs": _lacking("AltUp (several predicted streams)"),
    "laurel_rank": _lacking("LAuReL residual blocks"),
    "num_kv_shared_layers": _lacking("layers that reuse another layer's keys and values"),
    "lm_head_bias": _lacking("a bias on the output layer"),
    "num_codebooks": _lacking("several audio codebooks"),
    "quantization_config": _lacking(_quantized),
    "auto_map": _lacking("its own modeling code (auto_map: loaded with trust_remote_code)"),
    **{key: _lacking(_parts, lambda value, raw: not isinstance(value, dict), "parts")
       for key in COMPOSITE},
}
