"""Model configuration: one kw-only dataclass, validated on construction.

Field names follow Megatron's TransformerConfig / arguments where they exist so that users'
settings carry over. The rules each field must satisfy are in :mod:`domino.config_rules`; checks
that depend on the tensor-parallel size live in :meth:`TransformerConfig.validate_parallel`,
called when a model is built for a TP group.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from domino import config_rules as rules
from domino.config_fields import ARCHITECTURE_FIELDS, NEUTRAL, NOT_SAVED
from domino.config_rules import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, ROPE_SCALING_TYPES
from domino.runtime import SEED_SPELLING, RuntimeConfig
from domino.utils import init_method_normal, scaled_init_method_normal


@dataclass(kw_only=True)
class TransformerConfig:
    """Architecture and initialisation of a transformer language model.

    How it runs (Domino plan, sequence parallelism, recomputation) is a
    :class:`~domino.runtime.RuntimeConfig` passed to the model; the keywords the seed (the
    DeepSpeed-Domino language-model API that domino keeps compatible, see docs/glossary.md)
    takes for those (``domino_*``, ``sequence_parallel``, ``recompute_granularity``) build the
    default one.
    """

    num_layers: int = field(metadata={"help": "Number of transformer layers (encoder)."})
    hidden_size: int = field(metadata={"help": "Transformer hidden size."})
    num_attention_heads: int = field(metadata={"help": "Number of attention (query) heads."})
    vocab_size: int = field(default=0, metadata={"help": "Real vocabulary size (before padding)."})
    ffn_hidden_size: int | None = field(
        default=None, metadata={"help": "MLP hidden size; default 4 * hidden_size."})
    kv_channels: int | None = field(
        default=None,
        metadata={"help": "Per-head size; default hidden_size / num_attention_heads."})
    num_query_groups: int | None = field(
        default=None,
        metadata={"help": "Key/value groups for grouped-query attention; default = heads (MHA)."})
    decoder_num_layers: int | None = field(
        default=None,
        metadata={"help": "Decoder layers (encoder-decoder models); default num_layers."})
    make_vocab_size_divisible_by: int = field(
        default=128, metadata={"help": "Pad the vocabulary to a multiple of this times TP size."})
    max_position_embeddings: int = field(
        default=1024, metadata={"help": "Size of the learned position table / longest sequence."})
    seq_length: int = field(default=1024, metadata={"help": "Training sequence length."})
    position_embedding_type: str = field(
        default="learned_absolute",
        metadata={"help": "learned_absolute, rope or none.", "choices": POSITION_EMBEDDING_TYPES})
    rotary_percent: float = field(
        default=1.0, metadata={"help": "Fraction of each head's channels that RoPE rotates."})
    rotary_base: float = field(default=10000.0, metadata={"help": "RoPE base period (theta)."})
    rotary_seq_len_interpolation_factor: float | None = field(
        default=None, metadata={"help": "Divide RoPE positions by this (position interpolation)."})
    rope_scaling_type: str | None = field(
        default=None, metadata={"help": "RoPE frequency scaling: llama3 (Llama 3.1's), yarn, "
                                        "longrope (Phi-3's), or none.",
                                "choices": ROPE_SCALING_TYPES})
    rope_scaling_factor: float = field(
        default=8.0, metadata={"help": "llama3 / yarn / longrope RoPE scaling: how much "
                                       "longer the context gets."})
    rope_low_freq_factor: float = field(
        default=1.0, metadata={"help": "llama3 RoPE scaling: low-frequency factor."})
    rope_high_freq_factor: float = field(
        default=4.0, metadata={"help": "llama3 RoPE scaling: high-frequency factor."})
    rope_original_max_position_embeddings: int = field(
        default=8192,
        metadata={"help": "llama3 / yarn / longrope RoPE scaling: the context length before "
                          "scaling."})
    rope_yarn_beta_fast: float = field(
        default=32.0, metadata={"help": "yarn RoPE scaling: its beta_fast (rotations)."})
    rope_yarn_beta_slow: float = field(
        default=1.0, metadata={"help": "yarn RoPE scaling: its beta_slow (rotations)."})
    rope_yarn_truncate: bool = field(
        default=True, metadata={"help": "yarn RoPE scaling: round its ramp's ends (truncate)."})
    rope_attention_factor: float | None = field(
        default=None, metadata={"help": "RoPE scaling: cos and sin times this; None: the "
                                        "scaling's own (yarn: 0.1 ln(factor) + 1; longrope: "
                                        "sqrt(1 + ln(factor) / ln(original max)) or 1)."})
    rope_short_factor: tuple[float, ...] = field(default=(), metadata={
        "help": "longrope RoPE scaling: a wavelength factor per rotated channel pair (rotary "
                "dim / 2) for a forward within rope_original_max_position_embeddings."})
    rope_long_factor: tuple[float, ...] = field(default=(), metadata={
        "help": "longrope RoPE scaling: the factors for a forward past it."})
    nope_layers: tuple[int, ...] = field(
        default=(),
        metadata={"help": "With RoPE: the layers (0-based) whose attention has no RoPE (NoPE "
                          "layers, SmolLM3's no_rope_layers 0s); empty: RoPE on every layer."})
    local_rotary_base: float | None = field(
        default=None,
        metadata={"help": "With RoPE and window_size: the RoPE base of the sliding-window "
                          "layers, which then also skip the RoPE scaling and interpolation "
                          "(Gemma 3's rope_local_base_freq); None: every layer's RoPE is the "
                          "same."})
    normalization: str = field(
        default="LayerNorm", metadata={"help": "LayerNorm or RMSNorm.", "choices": NORMALIZATIONS})
    activation: str = field(
        default="gelu",
        metadata={"help": "MLP activation: gelu (exact), gelu_tanh (GPT-2's tanh approximation), "
                          "swiglu, or geglu_tanh (a gate through tanh-approximated GELU: "
                          "Gemma's)."})
    swiglu_alpha: float = field(
        default=1.0, metadata={"help": "SwiGLU's gate g * sigmoid(alpha * g) (GPT-OSS's 1.702)."})
    glu_linear_offset: float = field(
        default=0.0, metadata={"help": "Gated activations: act(g) * (up + this) (GPT-OSS's 1)."})
    activation_func_clamp_value: float | None = field(
        default=None, metadata={"help": "Gated activations: gate <= this, up in [-this, this]."})
    add_bias_linear: bool = field(default=True, metadata={"help": "Bias in the linear layers."})
    add_qkv_bias: bool = field(
        default=False,
        metadata={"help": "Bias in the Q/K/V projection even without add_bias_linear (Qwen2)."})
    qk_layernorm: bool = field(
        default=False,
        metadata={"help": "Normalise each head's queries and keys (the model's norm over the "
                          "head size) before RoPE (Qwen3)."})
    qk_layernorm_full_width: bool = field(
        default=False,
        metadata={"help": "With qk_layernorm: normalise all heads' queries together (and all "
                          "keys), over the Q and K projections' whole width (OLMoE's RMSNorm), "
                          "instead of each head apart; under TP the squared sums are summed "
                          "over the ranks' heads."})
    window_size: int | None = field(
        default=None,
        metadata={"help": "Sliding-window attention: each query sees itself and the "
                          "window_size - 1 keys before it (Mistral's sliding_window; Megatron's "
                          "(window_size - 1, 0)); None: every earlier key."})
    full_attention_layers: tuple[int, ...] = field(
        default=(),
        metadata={"help": "With window_size: the layers (0-based) that attend to every earlier "
                          "key (Gemma 2/3's full_attention layers); empty: every layer's "
                          "attention slides."})
    attention_softcap: float | None = field(
        default=None,
        metadata={"help": "Soft-cap the attention scores: cap * tanh(scores / cap), after "
                          "scaling and before the mask (Gemma 2's attn_logit_softcapping); "
                          "None: no cap."})
    attention_sinks: bool = field(
        default=False, metadata={"help": "A learned logit per head in the softmax (GPT-OSS's)."})
    embedding_multiplier: float = field(
        default=1.0, metadata={"help": "Multiply the embeddings by this (Granite's)."})
    embedding_multiplier_rounded: bool = field(
        default=False,
        metadata={"help": "Round embedding_multiplier to the activations' dtype before "
                          "multiplying (Gemma's normaliser; Granite's is not rounded). Only "
                          "bf16/fp16 runs differ."})
    residual_multiplier: float = field(
        default=1.0,
        metadata={"help": "Multiply each sublayer's output by this before the residual add "
                          "(Granite's)."})
    softmax_scale: float | None = field(
        default=None,
        metadata={"help": "Scale of the attention scores before the softmax (Granite's "
                          "attention_multiplier); None: 1/sqrt(kv_channels)."})
    logits_scaling: float = field(
        default=1.0, metadata={"help": "Divide the output logits by this (Granite's)."})
    output_softcap: float | None = field(
        default=None,
        metadata={"help": "Soft-cap the output logits: cap * tanh(logits / cap) (Gemma 2's "
                          "final_logit_softcapping); None: no cap."})
    hidden_dropout: float = field(default=0.1, metadata={"help": "Dropout after attention/MLP."})
    attention_dropout: float = field(default=0.1, metadata={"help": "Dropout on attention probs."})
    layernorm_epsilon: float = field(default=1e-5, metadata={"help": "Norm epsilon."})
    init_method_std: float = field(default=0.02, metadata={"help": "Std of the normal init."})
    init_method: Callable[[torch.Tensor], torch.Tensor] | None = field(
        default=None,
        metadata={"help": "Weight init (full tensor); default normal(init_method_std)."})
    output_layer_init_method: Callable[[torch.Tensor], torch.Tensor] | None = field(
        default=None,
        metadata={"help": "Init of the row-parallel outputs; default std / sqrt(2 num_layers)."})
    apply_residual_connection_post_layernorm: bool = field(
        default=False, metadata={"help": "Residual taken after the layer norm (post-LN style)."})
    norm_after_sublayer: bool = field(
        default=False,
        metadata={"help": "Normalise each sublayer's output before its residual add "
                          "(h + norm(attention(h)), h + norm(mlp(h)): OLMo 2's) instead of "
                          "its input."})
    sandwich_norms: bool = field(
        default=False,
        metadata={"help": "Normalise each sublayer's input and also its output before the "
                          "residual add (h + norm2(attention(norm1(h))): four norms per layer, "
                          "Gemma 2/3's)."})
    norm_scale_in_fp32: bool = field(
        default=False,
        metadata={"help": "RMSNorms multiply by their weight in fp32, then round to the "
                          "activations' dtype (OLMo 2's order; Llama's rounds first). Only "
                          "bf16/fp16 runs differ; layernorm_zero_centered_gamma implies it."})
    layernorm_zero_centered_gamma: bool = field(
        default=False,
        metadata={"help": "Every norm scales by (1 + weight), its weights starting at 0 "
                          "(Gemma's; Megatron's name); an RMSNorm then multiplies in fp32 "
                          "before rounding to the activations' dtype, as Gemma does."})
    final_layernorm: bool = field(default=True, metadata={"help": "Norm after the last layer."})
    untie_embeddings_and_output_weights: bool = field(
        default=False, metadata={"help": "Separate output layer instead of the word embeddings."})
    params_dtype: torch.dtype = field(default=torch.float32, metadata={"help": "Parameter dtype."})
    attention_softmax_in_fp32: bool = field(
        default=True, metadata={"help": "Compute the attention softmax in fp32."})
    # -- Mixture of Experts (Megatron's names; domino.transformer.moe)
    num_experts: int | None = field(
        default=None, metadata={"help": "Experts of each MoE layer (None: dense MLPs only)."})
    moe_router_topk: int = field(default=2, metadata={"help": "Experts each token goes to."})
    moe_ffn_hidden_size: int | None = field(
        default=None, metadata={"help": "Each expert's MLP width; default ffn_hidden_size."})
    moe_layer_freq: int = field(
        default=1, metadata={"help": "Every moe_layer_freq-th layer is MoE (1: all)."})
    moe_first_k_dense_layers: int = field(
        default=0, metadata={"help": "The first layers keep a dense MLP (DeepSeek's "
                                     "first_k_dense_replace)."})
    moe_shared_expert_intermediate_size: int | None = field(
        default=None, metadata={"help": "Width of a shared expert every token goes through "
                                        "(Qwen-MoE, DeepSeek); None: no shared expert."})
    moe_shared_expert_gate: bool = field(
        default=False, metadata={"help": "Scale the shared expert by a sigmoid gate (Qwen)."})
    moe_router_score_function: str = field(
        default="softmax", metadata={"help": "Router scores: softmax or sigmoid (DeepSeek-V3).",
                                     "choices": ("softmax", "sigmoid")})
    moe_router_pre_softmax: bool = field(
        default=False, metadata={"help": "softmax: keep the top-k probabilities of all experts "
                                         "as they are instead of re-normalising them."})
    moe_router_topk_scaling_factor: float | None = field(
        default=None, metadata={"help": "Multiply the top-k weights by this (DeepSeek)."})
    moe_router_enable_expert_bias: bool = field(
        default=False, metadata={"help": "Aux-loss-free balancing: a per-expert bias on the "
                                         "scores that choose experts, moved each step."})
    moe_router_bias: bool = field(
        default=False, metadata={"help": "A learned bias on the router's logits (GPT-OSS's)."})
    moe_expert_linear_bias: bool = field(
        default=False, metadata={"help": "Biases on each expert's fc1 and fc2 (GPT-OSS's)."})
    moe_router_force_load_balancing: bool = field(
        default=False, metadata={"help": "Route by random scores (about even loads): for "
                                         "benchmarks only, the router learns nothing."})
    moe_router_bias_update_rate: float = field(
        default=1e-3, metadata={"help": "How far the expert bias moves per step."})
    moe_router_load_balancing_type: str = field(
        default="aux_loss", metadata={"help": "aux_loss (Switch/GShard loss, weighted by "
                                              "moe_aux_loss_coeff) or none.",
                                      "choices": ("aux_loss", "none")})
    moe_aux_loss_coeff: float = field(
        default=0.0, metadata={"help": "Weight of the load-balancing loss."})
    moe_z_loss_coeff: float | None = field(
        default=None, metadata={"help": "Weight of the router z-loss (None: off)."})
    moe_expert_capacity_factor: float | None = field(
        default=None, metadata={"help": "Capacity per expert, x its even share of the "
                                        "assignments; tokens over it are dropped (None: "
                                        "dropless)."})
    moe_pad_expert_input_to_capacity: bool = field(
        default=False, metadata={"help": "Pad every expert's rows to its capacity."})
    moe_token_drop_policy: str = field(
        default="probs", metadata={"help": "What the capacity drops first: the lowest weights "
                                           "(probs) or the latest tokens (position).",
                                   "choices": ("probs", "position")})
    # -- Run-time choices in the seed's (Megatron's) spelling: constructor keywords only, not
    # part of the model (not in fields(), to_dict(), architecture() or ==). They build the
    # default RuntimeConfig, ``config.runtime()``, that a model built without ``runtime=`` runs.
    domino_micro_batches: InitVar[int] = SEED_SPELLING["domino_micro_batches"][0]
    domino_overlap: InitVar[str] = SEED_SPELLING["domino_overlap"][0]
    domino_column_chunks: InitVar[int] = SEED_SPELLING["domino_column_chunks"][0]
    recompute_granularity: InitVar[str | None] = SEED_SPELLING["recompute_granularity"][0]
    sequence_parallel: InitVar[bool] = SEED_SPELLING["sequence_parallel"][0]

    def __post_init__(self, domino_micro_batches: int, domino_overlap: str,
                      domino_column_chunks: int, recompute_granularity: str | None,
                      sequence_parallel: bool) -> None:
        # One rule group after another, in a fixed order: a config with several faults is
        # always told the same first one.
        rules.check_sizes(self)
        self._derive_sizes()
        rules.check_choices(self)
        self._runtime = RuntimeConfig.from_seed(
            domino_micro_batches=domino_micro_batches, domino_overlap=domino_overlap,
            domino_column_chunks=domino_column_chunks, sequence_parallel=sequence_parallel,
            recompute_granularity=recompute_granularity)
        self._runtime.plan.check_width(self.hidden_size)
        rules.check_dropout_and_window(self)
        rules.check_moe(self)
        rules.check_rope(self)
        self.rotary_base = float(self.rotary_base)
        rules.check_positions_and_norms(self)
        rules.check_multipliers(self)
        rules.check_init(self)
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, self.num_layers)

    def _derive_sizes(self) -> None:
        """The sizes left None, from the others (Megatron's defaults), and their rules."""
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.decoder_num_layers is None:
            self.decoder_num_layers = self.num_layers
        rules.check_derived_sizes(self)
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size

    def validate_parallel(self, tp_size: int) -> None:
        """Raise ValueError if this model cannot be split over ``tp_size`` ranks."""
        rules = (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.num_query_groups),
            ("ffn_hidden_size", self.ffn_hidden_size),
        )
        for name, value in rules:
            if value % tp_size:
                raise ValueError(
                    f"{name}={value} is not divisible by tensor_model_parallel_size={tp_size}; "
                    f"choose a TP size that divides {name} (or change {name}).")

    def runtime(self) -> RuntimeConfig:
        """The run-time config the seed's keywords (``domino_*``, ``sequence_parallel``,
        ``recompute_granularity``) asked for: what a model built without ``runtime=`` runs."""
        return self._runtime

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-able values (the init callables are left out: they only matter
        when weights are drawn, and a checkpoint or export carries the weights)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in NOT_SAVED:
                continue
            value = getattr(self, f.name)
            out[f.name] = str(value).removeprefix("torch.") if f.name == "params_dtype" else value
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TransformerConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error (ValueError). The run-time
        keys that records written before the split held (``domino_*``, ...) are skipped: a
        checkpoint keeps its plan in its own record."""
        known = {f.name for f in dataclasses.fields(cls)} - NOT_SAVED
        values = {k: v for k, v in values.items() if k not in SEED_SPELLING}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields {unknown}")
        if "params_dtype" in values:
            dtype = getattr(torch, str(values["params_dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"params_dtype={values['params_dtype']!r} is not a torch dtype")
            values["params_dtype"] = dtype
        return cls(**values)

    def is_moe_layer(self, index: int) -> bool:
        """Layer ``index`` (0-based) has an MoE MLP."""
        return (self.num_experts is not None and index >= self.moe_first_k_dense_layers
                and index % self.moe_layer_freq == 0)

    def architecture(self) -> dict[str, Any]:
        """The fields that decide the weights' shapes and the model's math: two configs with the
        same architecture can load each other's weights (at any TP size). Settings that do not
        apply (RoPE's without RoPE, the position table's with RoPE) are left out."""
        out = {name: getattr(self, name) for name in ARCHITECTURE_FIELDS}
        if self.position_embedding_type != "learned_absolute":
            del out["max_position_embeddings"]
        if self.position_embedding_type != "rope":
            for name in [n for n in out if n.startswith(("rotary_", "rope_"))]:
                del out[name]
        elif self.rope_scaling_type is None:
            for name in [n for n in out if n.startswith("rope_") and n != "rope_scaling_type"]:
                del out[name]
        if self.rope_scaling_type != "yarn":  # (only YaRN reads them)
            for name in [n for n in out if n.startswith("rope_yarn")]:
                del out[name]
        if self.num_experts is None:
            for name in [n for n in out if n.startswith("moe_")]:
                del out[name]
        for name, unset in NEUTRAL.items():  # (records written before them match)
            if name in out and out[name] == unset:
                del out[name]
        return out

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp_size."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)


def _seed_alias(name: str) -> property:
    """``config.<name>``: the seed spelling of ``config.runtime()``, read and (as the seed's
    code may) set; the library itself reads ``runtime()``."""

    def get(self: TransformerConfig) -> Any:
        return self._runtime.seed_spelling()[name]

    def set_(self: TransformerConfig, value: Any) -> None:
        runtime = RuntimeConfig.from_seed(**{**self._runtime.seed_spelling(), name: value})
        runtime.plan.check_width(self.hidden_size)
        self._runtime = runtime

    return property(get, set_, doc=SEED_SPELLING[name][1])


# After the dataclass is made: its __init__ keeps the keyword defaults, reads go to runtime().
for _name in SEED_SPELLING:
    setattr(TransformerConfig, _name, _seed_alias(_name))

