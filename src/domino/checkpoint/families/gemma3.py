"""Gemma 3's text decoder (``Gemma3ForCausalLM``, ``model_type`` "gemma3_text"): Gemma 2's
layers (:mod:`.gemma2`: norms before and after each sublayer, query_pre_attn_scalar, soft-caps,
none by default) with a (1 + weight) RMSNorm on each head's queries and keys (``q_norm``,
``k_norm``: ``qk_layernorm``), five sliding layers to one full by default
(``sliding_window_pattern`` 6, where ``layer_types`` is left out) and RoPE per kind of layer:
``rope_parameters.full_attention`` (``rope_theta``, 1e6, and ``rope_scaling`` in older files;
default, linear or llama3) and ``rope_parameters.sliding_attention`` (``rope_local_base_freq``,
1e4: the sliding layers' own base without scaling, ``local_rotary_base``).

The multimodal ``gemma3`` (``Gemma3ForConditionalGeneration``: ``text_config`` beside a vision
tower's ``vision_config``) is not read: import reads a text decoder's own config.json."""

from __future__ import annotations

from typing import Any

from domino.checkpoint.families import gemma, llama_like
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

NAME = "Gemma 3"
ROPE = "rope_parameters.full_attention"  # (where our RoPE fields come from, for messages)
THETAS = {"full_attention": ("rope_theta", 1000000.0),
          "sliding_attention": ("rope_local_base_freq", 10000.0)}  # (key, default)


def _own(config: TransformerConfig) -> list[str]:
    out = []
    if not config.sandwich_norms:
        out.append(f"norms only before the sublayers ({NAME} has them before and after)")
    if not config.qk_layernorm:
        out.append(f"no query/key norms ({NAME} has them on each head)")
    return out + gemma.scale_obstacles(config, NAME)


def _per_kind(keys: HFKeys) -> dict[str, dict[str, Any]]:
    """The RoPE settings of each kind of layer as transformers completes them: the file's
    rope_parameters, rope_scaling over the full-attention ones, each kind's rope_theta from
    its older key or its default."""
    rule = ('an object of RoPE settings per kind of layer ("full_attention", '
            '"sliding_attention"), or null')
    _, given = keys.value("rope_parameters", None, rule)
    if given is not None and not (isinstance(given, dict) and set(given) <= set(THETAS) and all(
            v is None or isinstance(v, dict) for v in given.values())):
        keys.wrong("rope_parameters", given, rule)
    out = {kind: dict((given or {}).get(kind) or {"rope_type": "default"}) for kind in THETAS}
    _, legacy = keys.value("rope_scaling", None, "an object of RoPE settings, or null")
    if legacy is not None:
        if not isinstance(legacy, dict):
            keys.wrong("rope_scaling", legacy, "an object of RoPE settings, or null")
        out["full_attention"].update(legacy)
    for kind, (key, default) in THETAS.items():
        if "rope_theta" not in out[kind]:
            out[kind]["rope_theta"] = keys.number(key, None, rule="> 1") or default
    return out


def _rope(keys: HFKeys, sliding: bool) -> dict[str, Any]:
    """Our RoPE fields: the full-attention layers' base and scaling, and, where layers slide,
    theirs (a default RoPE of its own base, or the full-attention layers' very settings)."""
    per = _per_kind(keys)
    kinds = HFKeys({**keys.raw, "rope_parameters": per}, keys.path)
    _, theta, extra = llama_like.read_rope(kinds, NAME, ROPE)
    out = dict(rotary_base=theta, **extra)
    local = "rope_parameters.sliding_attention"
    kind = kinds.text((f"{local}.rope_type", f"{local}.type"), "default")
    if sliding and kind == "default":
        out["local_rotary_base"] = llama_like.read_rope(kinds, NAME, local)[1]
    elif sliding and per["sliding_attention"] != per["full_attention"]:
        keys.refuse(f'{NAME} {local}.rope_type "{kind}" is not supported: the sliding layers\' '
                    "RoPE here is a default one of its own rope_theta, or the very settings of "
                    "the full_attention layers")
    keys.seen |= kinds.seen
    return out


def _read(keys: HFKeys) -> TransformerConfig:
    base = gemma.read_base(keys, NAME, "hidden_activation", 131072)
    pattern = keys.integer("sliding_window_pattern", 6)
    window, full = gemma.read_layers(keys, NAME, base["num_layers"], pattern)
    return keys.build(FAMILY.names(ROPE), **base, **_rope(keys, window is not None),
                      **gemma.read_scores(keys, base["kv_channels"], (None, None)),
                      window_size=window, full_attention_layers=full, sandwich_norms=True,
                      qk_layernorm=True, qk_layernorm_full_width=False)


def _pattern(kinds: list[str]) -> dict[str, int]:
    """``sliding_window_pattern`` p (layer i full when (i + 1) % p == 0), which transformers
    4.50 to 4.52 read instead of ``layer_types``, where some p gives these layer kinds."""
    n = len(kinds)
    return next(({"sliding_window_pattern": p} for p in range(1, n + 2) if kinds == [
        "full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]), {})


def _write(config: TransformerConfig) -> dict[str, Any]:
    out = {**gemma.config_json(config, FAMILY), **gemma.layers_json(config)}
    full, local = out["rope_parameters"], config.local_rotary_base
    sliding = dict(full) if local is None else {"rope_type": "default", "rope_theta": local}
    return {**out, "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
            "rope_local_base_freq": sliding["rope_theta"], **_pattern(out["layer_types"])}


FAMILY = Family(
    model_type="gemma3_text", name=NAME, classes=("Gemma3ForCausalLM",), group=gemma.GROUP,
    read=_read, write=_write, weights=gemma.sandwich_layout, own=_own, scalars=True,
    gemma=True, keys={**gemma.KEYS, "local_rotary_base": "rope_local_base_freq"})
