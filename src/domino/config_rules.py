"""The rules a :class:`~domino.config.TransformerConfig` must satisfy, one function per group of
fields; ``__post_init__`` calls them in a fixed order. Each raises ValueError with a message
that names the field and says what to change."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from domino.config import TransformerConfig

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu_tanh")
ROPE_SCALING_TYPES = ("llama3", "yarn", "longrope")


def check_sizes(cfg: TransformerConfig) -> None:
    """The sizes given: positive; the heads divide the hidden size unless kv_channels is set."""
    positive(cfg, "num_layers", "hidden_size", "num_attention_heads",
             "make_vocab_size_divisible_by", "max_position_embeddings", "seq_length")
    if cfg.vocab_size < 0:
        raise ValueError(f"vocab_size={cfg.vocab_size} must be >= 0 (0 = no embedding).")
    if cfg.kv_channels is None and cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(
            f"hidden_size={cfg.hidden_size} is not divisible by num_attention_heads="
            f"{cfg.num_attention_heads}; choose heads that divide the hidden size "
            "(or set kv_channels explicitly).")


def check_derived_sizes(cfg: TransformerConfig) -> None:
    """The sizes with defaults (given or derived): positive; the groups divide the heads."""
    positive(cfg, "ffn_hidden_size", "kv_channels", "num_query_groups", "decoder_num_layers")
    if cfg.num_attention_heads % cfg.num_query_groups:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} is not divisible by "
            f"num_query_groups={cfg.num_query_groups}; pick a group count that divides the "
            "number of heads.")


def check_choices(cfg: TransformerConfig) -> None:
    choice(cfg, "position_embedding_type", POSITION_EMBEDDING_TYPES)
    choice(cfg, "normalization", NORMALIZATIONS)
    choice(cfg, "activation", ACTIVATIONS)
    check_gated_activation(cfg)


def check_gated_activation(cfg: TransformerConfig) -> None:
    """GPT-OSS's knobs of a gated activation: SwiGLU's gate scale, the linear half's offset,
    the clamp; each at its neutral value unless the activation is gated."""
    gated = cfg.activation in ("swiglu", "geglu_tanh")
    knobs = (("swiglu_alpha", 1.0, cfg.activation == "swiglu", "> 0", "activation='swiglu'"),
             ("glu_linear_offset", 0.0, gated, "", "a gated activation (swiglu, geglu_tanh)"),
             ("activation_func_clamp_value", None, gated, "> 0",
              "a gated activation (swiglu, geglu_tanh)"))
    for name, neutral, applies, rule, needs in knobs:
        value = getattr(cfg, name)
        if value is None and neutral is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or (rule == "> 0" and value <= 0)):
            raise ValueError(f"{name}={value!r} must be a finite number{' > 0' if rule else ''} "
                             f"({neutral!r}: the plain activation).")
        if value == neutral:
            continue
        if not applies:
            raise ValueError(f"{name}={value} changes {needs}, but activation="
                             f"{cfg.activation!r}: set that activation, or {name}={neutral}.")


def check_dropout_and_window(cfg: TransformerConfig) -> None:
    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(cfg, name)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name}={p} must be in [0, 1).")
    window = cfg.window_size
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window_size={window!r} must be an integer >= 1 (the "
                         "tokens a query sees, itself included) or None for full attention.")
    layer_list(cfg, "full_attention_layers", "the layers whose attention does not slide")
    if cfg.full_attention_layers and window is None:
        raise ValueError(f"full_attention_layers={list(cfg.full_attention_layers)} exempts "
                         "layers from the sliding window, but window_size is None (no layer "
                         "slides): set window_size, or leave full_attention_layers empty.")


def check_moe(cfg: TransformerConfig) -> None:
    """The Mixture-of-Experts fields (none without ``num_experts``)."""
    if cfg.num_experts is None:
        for name in ("moe_router_bias", "moe_expert_linear_bias"):
            if getattr(cfg, name):
                raise ValueError(f"{name}=True is a bias of the MoE layers, but num_experts is "
                                 f"None (a dense model): set num_experts, or {name}=False.")
        return
    if cfg.activation == "geglu_tanh":
        raise ValueError("activation='geglu_tanh' is built for dense MLPs; the experts of an "
                         "MoE model (num_experts set) run swiglu, gelu or gelu_tanh: pick one.")
    positive(cfg, "num_experts", "moe_router_topk", "moe_layer_freq")
    if cfg.moe_router_topk > cfg.num_experts:
        raise ValueError(f"moe_router_topk={cfg.moe_router_topk} is more than num_experts="
                         f"{cfg.num_experts}: route to at most every expert.")
    positive(cfg, "moe_ffn_hidden_size")
    if cfg.moe_shared_expert_intermediate_size is not None:
        positive(cfg, "moe_shared_expert_intermediate_size")
    scale = cfg.moe_router_topk_scaling_factor
    if scale is not None and not scale > 0:
        raise ValueError(f"moe_router_topk_scaling_factor={scale} must be > 0 (or None: 1).")
    choice(cfg, "moe_router_score_function", ("softmax", "sigmoid"))
    choice(cfg, "moe_router_load_balancing_type", ("aux_loss", "none"))
    choice(cfg, "moe_token_drop_policy", ("probs", "position"))
    if not 0 <= cfg.moe_first_k_dense_layers <= cfg.num_layers:
        raise ValueError(f"moe_first_k_dense_layers={cfg.moe_first_k_dense_layers} must be "
                         f"between 0 and num_layers={cfg.num_layers}.")
    factor = cfg.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        raise ValueError(f"moe_expert_capacity_factor={factor} must be > 0 (or None: "
                         "dropless routing).")
    if cfg.moe_pad_expert_input_to_capacity and factor is None:
        raise ValueError("moe_pad_expert_input_to_capacity needs a "
                         "moe_expert_capacity_factor (dropless routing has no capacity).")
    if cfg.moe_aux_loss_coeff < 0 or (cfg.moe_z_loss_coeff or 0.0) < 0:
        raise ValueError("moe_aux_loss_coeff and moe_z_loss_coeff must be >= 0.")


def check_rope(cfg: TransformerConfig) -> None:
    """RoPE's fields (the base and fraction whatever the position embedding)."""
    if not 0.0 < cfg.rotary_percent <= 1.0:
        raise ValueError(f"rotary_percent={cfg.rotary_percent} must be in (0, 1].")
    if cfg.position_embedding_type == "rope":
        rot = int(cfg.kv_channels * cfg.rotary_percent)
        if rot < 2 or rot % 2:
            raise ValueError(
                f"RoPE rotates int(kv_channels * rotary_percent) = {rot} channels per head; "
                "it must be even and >= 2: change rotary_percent or kv_channels.")
    if not (isinstance(cfg.rotary_base, int | float) and math.isfinite(cfg.rotary_base)
            and cfg.rotary_base > 1):
        raise ValueError(f"rotary_base={cfg.rotary_base!r} must be a finite number > 1.")
    if cfg.rope_scaling_type is not None:
        check_rope_scaling(cfg)
    for name in ("rope_short_factor", "rope_long_factor"):
        value = getattr(cfg, name)
        if isinstance(value, list | tuple) and not value:
            setattr(cfg, name, ())  # (a saved config's [] reads back equal)
        elif cfg.rope_scaling_type != "longrope":
            raise ValueError(f"{name}={value!r} is set, but rope_scaling_type="
                             f"{cfg.rope_scaling_type!r}: the factors are longrope's; set "
                             f"rope_scaling_type='longrope', or leave {name} empty.")
    check_nope_layers(cfg)
    check_local_rotary_base(cfg)
    if (cfg.rotary_seq_len_interpolation_factor is not None
            and cfg.rotary_seq_len_interpolation_factor <= 0):
        raise ValueError(
            "rotary_seq_len_interpolation_factor="
            f"{cfg.rotary_seq_len_interpolation_factor} must be > 0 (or None).")


def layer_list(cfg: TransformerConfig, name: str, what: str) -> None:
    """Field ``name``: distinct layer numbers (0-based) below num_layers, kept as a sorted
    tuple (a saved config's list reads back equal)."""
    layers = getattr(cfg, name)
    if not isinstance(layers, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.num_layers
            for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"{name}={layers!r} must be distinct layer numbers in [0, "
                         f"num_layers={cfg.num_layers}) ({what}; empty: none).")
    setattr(cfg, name, tuple(sorted(layers)))


def check_nope_layers(cfg: TransformerConfig) -> None:
    """The layers without RoPE: a layer list, only with RoPE."""
    layer_list(cfg, "nope_layers", "the layers without RoPE")
    layers = cfg.nope_layers
    if layers and cfg.position_embedding_type != "rope":
        raise ValueError(f"nope_layers={list(layers)} turns RoPE off on some layers; it needs "
                         "position_embedding_type='rope' (got "
                         f"{cfg.position_embedding_type!r}): set it, or leave nope_layers empty.")


def check_local_rotary_base(cfg: TransformerConfig) -> None:
    """Gemma 3's RoPE base of the sliding layers: a number > 1, with RoPE and a window."""
    base = cfg.local_rotary_base
    if base is None:
        return
    if (isinstance(base, bool) or not isinstance(base, int | float) or not math.isfinite(base)
            or base <= 1):
        raise ValueError(f"local_rotary_base={base!r} must be a finite number > 1 (or None: "
                         "the sliding layers' RoPE is every layer's).")
    if cfg.position_embedding_type != "rope" or cfg.window_size is None:
        raise ValueError(
            f"local_rotary_base={base} is the RoPE base of the sliding-window layers; it needs "
            f"position_embedding_type='rope' and a window_size (got "
            f"{cfg.position_embedding_type!r}, window_size={cfg.window_size}): set them, or "
            "leave local_rotary_base None.")
    cfg.local_rotary_base = float(base)


def check_rope_scaling(cfg: TransformerConfig) -> None:
    """Llama 3.1's or YaRN's RoPE frequency scaling."""
    choice(cfg, "rope_scaling_type", ROPE_SCALING_TYPES)
    if cfg.rope_scaling_type == "yarn":
        check_yarn(cfg)
        return
    if cfg.rope_scaling_type == "longrope":
        check_longrope(cfg)
        return
    if not (cfg.rope_scaling_factor > 0
            and 0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor
            and cfg.rope_original_max_position_embeddings > 0):
        raise ValueError(
            "llama3 RoPE scaling needs rope_scaling_factor > 0, 0 < rope_low_freq_factor "
            "< rope_high_freq_factor and rope_original_max_position_embeddings > 0; got "
            f"{cfg.rope_scaling_factor}, {cfg.rope_low_freq_factor}, "
            f"{cfg.rope_high_freq_factor}, {cfg.rope_original_max_position_embeddings}.")


def check_yarn(cfg: TransformerConfig) -> None:
    """YaRN's settings: finite numbers > 0 (its attention factor may be None: derived)."""
    names = ("rope_scaling_factor", "rope_yarn_beta_fast", "rope_yarn_beta_slow",
             "rope_attention_factor")
    for name in names:
        value = getattr(cfg, name)
        if value is None and name == "rope_attention_factor":
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name}={value!r} must be a finite number > 0 for yarn RoPE "
                             "scaling" + (" (or None: 0.1 ln(factor) + 1)."
                                          if name == "rope_attention_factor" else "."))
    if cfg.rope_original_max_position_embeddings < 1:
        raise ValueError("rope_original_max_position_embeddings="
                         f"{cfg.rope_original_max_position_embeddings} must be >= 1 (the "
                         "context length before yarn scaling).")


def check_longrope(cfg: TransformerConfig) -> None:
    """LongRoPE's settings: with RoPE alone (no interpolation, no local base), a factor > 0 per
    rotated channel pair in each list (kept as tuples of floats), an original length > 1."""
    if (cfg.position_embedding_type != "rope" or cfg.rotary_seq_len_interpolation_factor
            is not None or cfg.local_rotary_base is not None):
        raise ValueError(
            "rope_scaling_type='longrope' needs position_embedding_type='rope' without "
            "rotary_seq_len_interpolation_factor or local_rotary_base (got "
            f"{cfg.position_embedding_type!r}, {cfg.rotary_seq_len_interpolation_factor}, "
            f"{cfg.local_rotary_base}): set RoPE, leave the others None.")
    pairs = int(cfg.kv_channels * cfg.rotary_percent) // 2
    for name in ("rope_short_factor", "rope_long_factor"):
        value = getattr(cfg, name)
        if not (isinstance(value, list | tuple) and len(value) == pairs and all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                and x > 0 for x in value)):
            raise ValueError(
                f"{name}={value!r} must be {pairs} numbers > 0 (one per rotated channel pair: "
                "int(kv_channels * rotary_percent) / 2) for longrope RoPE scaling.")
        setattr(cfg, name, tuple(float(x) for x in value))
    factor, attention = cfg.rope_scaling_factor, cfg.rope_attention_factor
    if (isinstance(factor, bool) or not isinstance(factor, int | float)
            or not math.isfinite(factor) or factor <= 0):
        raise ValueError(f"rope_scaling_factor={factor!r} must be a finite number > 0 for "
                         "longrope RoPE scaling.")
    if attention is not None and (isinstance(attention, bool) or not isinstance(
            attention, int | float) or not math.isfinite(attention) or attention <= 0):
        raise ValueError(f"rope_attention_factor={attention!r} must be a finite number > 0 "
                         "(or None: derived from rope_scaling_factor).")
    positive(cfg, "rope_original_max_position_embeddings")
    if cfg.rope_original_max_position_embeddings < 2:
        raise ValueError("rope_original_max_position_embeddings=1 must be >= 2 for longrope "
                         "RoPE scaling (its attention factor divides by ln of it).")


def check_positions_and_norms(cfg: TransformerConfig) -> None:
    if (cfg.position_embedding_type == "learned_absolute"
            and cfg.seq_length > cfg.max_position_embeddings):
        raise ValueError(
            f"seq_length={cfg.seq_length} is longer than max_position_embeddings="
            f"{cfg.max_position_embeddings}: the learned position table has no rows for the "
            "extra positions; raise max_position_embeddings or shorten seq_length.")
    if cfg.qk_layernorm_full_width and not (cfg.qk_layernorm
                                            and cfg.normalization == "RMSNorm"):
        raise ValueError(
            "qk_layernorm_full_width=True normalises the queries and keys over their whole "
            f"width with RMSNorm; it needs qk_layernorm=True and normalization='RMSNorm' "
            f"(got qk_layernorm={cfg.qk_layernorm}, normalization={cfg.normalization!r}).")
    if cfg.layernorm_epsilon <= 0:
        raise ValueError(f"layernorm_epsilon={cfg.layernorm_epsilon} must be > 0.")
    if cfg.norm_after_sublayer and cfg.apply_residual_connection_post_layernorm:
        raise ValueError(
            "norm_after_sublayer=True normalises each sublayer's output, so no norm output "
            "exists to take the residual from; it needs "
            "apply_residual_connection_post_layernorm=False.")
    if cfg.norm_after_sublayer and cfg.sandwich_norms:
        raise ValueError(
            "norm_after_sublayer=True (a norm after each sublayer instead of before) and "
            "sandwich_norms=True (norms before and after) are two layouts; set one of them.")


def check_multipliers(cfg: TransformerConfig) -> None:
    """Granite's scalars and Gemma's caps: finite numbers > 0 (softmax_scale and the caps may
    be None: 1/sqrt(d), no cap)."""
    optional = ("softmax_scale", "attention_softcap", "output_softcap")
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling", *optional):
        value = getattr(cfg, name)
        if value is None and name in optional:
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or value <= 0):
            unset = {"softmax_scale": "1/sqrt(kv_channels)", "attention_softcap": "no cap",
                     "output_softcap": "no cap"}.get(name)
            raise ValueError(f"{name}={value!r} must be a finite number > 0 (" + (
                f"None: {unset})." if unset else "1 changes nothing)."))


def check_init(cfg: TransformerConfig) -> None:
    if cfg.init_method_std <= 0:
        raise ValueError(f"init_method_std={cfg.init_method_std} must be > 0.")
    if not isinstance(cfg.params_dtype, torch.dtype) or not cfg.params_dtype.is_floating_point:
        raise ValueError(f"params_dtype={cfg.params_dtype} must be a floating torch.dtype.")


def positive(cfg: TransformerConfig, *names: str) -> None:
    """Each named field is an int >= 1 (not a bool)."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")


def choice(cfg: TransformerConfig, name: str, choices: tuple[str, ...]) -> None:
    """Field ``name`` is one of ``choices``."""
    value = getattr(cfg, name)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}.")
