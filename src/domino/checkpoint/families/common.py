"""What several families share beyond one layout: the obstacles every family's refusal starts
with, and the GELU spellings of ``config.json``."""

from __future__ import annotations

from domino.config import TransformerConfig

# config.json's GELU names -> ours (gelu_new, gelu_fast: the tanh approximation, written out).
GELU_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh"}
GELU_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def obstacles(config: TransformerConfig) -> list[str]:
    """What no family has: the residual after the norm, no final norm, and the MoE settings
    none of the MoE families has."""
    out = _moe_obstacles(config)
    if config.apply_residual_connection_post_layernorm:
        out.append("the residual taken after the norm (post-LN)")
    if not config.final_layernorm:
        out.append("no final norm")
    return out


def scalars(config: TransformerConfig) -> list[str]:
    """Granite's scalars, where they change something (only Granite has them all; Gemma
    scales its embeddings by sqrt(hidden_size) and Gemma 2/3 their attention scores)."""
    out = []
    if config.embedding_multiplier != 1.0:
        out.append(f"the embeddings multiplied by {config.embedding_multiplier} (only Granite "
                   "and Gemma have it)")
    if config.residual_multiplier != 1.0:
        out.append(f"each sublayer's output multiplied by {config.residual_multiplier} (only "
                   "Granite has it)")
    if config.softmax_scale is not None:
        out.append(f"attention scores scaled by {config.softmax_scale}, not 1/sqrt(head size) "
                   "(only Granite and Gemma 2/3 have it)")
    if config.logits_scaling != 1.0:
        out.append(f"the logits divided by {config.logits_scaling} (only Granite has it)")
    return out


def gemma(config: TransformerConfig) -> list[str]:
    """Gemma's settings, where they change something (only the Gemma families have them)."""
    out = []
    if config.layernorm_zero_centered_gamma:
        out.append("norms scaling by (1 + weight) (only Gemma has them)")
    if config.sandwich_norms:
        out.append("norms before and after each sublayer (only Gemma 2 and 3 have them)")
    if config.attention_softcap is not None:
        out.append(f"attention scores soft-capped at {config.attention_softcap} (only Gemma 2 "
                   "and 3 have it)")
    if config.output_softcap is not None:
        out.append(f"logits soft-capped at {config.output_softcap} (only Gemma 2 and 3 have "
                   "it)")
    if config.local_rotary_base is not None:
        out.append(f"a RoPE base of {config.local_rotary_base} on the sliding-window layers "
                   "(only Gemma 3 has it)")
    return out


def local_global(config: TransformerConfig) -> list[str]:
    """Full-attention layers among sliding-window ones (Gemma 2/3's and GPT-OSS's)."""
    if not config.full_attention_layers:
        return []
    layers = ", ".join(map(str, config.full_attention_layers))
    return [f"full attention on layers {layers} among sliding-window ones (only Gemma 2, "
            "Gemma 3 and GPT-OSS have them)"]


def gpt_oss(config: TransformerConfig) -> list[str]:
    """GPT-OSS's settings, where they change something (only GPT-OSS has them)."""
    out = []
    if config.attention_sinks:
        out.append("attention sinks")
    if config.moe_router_bias or config.moe_expert_linear_bias:
        out.append("biases on the router or the experts")
    if (config.activation_func_clamp_value is not None or config.glu_linear_offset
            or config.swiglu_alpha != 1.0):
        out.append("a clamped, scaled or offset gated activation")
    if config.position_embedding_type == "rope" and config.rope_scaling_type == "yarn":
        out.append("yarn RoPE scaling")
    return [f"{what} (only GPT-OSS has them)" for what in out]


def norms_after(config: TransformerConfig) -> list[str]:
    """Norms after each sublayer instead of before (only OLMo 2 has them)."""
    if not config.norm_after_sublayer:
        return []
    return ["norms after each sublayer instead of before (only OLMo 2 has them)"]


def longrope(config: TransformerConfig) -> list[str]:
    """LongRoPE scaling (only Phi-3 has it)."""
    if config.position_embedding_type != "rope" or config.rope_scaling_type != "longrope":
        return []
    return ["longrope RoPE scaling (only Phi-3 has it)"]


def nope(config: TransformerConfig) -> list[str]:
    """Layers without RoPE (only SmolLM3 has them)."""
    if not config.nope_layers:
        return []
    layers = ", ".join(map(str, config.nope_layers))
    return [f"no RoPE on layers {layers} (only SmolLM3 has layers without RoPE)"]


def _moe_obstacles(config: TransformerConfig) -> list[str]:
    """What keeps an MoE model from Mixtral / Qwen3-MoE / OLMoE (empty for a dense model)."""
    if config.num_experts is None:
        return []
    out = []
    per_head = config.qk_layernorm and not config.qk_layernorm_full_width  # Qwen3-MoE
    if config.moe_layer_freq != 1 or (config.moe_first_k_dense_layers and not per_head):
        out.append("dense layers among the MoE ones (Mixtral and OLMoE have none; Qwen3-MoE "
                   "only first)")
    if config.qk_layernorm_full_width and config.window_size is not None:
        out.append("sliding-window attention with query/key norms over all heads (OLMoE has "
                   "no window)")
    if config.moe_shared_expert_intermediate_size:
        out.append("a shared expert")
    if config.moe_router_score_function != "softmax" or config.moe_router_enable_expert_bias \
            or config.moe_router_topk_scaling_factor:
        out.append("a sigmoid router, expert bias or top-k scaling (DeepSeek's)")
    if config.moe_router_pre_softmax and not config.qk_layernorm:
        out.append("top-k weights not re-normalised (Mixtral re-normalises them)")
    return out
