"""Hugging Face ``transformers`` configs: which family expresses our model, its ``config.json``,
and our config from theirs. GPT-2 (LayerNorm, GELU, learned positions, biases) or the Llama
family (RMSNorm, SwiGLU, RoPE, grouped-query attention): Llama, Qwen2 (bias on Q/K/V only),
Qwen3 (RMSNorm on each head's queries and keys) and Mistral (sliding-window attention), and
their Mixtures of Experts: Mixtral, Qwen3-MoE and OLMoE (RMSNorm over all heads' queries and over
all keys). Gemma 1,
2 and 3 are refused with what stands in the way (:func:`config_from_hf`).

Written from the formats' documented ``config.json`` keys, so neither direction needs
``transformers`` installed; the weights are :mod:`domino.checkpoint.hf`'s.
"""

from __future__ import annotations

from typing import Any

from domino.config import TransformerConfig

ARCHITECTURES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "olmoe")
LLAMA_FAMILY = ARCHITECTURES[1:]  # one weight layout (and experts), other config keys
_QK_NORMED = ("qwen3", "qwen3_moe", "olmoe")  # the members with query/key norms
_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
          "mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE"}
# What Gemma (1, 2, 3) has that this model cannot express, for the refusal.
_GEMMA = ("RMSNorm scaling by (1 + weight)", "the embedding scaled by sqrt(hidden_size)",
          "GeGLU (a tanh-GELU gate)")
_GEMMA_2_3 = ("attention and final logit soft-capping", "norms before and after each "
              "sublayer (four per layer)", "local sliding-window layers alternating with "
              "global ones", "query_pre_attn_scalar")
_GELU_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                 "gelu_fast": "gelu_tanh"}


def choose_architecture(config: TransformerConfig) -> str:
    """``gpt2``, or ``llama`` / ``qwen2`` / ``qwen3`` / ``mistral`` (``mixtral`` /
    ``qwen3_moe`` with experts) by the model's features; ValueError naming what none of them
    has."""
    common = _moe_obstacles(config)
    if config.apply_residual_connection_post_layernorm:
        common.append("the residual taken after the norm (post-LN)")
    if not config.final_layernorm:
        common.append("no final norm")
    gpt2 = list(common)
    if config.normalization != "LayerNorm":
        gpt2.append(f"{config.normalization} (GPT-2 has LayerNorm)")
    if config.activation not in ("gelu", "gelu_tanh"):
        gpt2.append(f"{config.activation} (GPT-2 has GELU)")
    if config.position_embedding_type != "learned_absolute":
        gpt2.append(f"{config.position_embedding_type} positions (GPT-2 has learned ones)")
    if not config.add_bias_linear:
        gpt2.append("no linear biases (GPT-2 has them)")
    if config.num_query_groups != config.num_attention_heads:
        gpt2.append("grouped-query attention (GPT-2 has one K/V per head)")
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        gpt2.append("heads x head size != hidden size")
    if config.add_qkv_bias and not config.add_bias_linear:
        gpt2.append("bias on Q/K/V only (GPT-2 has every bias)")
    if config.window_size is not None:
        gpt2.append("sliding-window attention")
    if config.qk_layernorm:
        gpt2.append("query/key norms")
    if config.num_experts is not None:
        gpt2.append("Mixture-of-Experts layers")
    if not gpt2:
        return "gpt2"
    llama = list(common)
    if config.normalization != "RMSNorm":
        llama.append(f"{config.normalization} (Llama has RMSNorm)")
    if config.activation != "swiglu":
        llama.append(f"{config.activation} (Llama has SwiGLU)")
    if config.position_embedding_type != "rope":
        llama.append(f"{config.position_embedding_type} positions (Llama has RoPE)")
    elif config.rotary_percent != 1.0:
        llama.append(f"RoPE on {config.rotary_percent:.0%} of each head (Llama rotates all)")
    if config.rope_scaling_type is not None and config.rotary_seq_len_interpolation_factor:
        llama.append("both RoPE position interpolation and llama3 scaling")
    qkv_only = config.add_qkv_bias and not config.add_bias_linear
    if config.window_size is not None and config.add_bias_linear:
        llama.append("sliding-window attention with every bias (Llama has no window; Qwen2, "
                     "Qwen3 and Mistral have no output or MLP bias)")
    if config.qk_layernorm and (config.add_bias_linear or config.add_qkv_bias):
        llama.append("query/key norms with biases (Qwen3, Qwen3-MoE and OLMoE, the members "
                     "with the norms, have none)")
    if config.qk_layernorm_full_width:
        if config.num_experts is None:
            llama.append("query/key norms over all heads in a dense model (of the family only "
                         "OLMoE, a Mixture of Experts, has them)")
        elif config.kv_channels * config.num_attention_heads != config.hidden_size:
            llama.append("heads x head size != hidden size (OLMoE's query norm spans "
                         "hidden_size)")
    if not llama and config.num_experts is not None:
        if config.qk_layernorm_full_width:
            return "olmoe"
        return "qwen3_moe" if config.qk_layernorm else "mixtral"
    if not llama:
        if config.qk_layernorm:
            return "qwen3"
        return "qwen2" if qkv_only else "mistral" if config.window_size is not None else "llama"
    family = "Mixtral, Qwen3-MoE, OLMoE" if config.num_experts is not None else \
        "Llama, Qwen2, Qwen3, Mistral"
    raise ValueError(f"neither GPT-2 nor the Llama family ({family}) can express this model: "
                     "as GPT-2 it has " + "; ".join(gpt2) + ". As Llama it has "
                     + "; ".join(llama) + ".")


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


# ---- configs ----------------------------------------------------------------------------------


def hf_config(config: TransformerConfig, arch: str, eod: int) -> dict[str, Any]:
    """The ``config.json`` of the exported model."""
    tie = not config.untie_embeddings_and_output_weights
    if arch == "gpt2":
        return {
            "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
            "n_embd": config.hidden_size, "n_layer": config.num_layers,
            "n_head": config.num_attention_heads, "n_inner": config.ffn_hidden_size,
            "activation_function": "gelu" if config.activation == "gelu"
            else "gelu_pytorch_tanh",
            "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
            "attn_pdrop": config.attention_dropout,
            "layer_norm_epsilon": config.layernorm_epsilon,
            "initializer_range": config.init_method_std, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": tie, "bos_token_id": eod, "eos_token_id": eod,
            "torch_dtype": "float32",
        }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rope_scaling_type == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": config.rotary_base,
                "factor": config.rope_scaling_factor,
                "low_freq_factor": config.rope_low_freq_factor,
                "high_freq_factor": config.rope_high_freq_factor,
                "original_max_position_embeddings": config.rope_original_max_position_embeddings}
    elif config.rotary_seq_len_interpolation_factor:
        rope = {"rope_type": "linear", "rope_theta": config.rotary_base,
                "factor": config.rotary_seq_len_interpolation_factor}
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"}
    out = {
        "model_type": arch, "architectures": [_CLASSES[arch]],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon, "initializer_range": config.init_method_std,
        "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout, "tie_word_embeddings": tie,
        "rope_parameters": rope,
        # transformers < 5 reads these two instead of rope_parameters
        "rope_theta": config.rotary_base,
        "rope_scaling": None if rope["rope_type"] == "default" else legacy,
        "bos_token_id": eod, "eos_token_id": eod, "pretraining_tp": 1,
        "torch_dtype": "float32",
    }
    if arch in ("qwen2", "qwen3", "qwen3_moe"):  # Qwen2's Q/K/V biases; a window on all layers
        for key in ("mlp_bias", "pretraining_tp") + (("attention_bias",) if arch == "qwen2"
                                                      else ()):
            del out[key]
        out.update(use_sliding_window=config.window_size is not None,
                   sliding_window=config.window_size, max_window_layers=0)
    elif arch in ("mistral", "mixtral"):
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
            del out[key]
        out["sliding_window"] = config.window_size
    elif arch == "olmoe":  # no head_dim key: its query norm spans hidden_size
        for key in ("mlp_bias", "pretraining_tp", "head_dim"):
            del out[key]
        out.update(num_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                   intermediate_size=config.moe_ffn_hidden_size,
                   norm_topk_prob=not config.moe_router_pre_softmax, clip_qkv=None,
                   router_aux_loss_coef=config.moe_aux_loss_coeff)
    if arch == "mixtral":
        out.update(num_local_experts=config.num_experts,
                   num_experts_per_tok=config.moe_router_topk,
                   intermediate_size=config.moe_ffn_hidden_size,
                   router_aux_loss_coef=config.moe_aux_loss_coeff)
    elif arch == "qwen3_moe":
        out.update(num_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                   moe_intermediate_size=config.moe_ffn_hidden_size,
                   norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1,
                   mlp_only_layers=list(range(config.moe_first_k_dense_layers)),
                   router_aux_loss_coef=config.moe_aux_loss_coeff)
    return out


def _get(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    return default


def config_from_hf(raw: dict[str, Any]) -> tuple[str, TransformerConfig, int | None]:
    """(architecture, our config, end-of-text id) of a ``config.json``; ValueError naming the
    setting we cannot represent."""
    arch = raw.get("model_type")
    eos = raw.get("eos_token_id")
    eod = eos[0] if isinstance(eos, list) and eos else eos
    if arch == "gpt2":
        for key, ok in (("scale_attn_by_inverse_layer_idx", False),
                        ("reorder_and_upcast_attn", False), ("add_cross_attention", False),
                        ("scale_attn_weights", True)):
            if raw.get(key, ok) != ok:
                raise ValueError(f"GPT-2 config {key}={raw[key]!r} is not supported (only {ok})")
        act = raw.get("activation_function", "gelu_new")
        if act not in _GELU_FROM_HF:
            raise ValueError(f"GPT-2 activation_function={act!r} is not supported; one of "
                             f"{', '.join(_GELU_FROM_HF)}")
        hidden, positions = int(_get(raw, "n_embd", "hidden_size")), int(
            _get(raw, "n_positions", "max_position_embeddings"))
        config = TransformerConfig(
            num_layers=int(_get(raw, "n_layer", "num_hidden_layers")), hidden_size=hidden,
            num_attention_heads=int(_get(raw, "n_head", "num_attention_heads")),
            vocab_size=int(raw["vocab_size"]), ffn_hidden_size=_get(raw, "n_inner"),
            max_position_embeddings=positions, seq_length=positions,
            activation=_GELU_FROM_HF[act],
            layernorm_epsilon=float(raw.get("layer_norm_epsilon", 1e-5)),
            hidden_dropout=float(raw.get("resid_pdrop", 0.0)),
            attention_dropout=float(raw.get("attn_pdrop", 0.0)),
            init_method_std=float(raw.get("initializer_range", 0.02)),
            untie_embeddings_and_output_weights=not raw.get("tie_word_embeddings", True))
        return arch, config, eod
    if arch in ("gemma", "gemma2", "gemma3", "gemma3_text"):
        missing = _GEMMA + (_GEMMA_2_3 if arch != "gemma" else ())
        raise ValueError(f"model_type {arch!r} is not supported: this model cannot express "
                         f"{'; '.join(missing)}. `domino import` reads "
                         f"{', '.join(ARCHITECTURES)} models")
    if arch in LLAMA_FAMILY:
        name = _NAMES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{name} hidden_act={act!r} is not supported (only silu: SwiGLU)")
        if raw.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"{name} pretraining_tp={raw['pretraining_tp']} is not supported")
        bias = bool(raw.get("attention_bias", False))
        if arch == "llama" and bool(raw.get("mlp_bias", False)) != bias:
            raise ValueError("Llama attention_bias != mlp_bias is not supported: the output "
                             "projection's bias comes with the MLP's here (add_bias_linear)")
        if arch in _QK_NORMED and bias:
            raise ValueError(f"{name} attention_bias=true is not supported: the output "
                             "projection's bias comes with the MLP's here (add_bias_linear)")
        if raw.get("clip_qkv") is not None:
            raise ValueError(f"{name} clip_qkv={raw['clip_qkv']!r} is not supported (only null: "
                             "the Q/K/V projections are not clipped here)")
        window = _window_from_hf(raw, arch, name)
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        extra: dict[str, Any] = {}
        if kind == "llama3":
            extra = dict(rope_scaling_type="llama3", rope_scaling_factor=float(rope["factor"]),
                         rope_low_freq_factor=float(rope["low_freq_factor"]),
                         rope_high_freq_factor=float(rope["high_freq_factor"]),
                         rope_original_max_position_embeddings=int(
                             rope["original_max_position_embeddings"]))
        elif kind == "linear":
            extra = dict(rotary_seq_len_interpolation_factor=float(rope["factor"]))
        elif kind != "default":
            raise ValueError(f"{name} RoPE type {kind!r} is not supported (default, linear, "
                             "llama3)")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{name} partial_rotary_factor != 1 is not supported")
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        positions = int(raw.get("max_position_embeddings", 2048))
        config = TransformerConfig(
            num_layers=int(raw["num_hidden_layers"]), hidden_size=hidden,
            num_attention_heads=heads, vocab_size=int(raw["vocab_size"]),
            ffn_hidden_size=int(raw["intermediate_size"]),
            num_query_groups=int(raw.get("num_key_value_heads") or heads),
            kv_channels=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=positions, seq_length=min(positions, 4096),
            position_embedding_type="rope", rotary_base=theta, normalization="RMSNorm",
            activation="swiglu", add_bias_linear=bias and arch == "llama",
            add_qkv_bias=arch == "qwen2", qk_layernorm=arch in _QK_NORMED,
            qk_layernorm_full_width=arch == "olmoe",
            window_size=window,
            layernorm_epsilon=float(raw.get("rms_norm_eps", 1e-6)), hidden_dropout=0.0,
            attention_dropout=float(raw.get("attention_dropout", 0.0)),
            init_method_std=float(raw.get("initializer_range", 0.02)),
            untie_embeddings_and_output_weights=not raw.get("tie_word_embeddings", False),
            **extra, **_moe_from_hf(raw, arch, name))
        return arch, config, eod
    raise ValueError(f"model_type {arch!r} is not supported; `domino import` reads "
                     f"{', '.join(ARCHITECTURES)} models")


def _moe_from_hf(raw: dict[str, Any], arch: str, name: str) -> dict[str, Any]:
    """Our MoE settings of a Mixtral / Qwen3-MoE / OLMoE config (none for a dense family)."""
    if arch == "mixtral":
        return dict(num_experts=int(raw["num_local_experts"]),
                    moe_router_topk=int(raw["num_experts_per_tok"]),
                    moe_aux_loss_coeff=float(raw.get("router_aux_loss_coef") or 0.0))
    if arch == "olmoe":  # every layer MoE; intermediate_size is the experts'
        return dict(num_experts=int(raw["num_experts"]),
                    moe_router_topk=int(raw["num_experts_per_tok"]),
                    moe_ffn_hidden_size=int(raw["intermediate_size"]),
                    moe_router_pre_softmax=not raw.get("norm_topk_prob", False),
                    moe_aux_loss_coeff=float(raw.get("router_aux_loss_coef") or 0.0))
    if arch != "qwen3_moe":
        return {}
    step, dense = int(raw.get("decoder_sparse_step") or 1), list(raw.get("mlp_only_layers") or [])
    if step != 1 or dense != list(range(len(dense))):
        raise ValueError(f"{name} with decoder_sparse_step={step} and mlp_only_layers={dense} is "
                         "not supported: here the dense layers come first (a prefix), then "
                         "every layer is MoE")
    return dict(num_experts=int(_get(raw, "num_experts", "num_local_experts")),
                moe_router_topk=int(raw["num_experts_per_tok"]),
                moe_ffn_hidden_size=int(raw["moe_intermediate_size"]),
                moe_first_k_dense_layers=len(dense),
                moe_router_pre_softmax=not raw.get("norm_topk_prob", False),
                moe_aux_loss_coeff=float(raw.get("router_aux_loss_coef") or 0.0))


def _window_from_hf(raw: dict[str, Any], arch: str, name: str) -> int | None:
    """The sliding window every layer uses (None: full attention); ValueError when the layers
    differ (this model has one window for all of them)."""
    layers = int(raw["num_hidden_layers"])
    if arch == "llama":
        return None
    window = raw.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen slides only with use_sliding_window, on the layers from max_window_layers on.
        first = int(raw.get("max_window_layers") or 0)
        if not raw.get("use_sliding_window") or first >= layers:
            return None
        if first > 0:
            raise ValueError(f"{name} with a sliding window on layers {first}-{layers - 1} only "
                             "is not supported: one window for every layer here (or none)")
    types = raw.get("layer_types")
    if types and window is not None and len(set(types)) > 1:
        raise ValueError(f"{name} layer_types mixes {sorted(set(types))}: one attention kind "
                         "for every layer is supported here")
    if types and set(types) == {"full_attention"}:
        return None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{name} sliding_window={window!r} must be a positive integer or null")
    return window
