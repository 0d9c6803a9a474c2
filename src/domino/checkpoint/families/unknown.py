"""The refusal of a ``config.json`` whose ``model_type`` no family reads, naming what stands in
the way, in one line: what no family domino reads has (the settings of
:mod:`~domino.checkpoint.families.settings` in the file's own keys and values, and what the
``model_type``'s modeling code does that its config.json does not show, :data:`STRUCTURE`);
or, when there is none of that, the nearest family: the one whose reading of the file, written
back as its own config.json, accounts for every setting. A file all of whose settings are one
family's names that family (set ``model_type`` to it to import: the name alone is no proof,
so import does not do it by itself); otherwise the settings the family leaves out are named,
or, when no family reads the file at all, why the nearest one refuses it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, NoReturn

from domino.checkpoint.families import FAMILIES, readable, settings
from domino.checkpoint.families.common import GELU_FROM_HF
from domino.checkpoint.families.family import Family
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

Raw = dict[str, Any]
_FIELDS = [f.name for f in fields(TransformerConfig)]

# What each model_type's modeling code does that its config.json does not show (its weights'
# layout, its norms, its MLP), for the types whose settings alone would read as a family's.
_POST_LN = "norms after each residual add (post-LN)"
_PARALLEL = "attention and the MLP side by side on one norm"
_INTERLEAVED = "RoPE on interleaved channel pairs"
_NO_GATE = "an MLP without a gate (up_proj, down_proj)"
_GRANITE_MOE = ("Mixture-of-Experts layers with each layer's experts in two fused weights "
                "(block_sparse_moe.input_linear, output_linear)")
STRUCTURE: dict[str, tuple[str, ...]] = {
    "apertus": ("an MLP without a gate with the xIELU activation (learned alpha_p, alpha_n)",),
    "apertus1p5_text": ("an MLP without a gate with the xIELU activation",),
    "arcee": (_NO_GATE,),
    "bert-generation": (_POST_LN,),
    "bitnet": ("ternary weights with norms inside attention and the MLP (attn_sub_norm, "
               "ffn_sub_norm)",),
    "bloom": ("ALiBi position biases", "a norm on the embeddings"),
    "codegen": ("Q/K/V fused in CodeGen's order (qkv_proj)", _INTERLEAVED, _PARALLEL),
    "cohere": (_PARALLEL, "LayerNorm without bias"),
    "cohere2": (_PARALLEL, "LayerNorm without bias"),
    "cohere_compass_text": (_PARALLEL,),
    "ctrl": ("sinusoidal positions", "the embeddings multiplied by sqrt(n_embd)"),
    "doge": ("dynamic mask attention (A, dt_proj)", "learned residual scales"),
    "ernie4_5": (_INTERLEAVED,),
    "ernie4_5_moe": (_INTERLEAVED,),
    "exaone": ("Llama's layout under EXAONE's weight names (transformer.h.N.attn.attention.*, "
               "mlp.c_fc_0)",),
    "glm": ("the MLP's gate and up projections fused (gate_up_proj)", _INTERLEAVED),
    "glm4": ("the MLP's gate and up projections fused (gate_up_proj)", _INTERLEAVED,
             "norms after attention and after the MLP as well (post_self_attn_layernorm, "
             "post_mlp_layernorm)"),
    "glm4_moe": (_INTERLEAVED,),
    "gptj": (_INTERLEAVED, _PARALLEL),
    "granitemoe": (_GRANITE_MOE,),
    "granitemoeshared": (_GRANITE_MOE, "a shared MLP beside the experts (shared_mlp)"),
    "helium": (_INTERLEAVED,),
    "hunyuan_v1_dense": ("RMSNorm on each head's queries and keys after RoPE "
                         "(query_layernorm, key_layernorm)",),
    "hunyuan_v1_moe": ("RMSNorm on each head's queries and keys after RoPE "
                       "(query_layernorm, key_layernorm)",),
    "jais2": ("LayerNorm with " + _NO_GATE,),
    "jetmoe": ("a mixture of attention experts (self_attention.experts)",),
    "minicpm5_moe": ("a gate on the attention output (q_gate_proj)",),
    "minimax_m2": ("RMSNorm over all heads' queries and keys (q_norm, k_norm)",
                   "a sigmoid router with a per-expert bias (e_score_correction_bias)"),
    "mpt": ("Q/K/V fused in one Wqkv weight, LayerNorm without bias",),
    "nemotron": ("LayerNorm scaling by (1 + weight)", _NO_GATE),
    "olmo": ("LayerNorm without weights or biases",),
    "openai-gpt": (_POST_LN,),
    "opt": ("learned positions offset by 2 (OPT's embed_positions)",),
    "persimmon": ("LayerNorm on each head's queries and keys", _NO_GATE),
    "phi": (_PARALLEL,),
    "phimoe": ("LayerNorm (with bias) in Mixtral's layout", "SparseMixer routing"),
    "stablelm": ("LayerNorm (with bias) with a SwiGLU MLP",),
    # (transformers 4.x only)
    "transfo-xl": ("relative-position attention over a memory of past segments (mem_len)",
                   "adaptive input embeddings and softmax (cutoffs, div_val)"),
}

# Keys a family writes that a config.json of the same model may leave out (derived from others
# or left at transformers' default).
_DERIVED = {"head_dim", "rope_theta", "rope_scaling", "rope_parameters", "pretraining_tp",
            "clip_qkv", "decoder_sparse_step", "mlp_only_layers", "n_inner"}


# ---- what each key of a config.json is --------------------------------------------------------

_HARMLESS = {
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
    "_name_or_path", "output_attentions", "use_cache", "output_router_logits",
    "router_aux_loss_coef", "aux_loss_coef", "router_jitter_noise", "input_jitter_noise",
    "tokenizer_class", "prefix", "task_specific_params", "num_logits_to_keep",
    "model_max_length", "seed", "is_decoder", "tie_encoder_decoder", "pretraining_tp",
    "attention_softmax_in_fp32", "scale_attention_softmax_in_fp32", "reorder_and_upcast_attn",
    "use_mamba_kernels", "use_mambapy", "use_associative_scan", "use_mem_eff_path",
    "residual_in_fp32", "rescale_prenorm_residual", "z_loss_coefficient",
    "num_nextn_predict_layers", "num_mtp_layers", "transformers.js_config",
    "keys_to_ignore_at_inference",
    "use_return_dict", "torchscript", "pruned_heads", "tf_legacy_loss", "use_bfloat16",
    "finetuning_task", "forced_bos_token_id", "forced_eos_token_id", "max_length",
    "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
}
_HARMLESS_PARTS = ("_token_id", "_token_ids", "_token_index", "dropout", "pdrop", "layerdrop",
                   "init", "summary_", "classifier_", "mtp_", "_dtype", "_kernel_dtype")


def harmless(key: str) -> bool:
    """The key never changes what the model computes from given weights."""
    return key in _HARMLESS or any(p in key for p in _HARMLESS_PARTS)


def inert(key: str, raw: Raw) -> bool:
    """``raw[key]`` changes nothing: the key is harmless, null, or at its neutral value."""
    value = raw.get(key)
    setting = settings.SETTINGS.get(key)
    return harmless(key) or value is None or (setting is not None
                                              and setting.inert(value, raw))


def shown(value: Any) -> str:
    """A value as config.json writes it, long lists and objects shortened."""
    if isinstance(value, list) and len(value) > 6:
        return json.dumps(value[:4])[:-1] + f", ... ({len(value)} values)]"
    if isinstance(value, dict):
        return "{...}"
    text = json.dumps(value)
    return text if len(text) <= 48 else text[:45] + "..."


def describe(key: str, raw: Raw) -> str:
    """``key=value (what it sets)``: the table's words, or those of a key domino does not
    read."""
    setting, value = settings.SETTINGS.get(key), raw.get(key)
    if setting is None:
        return f"{key}={shown(value)} (a setting domino does not read)"
    meaning = setting.meaning(value, raw) if callable(setting.meaning) else setting.meaning
    if key in ("layer_types",) + settings.COMPOSITE:
        return meaning
    if isinstance(value, dict):
        return f"{key} ({meaning})"
    return f"{key}={shown(value)} ({meaning})"


def described(keys: list[str], raw: Raw) -> list[str]:
    """:func:`describe` of each key, each group of keys named once."""
    out, groups = [], set()
    for key in keys:
        group = settings.SETTINGS[key].group if key in settings.SETTINGS else None
        if group is None or group not in groups:
            out.append(describe(key, raw))
        if group is not None:
            groups.add(group)
    return out


def lacking(raw: Raw) -> list[str]:
    """What of ``raw`` no family has, key by key (in the file's order)."""
    keys = [k for k, s in settings.SETTINGS.items() if k in raw and not inert(k, raw)
            and s.lacks(raw[k], raw)]
    return described(sorted(keys, key=list(raw).index), raw)


# ---- the families' readings -------------------------------------------------------------------


@dataclass
class Reading:
    """A family's reading of the file: what of it the family's own config.json leaves out
    (``left``: keys, in the file's order) and how many keys it sets that the file does not
    (``unset``), or why the family refuses the file (``error``)."""

    family: Family
    left: list[str] | None = None
    unset: int = 0
    error: str = ""
    known: int = 0  # the file's settings the family knows (reads, or has a key for)


def _same(ours: Any, theirs: Any) -> bool:
    """Equal as config.json values (numbers within rounding; objects key by key of ours)."""
    if isinstance(ours, bool) or isinstance(theirs, bool) or ours is None or theirs is None:
        return ours is theirs or ours == theirs and type(ours) is type(theirs)
    if isinstance(ours, int | float) and isinstance(theirs, int | float):
        return math.isclose(ours, theirs, rel_tol=1e-9)
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return all(_same(v, theirs.get(k)) for k, v in ours.items())
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(map(_same, ours, theirs))
    return ours == theirs


def _rope_same(value: Any, raw: Raw, written: Raw) -> bool:
    theirs = settings.rope_dict(written.get("rope_parameters"))
    return all(_same(v, theirs.get(k)) or (k == "partial_rotary_factor" and v == 1)
               for k, v in settings.rope_dict(value).items())


def _layers_same(value: Any, raw: Raw, written: Raw) -> bool:
    """The family's own layer kinds (Gemma 2/3's), or one kind of layer, sliding exactly where
    the family's config has a window."""
    if isinstance(written.get("layer_types"), list):
        return value == written["layer_types"]
    kinds = set(value) if isinstance(value, list) else set()
    window = written.get("sliding_window") is not None and written.get(
        "use_sliding_window", True) is not False
    return kinds == {"sliding_attention" if window else "full_attention"}


def _act_same(value: Any, raw: Raw, written: Raw) -> bool:
    ours = written.get("hidden_act", written.get("activation_function"))
    return isinstance(value, str) and GELU_FROM_HF.get(value, value) == GELU_FROM_HF.get(
        ours, ours)


# Spellings of one setting (transformers' attribute maps): a family may read one, write another.
_ALIASES = {"hidden_size": ("n_embd", "d_model"), "num_hidden_layers": ("n_layer",),
            "num_attention_heads": ("n_head",), "max_position_embeddings": ("n_positions",),
            "intermediate_size": ("n_inner",), "layer_norm_eps": ("layer_norm_epsilon",)}
_ALIASES.update({a: (key,) for key, names in list(_ALIASES.items()) for a in names})

_COMPARE = {"rope_parameters": _rope_same, "rope_scaling": _rope_same,
            "layer_types": _layers_same, "hidden_act": _act_same,
            "hidden_activation": _act_same, "activation_function": _act_same}


def _accounted(key: str, raw: Raw, written: Raw) -> bool:
    """``raw[key]`` means the same in the family's config.json ``written``, or nothing."""
    if key == "model_type" or inert(key, raw):
        return True
    if key in _COMPARE:
        return _COMPARE[key](raw[key], raw, written)
    return any(k in written and _same(raw[key], written[k])
               for k in (key, *_ALIASES.get(key, ())))


def _reading(family: Family, raw: Raw, path: Any) -> Reading:
    keys = HFKeys({**raw, "model_type": family.model_type}, path)
    meaningful = {k for k in raw if not inert(k, raw)}
    vocabulary = {family.key(f).split(".")[0] for f in _FIELDS}  # (the keys it names)
    try:
        config = family.read(keys)  # type: ignore[misc]
        written = family.write(config) if family.write is not None else {}
    except ValueError as err:
        error = str(err).removeprefix(f"{path}: ")
        return Reading(family, error=error, known=len(meaningful & (vocabulary | keys.seen)))
    left = [k for k in raw if not _accounted(k, raw, written)]
    unset = sum(k not in raw and k not in _DERIVED and not harmless(k) for k in written)
    known = len(meaningful & (vocabulary | keys.seen | set(written)))
    return Reading(family, left=left, unset=unset, known=known)


def nearest(raw: Raw, path: Any = "config.json",
            families: list[Family] = FAMILIES) -> Reading:
    """The family whose reading accounts for every setting of the file (the one that sets the
    fewest the file does not, then the first listed); else the one that knows most of the
    file's settings, a reading before a refusal, then the fewest left out or set anew."""
    readings = [_reading(f, raw, path) for f in families if f.read is not None]
    whole = [r for r in readings if r.left == []]
    if whole:
        return min(whole, key=lambda r: r.unset)
    return max(readings, key=lambda r: (r.known, r.left is not None, -len(r.left or ()),
                                        -r.unset))


def refuse(keys: HFKeys, arch: str, lacks: tuple[str, ...] = ()) -> NoReturn:
    """Refuse ``keys``' config.json of ``arch`` (a model_type no family reads; ``lacks``: what
    its family says it lacks), naming what stands in the way or the family it matches."""
    reads = f"`domino import` reads {', '.join(readable())} models"
    raw, head = keys.raw, f"model_type {arch!r} is not supported"
    items = list(lacks or STRUCTURE.get(arch, ())) + lacking(raw)
    if items:
        keys.refuse(f"{head}: it has {'; '.join(items)}, which no family domino reads has; "
                    f"{reads}")
    near = nearest(raw, keys.path)
    name, kind = near.family.name, near.family.model_type
    if near.left is None:
        keys.refuse(f"{head}: as {name}, the nearest family domino reads, {near.error}; "
                    f"{reads}")
    if near.left:
        keys.refuse(f"{head}: read as {name}, the nearest family domino reads, it still sets "
                    f"{'; '.join(described(near.left, raw))}, which {name} has not; "
                    f"{reads}")
    keys.refuse(f"model_type {arch!r} is not one `domino import` reads, but every setting of "
                f"this config.json is one {name} has: if the model is a {name} under another "
                f'name, set "model_type": "{kind}" in config.json to import it (the import then '
                f"checks each weight's name and shape against {name}'s)")
