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

import json
from pathlib import Path
from typing import Any

from domino.checkpoint.hf_keys import FIX_PAIR, GPT2_KEYS, LLAMA_KEYS, MOE_KEYS, HFKeys, hf_key
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


# ---- reading a config.json --------------------------------------------------------------------


def config_from_hf(raw: dict[str, Any], path: str | Path = "config.json",
                   ) -> tuple[str, TransformerConfig, int | None]:
    """(architecture, our config, end-of-text id) of a ``config.json`` read from ``path``;
    ValueError naming the file and the key, and what is wrong with it: missing, null or of the
    wrong type or range, or a setting we cannot represent."""
    keys = HFKeys(raw, path)
    arch = keys.text("model_type", rule=f"the architecture, one of {', '.join(ARCHITECTURES)}")
    eos = raw.get("eos_token_id")
    eod = eos[0] if isinstance(eos, list) and eos else None if isinstance(eos, list) else eos
    if eod is not None and (not isinstance(eod, int) or isinstance(eod, bool) or eod < 0):
        keys.wrong("eos_token_id", eos, "a token id (an integer >= 0), a list of them, or null")
    if arch == "gpt2":
        return arch, _gpt2_from_hf(keys), eod
    if arch in ("gemma", "gemma2", "gemma3", "gemma3_text"):
        missing = _GEMMA + (_GEMMA_2_3 if arch != "gemma" else ())
        keys.refuse(f"model_type {arch!r} is not supported: this model cannot express "
                    f"{'; '.join(missing)}. `domino import` reads {', '.join(ARCHITECTURES)} "
                    "models")
    if arch in LLAMA_FAMILY:
        return arch, _llama_from_hf(keys, arch), eod
    keys.refuse(f"model_type {arch!r} is not supported; `domino import` reads "
                f"{', '.join(ARCHITECTURES)} models")


def _gpt2_from_hf(keys: HFKeys) -> TransformerConfig:
    for key, ok in (("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False), ("add_cross_attention", False),
                    ("scale_attn_weights", True)):
        if keys.flag(key, ok) != ok:
            keys.refuse(f"GPT-2 config {key}={json.dumps(not ok)} is not supported (only "
                        f"{json.dumps(ok)})")
    act = keys.text("activation_function", "gelu_new")
    if act not in _GELU_FROM_HF:
        keys.refuse(f"GPT-2 activation_function={act!r} is not supported; one of "
                    f"{', '.join(_GELU_FROM_HF)}")
    hidden, heads = keys.integer(("n_embd", "hidden_size")), keys.integer(
        ("n_head", "num_attention_heads"))
    if hidden % heads:
        keys.refuse(f'"n_embd" ({hidden}) is not divisible by "n_head" ({heads}): GPT-2 splits '
                    f"the width evenly among the heads; {FIX_PAIR}")
    positions = keys.integer(("n_positions", "max_position_embeddings"))
    return keys.build(
        GPT2_KEYS, num_layers=keys.integer(("n_layer", "num_hidden_layers")),
        hidden_size=hidden, num_attention_heads=heads, vocab_size=keys.integer("vocab_size"),
        ffn_hidden_size=keys.integer("n_inner", None), max_position_embeddings=positions,
        seq_length=positions, activation=_GELU_FROM_HF[act],
        layernorm_epsilon=keys.number("layer_norm_epsilon", 1e-5, rule="> 0"),
        hidden_dropout=keys.number("resid_pdrop", 0.0, rule="in [0, 1)"),
        attention_dropout=keys.number("attn_pdrop", 0.0, rule="in [0, 1)"),
        init_method_std=keys.number("initializer_range", 0.02, rule="> 0"),
        untie_embeddings_and_output_weights=not keys.flag("tie_word_embeddings", True))


def _llama_from_hf(keys: HFKeys, arch: str) -> TransformerConfig:
    """Our config of a Llama-family ``config.json`` (``arch``: its model_type)."""
    name = _NAMES[arch]
    bias = _llama_bias(keys, arch, name)
    rope, theta, extra = _rope_from_hf(keys, name)
    positions = keys.integer("max_position_embeddings", 2048)
    layers = keys.integer("num_hidden_layers")
    names = {k: hf_key(arch, k, rope) for k in (*LLAMA_KEYS, *MOE_KEYS.get(arch, {}))}
    if arch == "qwen3_moe":
        names["num_experts"] = keys.found("num_experts", "num_local_experts")
    return keys.build(
        names, num_layers=layers, vocab_size=keys.integer("vocab_size"),
        ffn_hidden_size=keys.integer("intermediate_size"), **_heads_from_hf(keys),
        max_position_embeddings=positions, seq_length=min(positions, 4096),
        position_embedding_type="rope", rotary_base=theta, normalization="RMSNorm",
        activation="swiglu", add_bias_linear=bias and arch == "llama",
        add_qkv_bias=arch == "qwen2", qk_layernorm=arch in _QK_NORMED,
        qk_layernorm_full_width=arch == "olmoe", window_size=_window_from_hf(keys, arch, name),
        layernorm_epsilon=keys.number("rms_norm_eps", 1e-6, rule="> 0"), hidden_dropout=0.0,
        attention_dropout=keys.number("attention_dropout", 0.0, rule="in [0, 1)"),
        init_method_std=keys.number("initializer_range", 0.02, rule="> 0"),
        untie_embeddings_and_output_weights=not keys.flag("tie_word_embeddings", False),
        **extra, **_moe_from_hf(keys, arch, name, layers))


def _llama_bias(keys: HFKeys, arch: str, name: str) -> bool:
    """attention_bias, after the checks of what this model cannot express."""
    act = keys.text("hidden_act", "silu")
    if act != "silu":
        keys.refuse(f"{name} hidden_act={act!r} is not supported (only silu: SwiGLU)")
    tp = keys.integer("pretraining_tp", None)
    if tp not in (None, 1):
        keys.refuse(f"{name} pretraining_tp={tp} is not supported (only 1)")
    bias = keys.flag("attention_bias", False)
    if arch == "llama" and keys.flag("mlp_bias", False) != bias:
        keys.refuse("Llama attention_bias != mlp_bias is not supported: the output "
                    "projection's bias comes with the MLP's here (add_bias_linear)")
    if arch in _QK_NORMED and bias:
        keys.refuse(f"{name} attention_bias=true is not supported: the output projection's "
                    "bias comes with the MLP's here (add_bias_linear)")
    if keys.raw.get("clip_qkv") is not None:
        keys.refuse(f"{name} clip_qkv={keys.raw['clip_qkv']!r} is not supported (only null: "
                    "the Q/K/V projections are not clipped here)")
    return bias


def _heads_from_hf(keys: HFKeys) -> dict[str, Any]:
    """hidden_size, the heads and the head size, checked against each other."""
    heads, hidden = keys.integer("num_attention_heads"), keys.integer("hidden_size")
    groups = keys.integer("num_key_value_heads", None) or heads
    if heads % groups:
        keys.refuse(f'"num_attention_heads" ({heads}) is not divisible by "num_key_value_heads" '
                    f"({groups}): each key/value head serves a whole number of query heads; "
                    f"{FIX_PAIR}")
    size = keys.integer("head_dim", None)
    what = f'"head_dim" ({size})'
    if size is None:
        if hidden % heads:
            keys.refuse(f'"hidden_size" ({hidden}) is not divisible by "num_attention_heads" '
                        f'({heads}) and no "head_dim" is set; {FIX_PAIR}')
        size = hidden // heads
        what = f'the head size "hidden_size" / "num_attention_heads" ({size}; no "head_dim")'
    if size % 2:
        keys.refuse(f"{what} must be even: RoPE rotates pairs of channels; {FIX_PAIR}")
    return dict(hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                kv_channels=size)


def _rope_from_hf(keys: HFKeys, name: str) -> tuple[str, float, dict[str, Any]]:
    """(the key holding the RoPE settings, rope_theta, our scaling settings)."""
    rope = "rope_parameters" if keys.raw.get("rope_parameters") else "rope_scaling"
    kind = keys.text((f"{rope}.rope_type", f"{rope}.type"), "default")
    theta = keys.number((f"{rope}.rope_theta", "rope_theta"), 10000.0, rule="> 1")
    extra: dict[str, Any] = {}
    if kind == "llama3":
        low, high = (keys.number(f"{rope}.{k}", rule="> 0")
                     for k in ("low_freq_factor", "high_freq_factor"))
        if low >= high:
            keys.refuse(f'"{rope}.low_freq_factor" ({low}) must be below '
                        f'"{rope}.high_freq_factor" ({high}); {FIX_PAIR}')
        extra = dict(rope_scaling_type="llama3",
                     rope_scaling_factor=keys.number(f"{rope}.factor", rule="> 0"),
                     rope_low_freq_factor=low, rope_high_freq_factor=high,
                     rope_original_max_position_embeddings=keys.integer(
                         f"{rope}.original_max_position_embeddings"))
    elif kind == "linear":
        extra = dict(rotary_seq_len_interpolation_factor=keys.number(f"{rope}.factor",
                                                                     rule="> 0"))
    elif kind != "default":
        keys.refuse(f"{name} RoPE type {kind!r} is not supported (default, linear, llama3)")
    if keys.number(f"{rope}.partial_rotary_factor", None) not in (None, 1.0):
        keys.refuse(f"{name} partial_rotary_factor != 1 is not supported")
    return rope, theta, extra


def _moe_from_hf(keys: HFKeys, arch: str, name: str, layers: int) -> dict[str, Any]:
    """Our MoE settings of a Mixtral / Qwen3-MoE / OLMoE config (none for a dense family)."""
    if arch not in ("mixtral", "olmoe", "qwen3_moe"):
        return {}
    names = {"mixtral": ("num_local_experts",), "olmoe": ("num_experts",)}.get(
        arch, ("num_experts", "num_local_experts"))
    experts, topk = keys.integer(names), keys.integer("num_experts_per_tok")
    count = keys.found(*names)
    if topk > experts:
        keys.refuse(f'"num_experts_per_tok" ({topk}) is more than "{count}" ({experts}): a '
                    f"token is routed to at most every expert; {FIX_PAIR}")
    out = dict(num_experts=experts, moe_router_topk=topk, moe_aux_loss_coeff=keys.number(
        "router_aux_loss_coef", None, rule=">= 0") or 0.0)
    if arch == "mixtral":
        return out
    out["moe_router_pre_softmax"] = not keys.flag("norm_topk_prob", False)
    if arch == "olmoe":  # every layer MoE; intermediate_size is the experts'
        return {**out, "moe_ffn_hidden_size": keys.integer("intermediate_size")}
    step = keys.integer("decoder_sparse_step", None) or 1
    _, dense = keys.value("mlp_only_layers", None, "a list of layer numbers")
    dense = [] if dense is None else dense
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              and i >= 0 for i in dense):
        keys.wrong("mlp_only_layers", dense, "a list of layer numbers (integers >= 0)")
    if step != 1 or dense != list(range(len(dense))):
        keys.refuse(f"{name} with decoder_sparse_step={step} and mlp_only_layers={dense} is "
                    "not supported: here the dense layers come first (a prefix), then every "
                    "layer is MoE")
    if len(dense) > layers:
        keys.refuse(f'"mlp_only_layers" lists {len(dense)} layers, more than the '
                    f'"num_hidden_layers" ({layers}); {FIX_PAIR}')
    return {**out, "moe_ffn_hidden_size": keys.integer("moe_intermediate_size"),
            "moe_first_k_dense_layers": len(dense)}


def _window_from_hf(keys: HFKeys, arch: str, name: str) -> int | None:
    """The sliding window every layer uses (None: full attention); ValueError when the layers
    differ (this model has one window for all of them)."""
    layers = keys.integer("num_hidden_layers")
    if arch == "llama":
        return None
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen slides only with use_sliding_window, on the layers from max_window_layers on.
        first = keys.integer("max_window_layers", None, minimum=0) or 0
        if not keys.flag("use_sliding_window", False) or first >= layers:
            return None
        if first > 0:
            keys.refuse(f"{name} with a sliding window on layers {first}-{layers - 1} only is "
                        "not supported: one window for every layer here (or none)")
    window = keys.integer("sliding_window", None)
    _, types = keys.value("layer_types", None, "a list of attention kinds")
    if types is not None and not (isinstance(types, list)
                                  and all(isinstance(t, str) for t in types)):
        keys.wrong("layer_types", types, 'a list of attention kinds ("full_attention", '
                   '"sliding_attention")')
    if types and window is not None and len(set(types)) > 1:
        keys.refuse(f"{name} layer_types mixes {sorted(set(types))}: one attention kind for "
                    "every layer is supported here")
    if types and set(types) == {"full_attention"}:
        return None
    return window
