"""GPT-OSS (``GptOssForCausalLM``): Llama's attention with a bias on Q, K, V and the output
(``attention_bias``) and a learned sink logit per head (``self_attn.sinks``), local and global
layers (``layer_types``: sliding_attention / full_attention, one ``sliding_window``), yarn (or
plain) RoPE, and an MoE MLP in every layer: a router with a bias, softmax over its top-k
logits (ours: softmax re-normalised over the top k), and experts with biases whose activation
is GPT-OSS's clamped SwiGLU, ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)`` with
``g = min(gate, limit)``. Its RMSNorms multiply by the weight in fp32 before rounding.

The experts are stored fused, ``mlp.experts.gate_up_proj`` [E, h, 2f] with gate and up
*interleaved* on the last dim (gate channel j at 2j, up at 2j + 1) and its bias likewise,
``down_proj`` [E, f, h] (both [in, out], as ours). MXFP4-quantized folders (the Hub's
``quantization_config``) are refused: dequantized by transformers first, they import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from domino.checkpoint.families import common, llama_like
from domino.checkpoint.families.family import Family, Group
from domino.checkpoint.families.weights import (
    FINAL_NORM,
    ApartQKV,
    Heads,
    Link,
    Same,
    Tensors,
    layer,
    suffixes,
)
from domino.checkpoint.hf_keys import FIX_PAIR, HFKeys
from domino.config import TransformerConfig

KEYS = {**{k: v for k, v in llama_like.KEYS.items() if not k.startswith("rope_")},
        "rotary_base": "rope_scaling.rope_theta",
        "num_experts": "num_local_experts", "moe_ffn_hidden_size": "intermediate_size",
        "add_bias_linear": "attention_bias", "swiglu_alpha": "swiglu_alpha",
        "activation_func_clamp_value": "swiglu_limit", "full_attention_layers": "layer_types",
        "rope_scaling_factor": "rope_scaling.factor",
        "rope_original_max_position_embeddings": "rope_scaling.original_max_position_embeddings",
        "rope_yarn_beta_fast": "rope_scaling.beta_fast",
        "rope_yarn_beta_slow": "rope_scaling.beta_slow",
        "rope_attention_factor": "rope_scaling.attention_factor"}
SLIDING, FULL = "sliding_attention", "full_attention"


# ---- what GPT-OSS cannot express --------------------------------------------------------------


def _obstacles(config: TransformerConfig) -> list[str]:
    out = common.obstacles(config)
    if config.num_experts is None:
        return out + ["no Mixture-of-Experts layers (GPT-OSS has them)"]
    if config.normalization != "RMSNorm":
        out.append(f"{config.normalization} (GPT-OSS has RMSNorm)")
    if config.activation != "swiglu":
        out.append(f"{config.activation} (GPT-OSS has SwiGLU)")
    out += llama_like.rope_obstacles(config, "GPT-OSS")
    if config.rope_scaling_type not in (None, "yarn"):
        out.append(f"{config.rope_scaling_type} RoPE scaling (GPT-OSS has yarn or none)")
    if config.rotary_seq_len_interpolation_factor:
        out.append("RoPE position interpolation (GPT-OSS has yarn or none)")
    out += [what for what, has in (
        ("no attention sinks (GPT-OSS has them)", config.attention_sinks),
        ("no router bias (GPT-OSS has one)", config.moe_router_bias),
        ("no expert biases (GPT-OSS has them)", config.moe_expert_linear_bias),
        ("an unclamped SwiGLU (GPT-OSS clamps it at swiglu_limit)",
         config.activation_func_clamp_value is not None),
        (f"glu_linear_offset={config.glu_linear_offset} (GPT-OSS's SwiGLU adds 1 to its "
         "linear half)", config.glu_linear_offset == 1.0)) if not has]
    if config.add_qkv_bias and not config.add_bias_linear:
        out.append("a bias on Q/K/V only (GPT-OSS's attention_bias is on the output too)")
    if config.qk_layernorm:
        out.append("query/key norms (GPT-OSS has none)")
    return out


GROUP = Group("GPT-OSS", "GPT-OSS", _obstacles)


# ---- config.json ------------------------------------------------------------------------------


def _read_rope(keys: HFKeys) -> dict[str, Any]:
    """RoPE's base and yarn (or no) scaling, as our config's fields."""
    rope = "rope_parameters" if keys.raw.get("rope_parameters") else "rope_scaling"
    kind = keys.text((f"{rope}.rope_type", f"{rope}.type"), "default")
    out: dict[str, Any] = {"rotary_base": keys.number((f"{rope}.rope_theta", "rope_theta"),
                                                      150000.0, rule="> 1")}
    if keys.number(f"{rope}.partial_rotary_factor", None) not in (None, 1.0):
        keys.refuse("GPT-OSS partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return out
    if kind != "yarn":
        keys.refuse(f"GPT-OSS RoPE type {kind!r} is not supported (default, yarn)")
    factor = keys.number(f"{rope}.attention_factor", None, rule="> 0")
    if factor is None and keys.raw[rope].get("mscale") and keys.raw[rope].get("mscale_all_dim"):
        keys.refuse(f'GPT-OSS yarn with "{rope}.mscale" and "{rope}.mscale_all_dim" (DeepSeek\'s '
                    "attention factor) is not supported: set attention_factor instead")
    # (transformers reads a null or 0 beta as its default, 32 or 1)
    return {**out, "rope_scaling_type": "yarn",
            "rope_scaling_factor": keys.number(f"{rope}.factor", rule="> 0"),
            # (absent, as transformers 4.55 saved its default: max_position_embeddings, as
            # transformers reads it)
            "rope_original_max_position_embeddings": keys.integer(
                f"{rope}.original_max_position_embeddings",
                keys.integer("max_position_embeddings", 131072)),
            "rope_yarn_beta_fast": keys.number(f"{rope}.beta_fast", None, rule="> 0") or 32.0,
            "rope_yarn_beta_slow": keys.number(f"{rope}.beta_slow", None, rule="> 0") or 1.0,
            "rope_yarn_truncate": keys.flag(f"{rope}.truncate", True),
            "rope_attention_factor": factor}


def _read_layers(keys: HFKeys, layers: int) -> dict[str, Any]:
    """window_size and full_attention_layers from layer_types (default: sliding on the even
    layers, full on the odd ones, as GptOssConfig) and sliding_window."""
    _, types = keys.value("layer_types", None, "a list of attention kinds")
    if types is None:
        types = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not all(
            t in (SLIDING, FULL) for t in types):
        keys.wrong("layer_types", types, f'a list of {layers} attention kinds ("{SLIDING}" or '
                   f'"{FULL}"), one per layer')
    if SLIDING not in types:
        return {"window_size": None, "full_attention_layers": ()}
    window = keys.integer("sliding_window", None)
    if window is None:
        keys.refuse(f'"sliding_window" is null but "layer_types" has {SLIDING} layers; '
                    f"{FIX_PAIR}")
    return {"window_size": window,
            "full_attention_layers": tuple(i for i, t in enumerate(types) if t == FULL)}


def _read(keys: HFKeys) -> TransformerConfig:
    quantized = keys.raw.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        keys.refuse(f"GPT-OSS quantization_config (quant_method {method!r}: quantized expert "
                    "weights, as the Hub's MXFP4 folders) is not supported: dequantize it "
                    "first: load it with transformers (GptOssForCausalLM.from_pretrained(path, "
                    "dtype=torch.bfloat16) dequantizes MXFP4), save_pretrained that to a new "
                    "folder and import the new folder")
    experts, topk = keys.integer("num_local_experts"), keys.integer("num_experts_per_tok")
    if topk > experts:
        keys.refuse(f'"num_experts_per_tok" ({topk}) is more than "num_local_experts" '
                    f"({experts}): a token is routed to at most every expert; {FIX_PAIR}")
    layers, width = keys.integer("num_hidden_layers"), keys.integer("intermediate_size")
    positions = keys.integer("max_position_embeddings", 131072)
    return keys.build(
        FAMILY.names("rope_parameters" if keys.raw.get("rope_parameters") else "rope_scaling"),
        num_layers=layers, vocab_size=keys.integer("vocab_size"), ffn_hidden_size=width,
        **llama_like.read_heads(keys), max_position_embeddings=positions,
        seq_length=min(positions, 4096), position_embedding_type="rope", **_read_rope(keys),
        normalization="RMSNorm", norm_scale_in_fp32=True, activation="swiglu",
        swiglu_alpha=keys.number("swiglu_alpha", 1.702, rule="> 0"), glu_linear_offset=1.0,
        activation_func_clamp_value=keys.number("swiglu_limit", 7.0, rule="> 0"),
        add_bias_linear=keys.flag("attention_bias", True), attention_sinks=True,
        **_read_layers(keys, layers),
        layernorm_epsilon=keys.number("rms_norm_eps", 1e-5, rule="> 0"), hidden_dropout=0.0,
        attention_dropout=keys.number("attention_dropout", 0.0, rule="in [0, 1)"),
        init_method_std=keys.number("initializer_range", 0.02, rule="> 0"),
        untie_embeddings_and_output_weights=not keys.flag("tie_word_embeddings", False),
        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=width,
        moe_router_bias=True, moe_expert_linear_bias=True,
        moe_aux_loss_coeff=keys.number("router_aux_loss_coef", None, rule=">= 0") or 0.0)


def _rope_json(config: TransformerConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rope_scaling_type == "yarn":
        rope.update(rope_type="yarn", factor=config.rope_scaling_factor,
                    beta_fast=config.rope_yarn_beta_fast, beta_slow=config.rope_yarn_beta_slow,
                    truncate=config.rope_yarn_truncate,
                    original_max_position_embeddings=config.rope_original_max_position_embeddings)
        if config.rope_attention_factor is not None:
            rope["attention_factor"] = config.rope_attention_factor
    return rope


def _write(config: TransformerConfig) -> dict[str, Any]:
    """sliding_window is written even without a sliding layer: transformers builds the
    sliding mask (unused then) from it."""
    slides = config.window_size is not None
    return {
        "model_type": "gpt_oss", "architectures": list(FAMILY.classes),
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.moe_ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "num_local_experts": config.num_experts, "num_experts_per_tok": config.moe_router_topk,
        "hidden_act": "silu", "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.activation_func_clamp_value,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon, "initializer_range": config.init_method_std,
        "attention_bias": config.add_bias_linear, "attention_dropout": config.attention_dropout,
        "sliding_window": config.window_size if slides else config.max_position_embeddings,
        "layer_types": [SLIDING if slides and i not in config.full_attention_layers else FULL
                        for i in range(config.num_layers)],
        # rope_theta / rope_scaling for transformers 4.x, which ignores rope_parameters
        # (its GptOssConfig would take its default yarn); null there is no scaling
        "rope_parameters": _rope_json(config), "rope_theta": config.rotary_base,
        "rope_scaling": {k: v for k, v in _rope_json(config).items() if k != "rope_theta"}
        if config.rope_scaling_type == "yarn" else None,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "torch_dtype": "float32",
    }


# ---- weights ----------------------------------------------------------------------------------


def _interleaved(ours: torch.Tensor) -> torch.Tensor:
    """Our [..., gate | up] halves -> gate and up interleaved (gate j at 2j, up j at 2j + 1)."""
    gate, up = ours.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _halves(theirs: torch.Tensor) -> torch.Tensor:
    """Interleaved gate and up (:func:`_interleaved`) -> our [..., gate | up] halves."""
    return torch.cat([theirs[..., 0::2], theirs[..., 1::2]], dim=-1)


@dataclass(frozen=True)
class FusedExperts:
    """An MoE layer's router (weight and bias) and experts as GPT-OSS's fused tensors: ours
    ``experts.fc1`` [E, h, 2f] ([gate | up]) and its bias are ``gate_up_proj`` [E, h, 2f] and
    ``gate_up_proj_bias`` interleaved; ``fc2`` [E, f, h] and its bias are ``down_proj`` and
    ``down_proj_bias`` as they are."""

    ours: str  # our MoE module's prefix
    theirs: str  # their MLP's prefix

    def _pairs(self) -> list[tuple[str, str, bool]]:
        o, t = self.ours, self.theirs
        return [(o + "router.weight", t + "router.weight", False),
                (o + "router.bias", t + "router.bias", False),
                (o + "experts.fc1", t + "experts.gate_up_proj", True),
                (o + "experts.fc1_bias", t + "experts.gate_up_proj_bias", True),
                (o + "experts.fc2", t + "experts.down_proj", False),
                (o + "experts.fc2_bias", t + "experts.down_proj_bias", False)]

    def to_hf(self, ours: Tensors) -> Tensors:
        return {t: _interleaved(ours[o]) if mixed else ours[o] for o, t, mixed in self._pairs()}

    def from_hf(self, hf: Tensors) -> Tensors:
        return {o: _halves(hf[t]) if mixed else hf[t] for o, t, mixed in self._pairs()}


def _weights(config: TransformerConfig) -> list[Link]:
    out: list[Link] = []
    heads = Heads.of(config)
    for i in range(config.num_layers):
        a, h = layer(i), f"model.layers.{i}."
        out += [Same(a + x + ".weight", h + x + ".weight")
                for x in ("input_layernorm", "post_attention_layernorm")]
        out += [ApartQKV(a + "self_attention.query_key_value." + x,
                         tuple(f"{h}self_attn.{p}.{x}" for p in ("q_proj", "k_proj", "v_proj")),
                         heads) for x in suffixes(config.add_bias_linear)]
        out += [Same(a + "self_attention.dense." + x, h + "self_attn.o_proj." + x)
                for x in suffixes(config.add_bias_linear)]
        out += [Same(a + "self_attention.sinks", h + "self_attn.sinks"),
                FusedExperts(a + "mlp.moe.", h + "mlp.")]
    return out + [Same(FINAL_NORM + "weight", "model.norm.weight")]


FAMILY = Family(
    model_type="gpt_oss", name="GPT-OSS", classes=("GptOssForCausalLM",), group=GROUP,
    read=_read, write=_write, weights=_weights, experts=True, keys=KEYS, gpt_oss=True)
