"""The Llama layout and the Llama family's refusal: RMSNorm, SwiGLU, RoPE (float theta, llama3
or linear scaling), grouped-query attention with any head size, ``q_proj`` / ``k_proj`` /
``v_proj`` apart. Its members (Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE, OLMoE) differ
in a few config keys and features; each is a module that passes those to the pieces here
(StarCoder2 reuses the layout, the heads and RoPE readers with its own norm and MLP)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from domino.checkpoint.families import common
from domino.checkpoint.families.family import Family, Group
from domino.checkpoint.families.weights import (
    FINAL_NORM,
    ApartQKV,
    Experts,
    GateUp,
    Heads,
    Link,
    Same,
    layer,
    suffixes,
)
from domino.checkpoint.hf_keys import FIX_PAIR, HFKeys
from domino.config import TransformerConfig

KEYS = {"num_layers": "num_hidden_layers", "num_query_groups": "num_key_value_heads",
        "kv_channels": "head_dim", "ffn_hidden_size": "intermediate_size",
        "seq_length": "max_position_embeddings", "layernorm_epsilon": "rms_norm_eps",
        "init_method_std": "initializer_range", "window_size": "sliding_window",
        "rotary_base": "rope_theta", "num_experts": "num_experts",
        "moe_router_topk": "num_experts_per_tok",
        "moe_ffn_hidden_size": "moe_intermediate_size",
        "moe_first_k_dense_layers": "mlp_only_layers",
        "moe_aux_loss_coeff": "router_aux_loss_coef",
        "rope_scaling_factor": "rope_scaling.factor",
        "rotary_seq_len_interpolation_factor": "rope_scaling.factor",
        "rope_low_freq_factor": "rope_scaling.low_freq_factor",
        "rope_high_freq_factor": "rope_scaling.high_freq_factor",
        "rope_original_max_position_embeddings":
            "rope_scaling.original_max_position_embeddings"}
GATED = ("gate_proj", "up_proj", "down_proj")


# ---- what the family cannot express -----------------------------------------------------------


def rope_obstacles(config: TransformerConfig, name: str) -> list[str]:
    """RoPE settings unlike a family's that rotates whole heads (``name``: the family's)."""
    out = []
    if config.position_embedding_type != "rope":
        out.append(f"{config.position_embedding_type} positions ({name} has RoPE)")
    elif config.rotary_percent != 1.0:
        out.append(f"RoPE on {config.rotary_percent:.0%} of each head ({name} rotates all)")
    if config.rope_scaling_type is not None and config.rotary_seq_len_interpolation_factor:
        out.append("both RoPE position interpolation and llama3 scaling")
    return out


def _obstacles(config: TransformerConfig) -> list[str]:
    out = common.obstacles(config)
    if config.normalization != "RMSNorm":
        out.append(f"{config.normalization} (Llama has RMSNorm)")
    if config.activation != "swiglu":
        out.append(f"{config.activation} (Llama has SwiGLU)")
    return out + rope_obstacles(config, "Llama") + _attention(config)


def _attention(config: TransformerConfig) -> list[str]:
    """Attention settings no member has together."""
    out = []
    if config.window_size is not None and config.add_bias_linear:
        out.append("sliding-window attention with every bias (Llama has no window; Qwen2, "
                   "Qwen3 and Mistral have no output or MLP bias)")
    if config.qk_layernorm and (config.add_bias_linear or config.add_qkv_bias):
        out.append("query/key norms with biases (Qwen3, Qwen3-MoE and OLMoE, the members "
                   "with the norms, have none)")
    if config.qk_layernorm_full_width:
        if config.num_experts is None and not config.norm_after_sublayer:
            out.append("query/key norms over all heads in a dense model with norms before the "
                       "sublayers (of the family only OLMoE, a Mixture of Experts, and OLMo 2, "
                       "with norms after them, have them)")
        elif config.kv_channels * config.num_attention_heads != config.hidden_size:
            name = "OLMoE" if config.num_experts is not None else "OLMo 2"
            out.append(f"heads x head size != hidden size ({name}'s query norm spans "
                       "hidden_size)")
    return out


GROUP = Group("the Llama family", "Llama", _obstacles)


def dense_or_not(config: TransformerConfig, family: Family) -> list[str]:
    """The MoE layers a dense member lacks, or the dense MLPs an MoE member lacks."""
    if family.experts and config.num_experts is None:
        return [f"no Mixture-of-Experts layers ({family.name} has them)"]
    if not family.experts and config.num_experts is not None:
        return [f"Mixture-of-Experts layers ({family.name} is dense)"]
    return []


def plain_obstacles(config: TransformerConfig, family: Family, *,
                    window: bool = False) -> list[str]:
    """What a member with Llama's own attention lacks: query/key norms and a bias on Q/K/V
    alone (its biases come all or none), and, unless ``window``, a sliding window."""
    out = dense_or_not(config, family)
    if config.qk_layernorm:
        out.append(f"query/key norms ({family.name} has none)")
    if config.add_qkv_bias and not config.add_bias_linear:
        out.append(f"a bias on Q/K/V only ({family.name}'s come with the output's and the "
                   "MLP's)")
    if not window and config.window_size is not None:
        out.append(f"sliding-window attention ({family.name} has none)")
    return out


# ---- config.json ------------------------------------------------------------------------------


def rope_json(config: TransformerConfig) -> dict[str, Any]:
    """``rope_parameters``, and the ``rope_theta`` / ``rope_scaling`` transformers < 5 reads."""
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
    return {"rope_parameters": rope, "rope_theta": config.rotary_base,
            "rope_scaling": None if rope["rope_type"] == "default" else legacy}


def config_json(config: TransformerConfig, family: Family) -> dict[str, Any]:
    """Llama's ``config.json`` keys for ``family`` (each member drops and adds its own)."""
    return {
        "model_type": family.model_type, "architectures": list(family.classes),
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon, "initializer_range": config.init_method_std,
        "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        **rope_json(config), "pretraining_tp": 1,
        "torch_dtype": "float32",
    }


def without(out: dict[str, Any], *keys: str) -> dict[str, Any]:
    for key in keys:
        del out[key]
    return out


def qwen_window_json(config: TransformerConfig) -> dict[str, Any]:
    """A Qwen window: one on every layer (from max_window_layers 0), or none."""
    return dict(use_sliding_window=config.window_size is not None,
                sliding_window=config.window_size, max_window_layers=0)


# ---- reading a config.json --------------------------------------------------------------------

Window = Callable[[HFKeys, str], "int | None"]
Bias = Callable[[HFKeys, bool, str], bool]
MoE = Callable[[HFKeys, str, int], dict[str, Any]]


def ignore_bias(keys: HFKeys, bias: bool, name: str) -> bool:
    """No bias on the output or MLP (attention_bias, if set, is not the family's key)."""
    return False


def mlp_bias_too(keys: HFKeys, bias: bool, name: str) -> bool:
    """attention_bias (Q, K, V and the output) must equal mlp_bias: the output projection's
    bias comes with the MLP's here."""
    if keys.flag("mlp_bias", False) != bias:
        keys.refuse(f"{name} attention_bias != mlp_bias is not supported: the output "
                    "projection's bias comes with the MLP's here (add_bias_linear)")
    return bias


def refuse_bias(keys: HFKeys, bias: bool, name: str) -> bool:
    """The members with query/key norms have no bias."""
    if bias:
        keys.refuse(f"{name} attention_bias=true is not supported: the output projection's "
                    "bias comes with the MLP's here (add_bias_linear)")
    return False


def read_config(keys: HFKeys, family: Family, *, window: Window, bias: Bias = ignore_bias,
                experts: MoE | None = None,
                alternatives: Mapping[str, tuple[str, ...]] | None = None) -> TransformerConfig:
    """Our config of a Llama-family ``config.json``: ``window`` reads the sliding window,
    ``bias`` gives add_bias_linear from attention_bias (after its checks), ``experts`` the MoE
    settings; ``alternatives``: fields whose key is the first set of several."""
    name = family.name
    add_bias = _checked_bias(keys, name, bias)
    rope, theta, extra = read_rope(keys, name)
    positions = keys.integer("max_position_embeddings", 2048)
    layers = keys.integer("num_hidden_layers")
    names = family.names(rope)
    names.update({k: keys.found(*v) for k, v in (alternatives or {}).items()})
    features = {"add_qkv_bias": False, "qk_layernorm": False, "qk_layernorm_full_width": False,
                **family.features}
    return keys.build(
        names, num_layers=layers, vocab_size=keys.integer("vocab_size"),
        ffn_hidden_size=keys.integer("intermediate_size"), **read_heads(keys),
        max_position_embeddings=positions, seq_length=min(positions, 4096),
        position_embedding_type="rope", rotary_base=theta, normalization="RMSNorm",
        activation="swiglu", add_bias_linear=add_bias, **features,
        window_size=window(keys, name),
        layernorm_epsilon=keys.number("rms_norm_eps", 1e-6, rule="> 0"), hidden_dropout=0.0,
        attention_dropout=keys.number("attention_dropout", 0.0, rule="in [0, 1)"),
        init_method_std=keys.number("initializer_range", 0.02, rule="> 0"),
        untie_embeddings_and_output_weights=not keys.flag("tie_word_embeddings", False),
        **extra, **(experts(keys, name, layers) if experts is not None else {}))


def _checked_bias(keys: HFKeys, name: str, bias: Bias) -> bool:
    """add_bias_linear, after the checks of what this model cannot express."""
    act = keys.text("hidden_act", "silu")
    if act != "silu":
        keys.refuse(f"{name} hidden_act={act!r} is not supported (only silu: SwiGLU)")
    tp = keys.integer("pretraining_tp", None)
    if tp not in (None, 1):
        keys.refuse(f"{name} pretraining_tp={tp} is not supported (only 1)")
    add_bias = bias(keys, keys.flag("attention_bias", False), name)
    if keys.raw.get("clip_qkv") is not None:
        keys.refuse(f"{name} clip_qkv={keys.raw['clip_qkv']!r} is not supported (only null: "
                    "the Q/K/V projections are not clipped here)")
    return add_bias


def read_heads(keys: HFKeys) -> dict[str, Any]:
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


def read_rope(keys: HFKeys, name: str, rope: str | None = None,
              ) -> tuple[str, float, dict[str, Any]]:
    """(the key holding the RoPE settings, rope_theta, our scaling settings); ``rope``: that
    key (default: rope_parameters, else rope_scaling; Gemma 3's are per kind of layer)."""
    rope = rope or ("rope_parameters" if keys.raw.get("rope_parameters") else "rope_scaling")
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
        keys.refuse(f"{name} RoPE type {kind!r} is not supported (default, linear, llama3), "
                    f'set in "{rope}.rope_type"')
    if keys.number(f"{rope}.partial_rotary_factor", None) not in (None, 1.0):
        keys.refuse(f"{name} partial_rotary_factor != 1 is not supported")
    return rope, theta, extra


def no_window(keys: HFKeys, name: str) -> None:
    """Full attention on every layer."""
    return None


def qwen_window(keys: HFKeys, name: str) -> int | None:
    """Qwen slides only with use_sliding_window, on the layers from max_window_layers on."""
    layers = keys.integer("num_hidden_layers")
    first = keys.integer("max_window_layers", None, minimum=0) or 0
    if not keys.flag("use_sliding_window", False) or first >= layers:
        return None
    if first > 0:
        keys.refuse(f"{name} with a sliding window on layers {first}-{layers - 1} only is "
                    "not supported: one window for every layer here (or none)")
    return every_layer_window(keys, name)


def every_layer_window(keys: HFKeys, name: str) -> int | None:
    """The sliding window every layer uses (None: full attention); ValueError when the layers
    differ (this model has one window for all of them)."""
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


def read_experts(keys: HFKeys, count: tuple[str, ...]) -> dict[str, Any]:
    """The expert count (under the first set key of ``count``), top-k and aux-loss weight."""
    experts, topk = keys.integer(count), keys.integer("num_experts_per_tok")
    if topk > experts:
        keys.refuse(f'"num_experts_per_tok" ({topk}) is more than "{keys.found(*count)}" '
                    f"({experts}): a token is routed to at most every expert; {FIX_PAIR}")
    return dict(num_experts=experts, moe_router_topk=topk, moe_aux_loss_coeff=keys.number(
        "router_aux_loss_coef", None, rule=">= 0") or 0.0)


# ---- weights ----------------------------------------------------------------------------------


def layout(config: TransformerConfig, *, mlp: tuple[str, ...] = GATED,
           experts: tuple[str, str, str, str] | None = None) -> list[Link]:
    """The weight-name map: ``mlp`` names the dense MLP's projections (gate, up, down: SwiGLU;
    in, out: one activation), ``experts`` an MoE layer's block and its experts' gate, up and
    down projections. LayerNorms have a bias, RMSNorms none."""
    out: list[Link] = []
    norm = suffixes(config.normalization == "LayerNorm")
    for i in range(config.num_layers):
        a, h = layer(i), f"model.layers.{i}."
        out += [Same(a + "input_layernorm." + x, h + "input_layernorm." + x) for x in norm]
        out += _attention_links(config, a, h)
        out += [Same(a + "post_attention_layernorm." + x, h + "post_attention_layernorm." + x)
                for x in norm]
        if config.is_moe_layer(i):
            block, *names = experts
            out.append(Experts(a + "mlp.moe.", h + block + ".", tuple(names),
                               config.num_experts, config.moe_ffn_hidden_size))
        else:
            out += _mlp_links(config, a, h, mlp)
    return out + [Same(FINAL_NORM + x, "model.norm." + x) for x in norm]


def _attention_links(config: TransformerConfig, a: str, h: str) -> list[Link]:
    heads = Heads.of(config)
    out: list[Link] = [Same(a + f"self_attention.{x}_layernorm.weight",
                            h + f"self_attn.{x}_norm.weight")
                       for x in (("q", "k") if config.qk_layernorm else ())]
    out += [ApartQKV(a + "self_attention.query_key_value." + x,
                     tuple(f"{h}self_attn.{p}.{x}" for p in ("q_proj", "k_proj", "v_proj")),
                     heads) for x in suffixes(config.add_bias_linear or config.add_qkv_bias)]
    return out + [Same(a + "self_attention.dense." + x, h + "self_attn.o_proj." + x)
                  for x in suffixes(config.add_bias_linear)]


def _mlp_links(config: TransformerConfig, a: str, h: str, mlp: tuple[str, ...]) -> list[Link]:
    *ins, down = mlp
    out: list[Link] = []
    for x in suffixes(config.add_bias_linear):
        fc1, fc2 = a + "mlp.dense_h_to_4h." + x, a + "mlp.dense_4h_to_h." + x
        theirs = [f"{h}mlp.{p}.{x}" for p in ins]
        out += [GateUp(fc1, *theirs) if len(theirs) == 2 else Same(fc1, theirs[0]),
                Same(fc2, f"{h}mlp.{down}.{x}")]
    return out
