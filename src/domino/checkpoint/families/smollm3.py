"""SmolLM3 (``SmolLM3ForCausalLM``): the Llama layout (a bias on every linear or on none, tied
embeddings by default) with RoPE left out on some layers: ``no_rope_layers`` holds one flag per
layer, 1 = RoPE, 0 = none (a NoPE layer; by default every ``no_rope_layer_interval``-th layer,
the 4th, 8th, ...). Its sliding window, with ``use_sliding_window``, is on the layers
``layer_types`` marks ``sliding_attention`` (by default its NoPE layers): here on every layer or
on none."""

from __future__ import annotations

import dataclasses
from typing import Any

from domino.checkpoint.families import llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import FIX_PAIR, HFKeys
from domino.config import TransformerConfig

NAME = "SmolLM3"
KINDS = ("full_attention", "sliding_attention")
DEFAULT_THETA = 2000000.0  # (SmolLM3Config.default_theta)


def _own(config: TransformerConfig) -> list[str]:
    return llama_like.plain_obstacles(config, FAMILY, window=True)


# The per-layer lists are built from num_hidden_layers: a damaged count must not build one
# of 10**30 entries (real models have a few hundred layers at most).
MAX_LAYERS = 1 << 16


def _nope_layers(keys: HFKeys, layers: int) -> tuple[int, ...]:
    """The layers without RoPE: the 0s of no_rope_layers, else every interval-th layer."""
    if layers > MAX_LAYERS:
        keys.wrong("num_hidden_layers", layers, f"a positive integer up to {MAX_LAYERS}")
    rule = f"a list of at least num_hidden_layers ({layers}) flags, 1 (RoPE) or 0 (no RoPE)"
    _, flags = keys.value("no_rope_layers", None, rule)
    if flags is None:
        interval = keys.integer("no_rope_layer_interval", 4)
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    if not (isinstance(flags, list) and len(flags) >= layers
            and all(isinstance(f, int) and f in (0, 1) for f in flags)):
        keys.wrong("no_rope_layers", flags, rule)
    return tuple(i for i in range(layers) if not flags[i])


def _sliding(keys: HFKeys, layers: int, nope: tuple[int, ...], window: int | None,
             on: bool) -> list[bool]:
    """Which layers slide: layer_types' sliding_attention ones, or by default (as the config
    class derives layer_types) the NoPE layers when the window is on."""
    _, types = keys.value("layer_types", None, "a list of attention kinds")
    if types is None:
        return [on and window is not None and i in nope for i in range(layers)]
    if not (isinstance(types, list) and len(types) >= layers and all(t in KINDS for t in types)):
        keys.wrong("layer_types", types, f"a list of at least num_hidden_layers ({layers}) "
                   'attention kinds, "full_attention" or "sliding_attention"')
    return [t == "sliding_attention" for t in types[:layers]]


def _window(keys: HFKeys, nope: tuple[int, ...]) -> int | None:
    """The window of every layer (None: full attention); refused when some layers slide and
    others do not (one window for every layer here)."""
    layers = keys.integer("num_hidden_layers")
    window = keys.integer("sliding_window", None)
    on = keys.flag("use_sliding_window", False)
    sliding = _sliding(keys, layers, nope, window, on)
    if not any(sliding):
        return None
    if not on or window is None:
        keys.refuse(f'{NAME} layer_types marks sliding_attention layers with "use_sliding_window"'
                    f" {str(on).lower()} and \"sliding_window\" {window}: transformers' masks "
                    "and attention disagree there; set both, or mark every layer "
                    f"full_attention; {FIX_PAIR}")
    if not all(sliding):
        some = ", ".join(str(i) for i, s in enumerate(sliding) if s)
        keys.refuse(f"{NAME} with a sliding window on layers {some} only is not supported: one "
                    "window for every layer here (or none)")
    return window


def _read(keys: HFKeys) -> TransformerConfig:
    nope = _nope_layers(keys, keys.integer("num_hidden_layers"))
    config = llama_like.read_config(keys, FAMILY, window=lambda k, _: _window(k, nope),
                                    bias=llama_like.mlp_bias_too)
    # SmolLM3's own defaults where the file leaves the key out: tied, theta 2e6.
    rope = "rope_parameters" if keys.raw.get("rope_parameters") else "rope_scaling"
    theta = keys.number((f"{rope}.rope_theta", "rope_theta"), None)
    return dataclasses.replace(
        config, nope_layers=nope, rotary_base=DEFAULT_THETA if theta is None else theta,
        untie_embeddings_and_output_weights=not keys.flag("tie_word_embeddings", True))


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = llama_like.without(llama_like.config_json(config, FAMILY), "pretraining_tp")
    kind = "full_attention" if config.window_size is None else "sliding_attention"
    return {**out, "no_rope_layers": [int(i not in config.nope_layers)
                                      for i in range(config.num_layers)],
            "no_rope_layer_interval": 4, "use_sliding_window": config.window_size is not None,
            "sliding_window": config.window_size, "layer_types": [kind] * config.num_layers,
            # (hf_config adds the model's own ids: none, not SmolLM3's 128000-128004)
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


FAMILY = Family(
    model_type="smollm3", name=NAME, classes=("SmolLM3ForCausalLM",), group=llama_like.GROUP,
    read=_read, write=_write, weights=llama_like.layout, own=_own, nope=True,
    keys={**llama_like.KEYS, "nope_layers": "no_rope_layers"})
