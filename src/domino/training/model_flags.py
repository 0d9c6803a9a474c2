"""`domino train`'s model flags, derived from :class:`~domino.config.TransformerConfig`'s fields.

Each field of the config is one of:

* a flag of the same name (``--num-layers``): type, help, choices and default from the field,
  except the defaults in :data:`TRAIN_DEFAULTS` (a small model that trains in minutes);
* a renamed flag (:data:`RENAMED`: Megatron's ``--swiglu`` / ``--openai-gelu`` for
  ``activation``, ``--disable-bias-linear``, ``--norm-epsilon``);
* set by the run itself (:data:`SET_BY_RUN`: the vocabulary from the tokenizer, what a GPT
  run keeps at the config's default, and a benchmark-only setting).

So a new field gets its flag by being declared (tests/test_runtime.py checks that every field's
type makes a flag). :func:`model_config` (flags -> config), :func:`train_settings` (config ->
flags) and :func:`flag_label` (a field as messages name it) read this one table; the run-time
flags come from :mod:`~domino.training.runtime_flags`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from domino.config import TransformerConfig


@dataclass(frozen=True)
class Flag:
    """A `domino train` setting that is not a TransformerConfig field of its name."""

    name: str
    kind: type
    default: Any
    help: str


@dataclass(frozen=True)
class Renamed:
    """A config field set through other flags: ``to_field(args)`` and its inverse."""

    flags: tuple[Flag, ...]
    to_field: Callable[[Any], Any]
    to_flags: Callable[[Any], dict[str, Any]]
    label: str  # how a message names the setting


_ACTIVATION_FLAGS = {"swiglu": "swiglu", "openai_gelu": "gelu_tanh", "geglu": "geglu_tanh"}


def _activation(args: Any) -> str:
    chosen = [flag for flag in _ACTIVATION_FLAGS if getattr(args, flag)]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join('--' + f.replace('_', '-') for f in chosen)} pick "
                         "different activations; pass one.")
    return _ACTIVATION_FLAGS[chosen[0]] if chosen else "gelu"


def _layer_list(name: str) -> Callable[[Any], tuple[int, ...]]:
    """Flag ``--name``'s comma-separated layer numbers as a tuple."""

    def parse(args: Any) -> tuple[int, ...]:
        text = getattr(args, name).strip()
        try:
            return tuple(int(x) for x in text.split(",")) if text else ()
        except ValueError:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)!r} must be "
                             "comma-separated layer numbers (0-based), e.g. 3,7,11, or "
                             "empty") from None

    return parse


def _float_list(name: str) -> Callable[[Any], tuple[float, ...]]:
    """Flag ``--name``'s comma-separated numbers as a tuple of floats."""

    def parse(args: Any) -> tuple[float, ...]:
        text = getattr(args, name).strip()
        try:
            return tuple(float(x) for x in text.split(",")) if text else ()
        except ValueError:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)!r} must be "
                             "comma-separated numbers, e.g. 1.0,1.2,2.5, or empty") from None

    return parse


def _factor_flag(name: str, help_: str) -> Renamed:
    """A longrope factor list as a comma-separated flag (each float written exactly)."""
    return Renamed((Flag(name, str, "", help_),), _float_list(name),
                   lambda v: {name: ",".join(map(repr, v))}, f"--{name.replace('_', '-')}")


RENAMED: dict[str, Renamed] = {
    "activation": Renamed(
        (Flag("swiglu", bool, False, "Use the SwiGLU activation in the MLP instead of GeLU."),
         Flag("openai_gelu", bool, False, "GeLU with the tanh approximation (GPT-2's gelu_new) "
              "instead of the exact one."),
         Flag("geglu", bool, False, "GeGLU: a gate through tanh-approximated GeLU (Gemma's) "
              "instead of GeLU.")),
        _activation,
        lambda v: {flag: v == name for flag, name in _ACTIVATION_FLAGS.items()},
        "the activation (--swiglu, --openai-gelu, --geglu)"),
    "add_bias_linear": Renamed(
        (Flag("disable_bias_linear", bool, False, "No biases in the linear layers (Llama)."),),
        lambda args: not args.disable_bias_linear,
        lambda v: {"disable_bias_linear": not v},
        "linear biases (--disable-bias-linear)"),
    "layernorm_epsilon": Renamed(
        (Flag("norm_epsilon", float, 1e-5, "Epsilon of the LayerNorm / RMSNorm layers."),),
        lambda args: args.norm_epsilon,
        lambda v: {"norm_epsilon": v},
        "--norm-epsilon"),
    "nope_layers": Renamed(
        (Flag("nope_layers", str, "", "With RoPE: the layers (0-based, comma-separated) whose "
              "attention has no RoPE, e.g. 3,7,11 (SmolLM3's NoPE layers); empty: every layer "
              "has RoPE."),),
        _layer_list("nope_layers"),
        lambda v: {"nope_layers": ",".join(map(str, v))},
        "--nope-layers"),
    "full_attention_layers": Renamed(
        (Flag("full_attention_layers", str, "", "With --window-size: the layers (0-based, "
              "comma-separated) whose attention sees every earlier key, e.g. 5,11 (Gemma's "
              "global layers); empty: every layer slides."),),
        _layer_list("full_attention_layers"),
        lambda v: {"full_attention_layers": ",".join(map(str, v))},
        "--full-attention-layers"),
    "rope_short_factor": _factor_flag(
        "rope_short_factor", "With --rope-scaling-type longrope: the factor of each rotated "
        "channel pair (rotary dim / 2, comma-separated) for a forward within "
        "--rope-original-max-position-embeddings (Phi-3's short_factor)."),
    "rope_long_factor": _factor_flag(
        "rope_long_factor", "With --rope-scaling-type longrope: the factors for a forward "
        "past it (Phi-3's long_factor)."),
}

# Fields no flag sets: the run gives them (label), a GPT run keeps the config's default, or only
# the benchmark sets them.
SET_BY_RUN: dict[str, str] = {
    "vocab_size": "the vocabulary size (the tokenizer)",
    "decoder_num_layers": "TransformerConfig.decoder_num_layers",  # a GPT has no decoder
    "apply_residual_connection_post_layernorm":
        "TransformerConfig.apply_residual_connection_post_layernorm",  # pre-LN
    "final_layernorm": "TransformerConfig.final_layernorm",
    "params_dtype": "TransformerConfig.params_dtype",  # fp32 masters (--bf16: bf16 compute)
    "init_method": "TransformerConfig.init_method",  # from --init-method-std
    "output_layer_init_method": "TransformerConfig.output_layer_init_method",
    "attention_softmax_in_fp32": "TransformerConfig.attention_softmax_in_fp32",
    # random routing measures even expert loads; a model trained with it learns no router
    "moe_router_force_load_balancing": "`domino bench --moe-router-force-load-balancing` (a "
                                       "benchmark setting: the router learns nothing)",
}

# Same-named flags whose training default differs from the config's: (default, help or None
# for the field's own).
TRAIN_DEFAULTS: dict[str, tuple[Any, str | None]] = {
    "num_layers": (4, None), "hidden_size": (256, None), "num_attention_heads": (4, None),
    "seq_length": (128, None), "hidden_dropout": (0.0, None), "attention_dropout": (0.0, None),
    "max_position_embeddings": (None, "Size of the learned position table; default = "
                                      "seq_length."),
}

_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(TransformerConfig)}
_CONFIG_TYPES = typing.get_type_hints(TransformerConfig)


def same_named() -> list[str]:
    """The config fields that are flags of their own name, in the config's order."""
    return [n for n in _CONFIG_FIELDS if n not in RENAMED and n not in SET_BY_RUN]


def model_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """The model flags as ``dataclasses.make_dataclass`` fields, in the config's order (a
    renamed field's flags where the field is)."""
    out = []
    for name, f in _CONFIG_FIELDS.items():
        if name in SET_BY_RUN:
            continue
        if name in RENAMED:
            out += [(x.name, x.kind, _field(x.default, x.help, None)) for x in RENAMED[name].flags]
            continue
        hint = _CONFIG_TYPES[name]
        default, help_ = TRAIN_DEFAULTS.get(name, (f.default, None))
        if default is None and type(None) not in typing.get_args(hint):
            hint = hint | None  # "unset": the run derives it (see model_config)
        out.append((name, hint, _field(default, help_ or f.metadata["help"],
                                       f.metadata.get("choices"))))
    return out


def _field(default: Any, help_: str, choices: tuple[str, ...] | None) -> Any:
    return dataclasses.field(default=default,
                             metadata={"help": help_, "group": "model", "choices": choices})


def model_config(args: Any, vocab_size: int) -> TransformerConfig:
    """The TransformerConfig the model flags of ``args`` describe (the architecture only; the
    run-time flags make ``args.runtime()``). ValueError with the field's message."""
    values: dict[str, Any] = {name: getattr(args, name) for name in same_named()}
    values.update({name: r.to_field(args) for name, r in RENAMED.items()})
    if values["max_position_embeddings"] is None:
        values["max_position_embeddings"] = args.seq_length
    return TransformerConfig(vocab_size=vocab_size, **values)


def train_settings(config: TransformerConfig) -> dict[str, Any]:
    """The model flags that rebuild ``config``'s model (inverse of :func:`model_config`)."""
    values = {name: getattr(config, name) for name in same_named()}
    for name, r in RENAMED.items():
        values.update(r.to_flags(getattr(config, name)))
    return values


def flag_label(name: str) -> str:
    """How a message names the setting of config field ``name`` (``--hidden-size``, ...)."""
    if name in RENAMED:
        return RENAMED[name].label
    if name in SET_BY_RUN:
        return SET_BY_RUN[name]
    return f"--{name.replace('_', '-')}"


def _check_table() -> None:
    stale = sorted((set(RENAMED) | set(SET_BY_RUN) | set(TRAIN_DEFAULTS)) - set(_CONFIG_FIELDS))
    if stale:  # a field renamed or removed in TransformerConfig: keep this table in step
        raise RuntimeError(f"model_flags names fields TransformerConfig lacks: {stale}")


_check_table()
