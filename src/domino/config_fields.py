"""Which of :class:`~domino.config.TransformerConfig`'s fields are what: saved, part of the
architecture (what a set of weights is), and at which value a field changes nothing (left out
of ``architecture()`` so that records written before it existed still match)."""

from __future__ import annotations

NOT_SAVED = {"init_method", "output_layer_init_method"}
# Architecture fields left out of architecture() at the value that changes nothing.
NEUTRAL = {
    "embedding_multiplier": 1.0, "embedding_multiplier_rounded": False,
    "residual_multiplier": 1.0, "softmax_scale": None, "logits_scaling": 1.0, "nope_layers": (),
    "norm_after_sublayer": False, "full_attention_layers": (), "attention_softcap": None,
    "output_softcap": None, "sandwich_norms": False, "layernorm_zero_centered_gamma": False,
    "norm_scale_in_fp32": False, "local_rotary_base": None, "swiglu_alpha": 1.0,
    "glu_linear_offset": 0.0, "activation_func_clamp_value": None, "attention_sinks": False,
    "moe_router_bias": False, "moe_expert_linear_bias": False, "rope_attention_factor": None,
    "rope_short_factor": (), "rope_long_factor": (),
}

# What a set of weights is: shapes and math (not dropout, init, sequence length or the schedule).
ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "ffn_hidden_size",
    "kv_channels", "num_query_groups", "decoder_num_layers", "max_position_embeddings",
    "position_embedding_type", "rotary_percent", "rotary_base",
    "rotary_seq_len_interpolation_factor", "rope_scaling_type", "rope_scaling_factor",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings",
    "rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_truncate", "rope_attention_factor",
    "rope_short_factor", "rope_long_factor",
    "nope_layers", "local_rotary_base",
    "normalization", "activation", "swiglu_alpha", "glu_linear_offset", "attention_sinks",
    "activation_func_clamp_value", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "qk_layernorm_full_width", "window_size", "full_attention_layers", "attention_softcap",
    "embedding_multiplier", "embedding_multiplier_rounded", "residual_multiplier",
    "softmax_scale", "logits_scaling",
    "output_softcap", "num_experts", "moe_router_topk",
    "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_first_k_dense_layers", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias", "moe_router_bias", "moe_expert_linear_bias",
    "layernorm_epsilon",
    "apply_residual_connection_post_layernorm", "norm_after_sublayer", "sandwich_norms",
    "norm_scale_in_fp32",
    "layernorm_zero_centered_gamma", "final_layernorm",
    "untie_embeddings_and_output_weights",
)
