"""Gemma 1 (``GemmaForCausalLM``), and what Gemma 1, 2 (:mod:`.gemma2`) and 3 (:mod:`.gemma3`)
share: RMSNorms scaling by (1 + weight) in fp32 (``layernorm_zero_centered_gamma``; the
weight is ours as it is), the embeddings multiplied by sqrt(hidden_size)
(``embedding_multiplier``), GeGLU with tanh-approximated GELU (``geglu_tanh``; ``gate_proj``
and ``up_proj`` are our ``[gate; up]`` rows), RoPE, grouped-query attention with its own head
size (``head_dim``: 256 where config.json leaves it out, not hidden_size / heads), no biases,
tied embeddings unless ``tie_word_embeddings`` is false. Gemma 1 is otherwise Llama's layout.

Refused: ``attention_bias`` true (biases on the attention's projections without the MLP's are
not expressed here) and ``use_bidirectional_attention`` true (every layer here is causal)."""

from __future__ import annotations

import math
from typing import Any

from domino.checkpoint.families import common, llama_like
from domino.checkpoint.families.family import Family, Group
from domino.checkpoint.families.weights import Link, Same, layer
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

NAME = "Gemma"
KEYS = {**{k: v for k, v in llama_like.KEYS.items() if not k.startswith(("moe_", "num_exp"))},
        "softmax_scale": "query_pre_attn_scalar", "attention_softcap": "attn_logit_softcapping",
        "output_softcap": "final_logit_softcapping", "full_attention_layers": "layer_types"}
HEAD_DIM = 256  # (GemmaConfig's, Gemma2Config's and Gemma3TextConfig's default head_dim)
KINDS = ("full_attention", "sliding_attention")


# ---- what no Gemma can express ----------------------------------------------------------------


def _obstacles(config: TransformerConfig) -> list[str]:
    out = common.obstacles(config)
    if config.normalization != "RMSNorm":
        out.append(f"{config.normalization} ({NAME} has RMSNorm)")
    if config.activation != "geglu_tanh":
        out.append(f"{config.activation} ({NAME} has GeGLU with tanh-approximated GELU)")
    if not config.layernorm_zero_centered_gamma:
        out.append(f"norms scaling by their weight ({NAME}'s scale by 1 + weight)")
    root = config.hidden_size ** 0.5
    if not math.isclose(config.embedding_multiplier, root, rel_tol=1e-9):
        out.append(f"the embeddings multiplied by {config.embedding_multiplier} ({NAME} "
                   f"multiplies them by sqrt(hidden_size) = {root:.6g})")
    if config.residual_multiplier != 1.0:
        out.append(f"each sublayer's output multiplied by {config.residual_multiplier} (only "
                   "Granite has it)")
    if config.logits_scaling != 1.0:
        out.append(f"the logits divided by {config.logits_scaling} (only Granite has it)")
    if config.add_bias_linear or config.add_qkv_bias:
        out.append(f"biases ({NAME} has none)")
    if config.num_experts is not None:
        out.append(f"Mixture-of-Experts layers ({NAME} is dense)")
    if config.qk_layernorm_full_width:
        out.append("query/key norms over all heads (Gemma 3's are per head)")
    return out + llama_like.rope_obstacles(config, NAME)


GROUP = Group("the Gemma family", NAME, _obstacles)


def scale_obstacles(config: TransformerConfig, name: str) -> list[str]:
    """A softmax scale that is not query_pre_attn_scalar ** -0.5 of an integer (its type)."""
    scale = config.softmax_scale
    if scale is None or math.isclose(query_scalar(config) ** -0.5, scale, rel_tol=1e-12):
        return []
    return [f"attention scores scaled by {config.softmax_scale}, which is not 1/sqrt of an "
            f"integer ({name}'s query_pre_attn_scalar is one)"]


def _own(config: TransformerConfig) -> list[str]:
    out = []
    if config.sandwich_norms:
        out.append("norms after each sublayer as well (Gemma 2 and 3 have them; Gemma 1 not)")
    if config.qk_layernorm:
        out.append("query/key norms (Gemma 1 has none)")
    if config.window_size is not None:
        out.append("sliding-window attention (Gemma 1 has none)")
    if config.attention_softcap is not None or config.output_softcap is not None:
        out.append("soft-capping (Gemma 1 has none)")
    scale = config.softmax_scale
    if scale is not None and not math.isclose(scale, config.kv_channels ** -0.5, rel_tol=1e-9):
        out.append(f"attention scores scaled by {scale}, not 1/sqrt(head_dim) (Gemma 1's)")
    return out


# ---- reading a config.json --------------------------------------------------------------------


def _heads(keys: HFKeys) -> dict[str, Any]:
    """The heads and head size: head_dim is Gemma's own (256 where the file leaves it out)."""
    size = keys.integer("head_dim", HEAD_DIM)
    return llama_like.read_heads(HFKeys({**keys.raw, "head_dim": size}, keys.path))


def _activation(keys: HFKeys, name: str, key: str) -> None:
    """The gate's activation: tanh-approximated GELU (Gemma 1's "gelu" means it too: transformers
    reads it so; Gemma 2/3's "gelu" is the exact one, which GeGLU here has not)."""
    act = keys.text(key, "gelu_pytorch_tanh")
    if act == "gelu" and key == "hidden_act":
        return
    other = keys.text("hidden_act", None) if key != "hidden_act" else None
    if other is not None and other not in common.GELU_FROM_HF:  # (a GELU of older files)
        keys.refuse(f"{name} hidden_act={other!r} is not supported: {name}'s MLP gate is GELU "
                    f"({key}); a file setting hidden_act to another activation holds another "
                    "model")
    if common.GELU_FROM_HF.get(act) != "gelu_tanh":
        exact = " (exact GELU)" if act == "gelu" else ""
        keys.refuse(f"{name} {key}={act!r}{exact} is not supported: Gemma's MLP gate here is "
                    "the tanh approximation of GELU (gelu_pytorch_tanh)")


def _off(keys: HFKeys, key: str) -> bool:
    """A flag that transformers saves as null when unset."""
    return keys.raw.get(key) is None or not keys.flag(key, False)


def read_base(keys: HFKeys, name: str, act_key: str, positions: int) -> dict[str, Any]:
    """Our config's fields every Gemma sets alike (``act_key``: the activation's key;
    ``positions``: max_position_embeddings where the file leaves it out)."""
    _activation(keys, name, act_key)
    if keys.flag("attention_bias", False):
        keys.refuse(f"{name} attention_bias=true is not supported: a bias on the attention's "
                    "projections without one on the MLP's is not expressed here; set "
                    "attention_bias to false")
    if not _off(keys, "use_bidirectional_attention"):
        keys.refuse(f"{name} use_bidirectional_attention=true is not supported: every layer "
                    "here is causal (a token sees only those before it)")
    heads = _heads(keys)
    length = keys.integer("max_position_embeddings", positions)
    return dict(
        num_layers=keys.integer("num_hidden_layers"), vocab_size=keys.integer("vocab_size"),
        ffn_hidden_size=keys.integer("intermediate_size"), **heads,
        max_position_embeddings=length, seq_length=min(length, 4096),
        position_embedding_type="rope", normalization="RMSNorm", activation="geglu_tanh",
        layernorm_zero_centered_gamma=True, embedding_multiplier=heads["hidden_size"] ** 0.5,
        embedding_multiplier_rounded=True,
        add_bias_linear=False, add_qkv_bias=False,
        layernorm_epsilon=keys.number("rms_norm_eps", 1e-6, rule="> 0"), hidden_dropout=0.0,
        attention_dropout=keys.number("attention_dropout", 0.0, rule="in [0, 1)"),
        init_method_std=keys.number("initializer_range", 0.02, rule="> 0"),
        untie_embeddings_and_output_weights=not keys.flag("tie_word_embeddings", True))


def one_rope(keys: HFKeys, name: str) -> None:
    """Gemma 1 and 2 have one RoPE for every layer (Gemma 3's settings per kind of layer are
    not theirs: transformers fails on them)."""
    rope = keys.raw.get("rope_parameters")
    if isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values()):
        keys.refuse(f"{name} rope_parameters per kind of layer ({', '.join(rope)}) is not "
                    f"supported: {name}'s layers share one RoPE (per-kind settings are Gemma "
                    "3's: model_type gemma3_text)")


def read_scores(keys: HFKeys, head_dim: int, caps: tuple[float | None, float | None],
                ) -> dict[str, Any]:
    """Gemma 2/3's attention scale and soft-caps (``caps``: the attention's and the logits'
    where the file leaves them out; null: none)."""
    scalar = keys.integer("query_pre_attn_scalar", HEAD_DIM)  # (an int to transformers)
    out: dict[str, Any] = {"softmax_scale": None if scalar == head_dim else scalar ** -0.5}
    for field, key, default in (("attention_softcap", "attn_logit_softcapping", caps[0]),
                                ("output_softcap", "final_logit_softcapping", caps[1])):
        null = key in keys.raw and keys.raw[key] is None
        out[field] = None if null else keys.number(key, default, rule="> 0")
    return out


def read_layers(keys: HFKeys, name: str, layers: int, pattern: int,
                ) -> tuple[int | None, tuple[int, ...]]:
    """(window, full-attention layers) from layer_types, or, where the file leaves it out,
    every ``pattern``-th layer full (Gemma 2: 2; Gemma 3: sliding_window_pattern, 6)."""
    _, types = keys.value("layer_types", None, "a list of attention kinds")
    if types is None:
        sliding = [bool((i + 1) % pattern) for i in range(layers)]
    elif isinstance(types, list) and len(types) == layers and all(t in KINDS for t in types):
        sliding = [t == "sliding_attention" for t in types]
    else:
        keys.wrong("layer_types", types, f"a list of num_hidden_layers ({layers}) attention "
                   'kinds, "full_attention" or "sliding_attention"')
    if not any(sliding):
        return None, ()
    if keys.raw.get("sliding_window", 0) is None:
        keys.refuse(f'{name} layer_types marks sliding_attention layers but "sliding_window" '
                    "is null: set the window those layers slide, or mark every layer "
                    "full_attention")
    window = keys.integer("sliding_window", 4096)  # (the config classes' default)
    return window, tuple(i for i, s in enumerate(sliding) if not s)


def _read(keys: HFKeys) -> TransformerConfig:
    base = read_base(keys, NAME, "hidden_act", 8192)
    one_rope(keys, NAME)
    rope, theta, extra = llama_like.read_rope(keys, NAME)
    return keys.build(FAMILY.names(rope), **base, rotary_base=theta, **extra)


# ---- config.json and weights ------------------------------------------------------------------


def query_scalar(config: TransformerConfig) -> int:
    """Gemma 2/3's query_pre_attn_scalar (an integer): 1 / softmax_scale ** 2, or the head
    size."""
    scale = config.softmax_scale
    return config.kv_channels if scale is None else round(scale ** -2)


def config_json(config: TransformerConfig, family: Family) -> dict[str, Any]:
    """Llama's keys as Gemma has them: its activation, no MLP bias key."""
    out = llama_like.without(llama_like.config_json(config, family), "mlp_bias",
                             "pretraining_tp")
    return {**out, "hidden_act": "gelu_pytorch_tanh", "use_bidirectional_attention": False,
            # (hf_config adds the model's own ids: none, not Gemma's 0, 1, 2)
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def layers_json(config: TransformerConfig) -> dict[str, Any]:
    """Gemma 2/3's scale, caps and layer kinds."""
    full, window = config.full_attention_layers, config.window_size
    kinds = ["full_attention" if window is None or i in full else "sliding_attention"
             for i in range(config.num_layers)]
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": query_scalar(config),
            "attn_logit_softcapping": config.attention_softcap,
            "final_logit_softcapping": config.output_softcap,
            "sliding_window": window if window is not None else 4096, "layer_types": kinds}


def sandwich_layout(config: TransformerConfig) -> list[Link]:
    """Llama's map with Gemma 2/3's two more norms per layer (the same names here)."""
    return llama_like.layout(config) + [
        Same(f"{layer(i)}{norm}.weight", f"model.layers.{i}.{norm}.weight")
        for i in range(config.num_layers)
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm")]


def _write(config: TransformerConfig) -> dict[str, Any]:
    return config_json(config, FAMILY)


FAMILY = Family(
    model_type="gemma", name=NAME, classes=("GemmaForCausalLM",), group=GROUP, read=_read,
    write=_write, weights=llama_like.layout, own=_own, scalars=True, gemma=True, keys=KEYS)
