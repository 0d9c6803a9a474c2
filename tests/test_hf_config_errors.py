"""`domino import` of a ``config.json`` with a key missing, null or of the wrong type or range:
one line on stderr naming the file, the Hugging Face key a user edits (never our own field
names), the rule and the fix; exit code 2, no traceback, no output folder. The configs are
real ones saved by ``transformers`` (tiny sizes), then damaged; every refusal comes before
the weights are read, so the folders hold only config.json."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hf_compat import needs_model_type, rope_kwargs
from test_bad_inputs import _refused

from domino.checkpoint.families.llama_like import KEYS as LLAMA_KEYS
from domino.checkpoint.hf_config import config_from_hf
from domino.checkpoint.hf_keys import HFKeys

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# Our TransformerConfig's names, which a user of config.json never sees.
INTERNAL = ("num_layers", "num_query_groups", "kv_channels", "ffn_hidden_size", "num_experts",
            "moe_router_topk", "moe_ffn_hidden_size", "moe_first_k_dense_layers",
            "moe_aux_loss_coeff", "rotary_base", "rope_scaling_factor", "rope_low_freq_factor",
            "layernorm_epsilon", "init_method_std", "window_size", "seq_length",
            "tensor_model_parallel_size", "TransformerConfig", "add_bias_linear")


@pytest.fixture(scope="module")
def configs() -> dict[str, dict[str, Any]]:
    """Each family's config.json as the installed transformers saves it (the families it has)."""
    import transformers as t

    t = _Present(t)  # (4.x: the families this version has)
    built = {
        "llama": t.LlamaConfig(**SMALL, **rope_kwargs(LLAMA3)),
        "mistral": t.MistralConfig(**SMALL),
        "qwen2": t.Qwen2Config(**SMALL),
        "mixtral": t.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
        "olmoe": t.OlmoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2),
        "olmo2": t.Olmo2Config(**SMALL),
        "qwen3_moe": t.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16),
        "gpt2": t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32,
                             bos_token_id=1, eos_token_id=2),
        "starcoder2": t.Starcoder2Config(**SMALL, sliding_window=16),
        "smollm3": t.SmolLM3Config(**SMALL, no_rope_layer_interval=2),  # [1, 0]: no RoPE on 1
        "phi3": t.Phi3Config(**SMALL, partial_rotary_factor=0.75, sliding_window=16,
                             pad_token_id=0),
    }
    return {name: json.loads(cfg.to_json_string()) for name, cfg in built.items()
            if cfg is not None}


class _Present:
    """transformers, where a config class it lacks builds None."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name, lambda **_: None)


def _pop(*path: str) -> Callable[[dict], None]:
    def damage(raw: dict) -> None:
        for key in path[:-1]:
            raw = raw[key]
        raw.pop(path[-1])
    return damage


def _set(**values: Any) -> Callable[[dict], None]:
    return lambda raw: raw.update(values)


def _as_v5(raw: dict) -> dict:
    """``raw``'s RoPE in transformers 5's spelling, ``rope_parameters`` (as 5.x saves it)."""
    if not raw.get("rope_parameters"):
        rope = raw.pop("rope_scaling", None) or {"rope_type": "default"}
        raw["rope_parameters"] = {**rope, "rope_theta": raw.pop("rope_theta", 10000.0)}
    return raw


def _as_v4(raw: dict) -> dict:
    """``raw``'s RoPE in transformers 4's spelling: ``rope_theta`` on top, the scaling's
    settings in ``rope_scaling`` (as 4.x saves it)."""
    if raw.get("rope_parameters"):
        rope = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    return raw


def _rope(**values: Any) -> Callable[[dict], None]:
    return lambda raw: _as_v5(raw)["rope_parameters"].update(values)


def _legacy(**values: Any) -> Callable[[dict], None]:
    return lambda raw: _as_v4(raw).update(values)


def _pop_any(*keys: str) -> Callable[[dict], None]:
    """Remove each of ``keys`` (transformers 5 and 4 name some settings differently)."""
    return lambda raw: [raw.pop(key, None) for key in keys]


def _old_llama3_without_factor(raw: dict) -> None:
    """The transformers 4 spelling: rope_theta on top, llama3 settings in rope_scaling."""
    del _as_v4(raw)["rope_scaling"]["factor"]


MISSING, NULL = "is missing", "is null"
POSITIVE, NUMBER, FIX = "must be a positive integer", "must be a number", "set it in config.json"
# id: (family, damage, what the line must hold: the HF key first, then the rule and the fix)
CASES: dict[str, tuple[str, Callable[[dict], None], tuple[str, ...]]] = {
    "mistral-no-layers": ("mistral", _pop("num_hidden_layers"),
                          ('"num_hidden_layers"', MISSING, POSITIVE, FIX)),
    "qwen2-no-layers": ("qwen2", _pop("num_hidden_layers"),
                        ('"num_hidden_layers"', MISSING, POSITIVE, FIX)),
    "mixtral-no-experts": ("mixtral", _pop("num_local_experts"),
                           ('"num_local_experts"', MISSING, POSITIVE, FIX)),
    "olmoe-no-experts": ("olmoe", _pop("num_experts"), ('"num_experts"', MISSING, POSITIVE)),
    "olmo2-no-layers": ("olmo2", _pop("num_hidden_layers"),
                        ('"num_hidden_layers"', MISSING, POSITIVE, FIX)),
    "olmo2-bias": ("olmo2", _set(attention_bias=True), ("OLMo 2 attention_bias=true",)),
    "olmo2-eps": ("olmo2", _set(rms_norm_eps=0), ('"rms_norm_eps"', "> 0")),
    "qwen3_moe-no-experts": ("qwen3_moe", _pop_any("num_local_experts", "num_experts"),
                             ('"num_local_experts"', MISSING, POSITIVE)),
    "llama3-rope_scaling-no-factor": ("llama", _old_llama3_without_factor,
                                      ('"rope_scaling.factor"', MISSING, "a number > 0", FIX)),
    "llama3-rope_parameters-no-factor": ("llama", lambda raw: _as_v5(raw)["rope_parameters"]
                                         .pop("factor"),
                                         ('"rope_parameters.factor"', MISSING, NUMBER)),
    "null-hidden_size": ("llama", _set(hidden_size=None), ('"hidden_size"', NULL, POSITIVE, FIX)),
    "null-topk": ("mixtral", _set(num_experts_per_tok=None),
                  ('"num_experts_per_tok"', NULL, POSITIVE)),
    "string-heads": ("llama", _set(num_attention_heads="abc"),
                     ('"num_attention_heads"', '"abc" (a string)', POSITIVE, FIX)),
    "string-intermediate": ("mistral", _set(intermediate_size="64"),
                            ('"intermediate_size"', '"64" (a string)', POSITIVE)),
    "string-eps": ("qwen2", _set(rms_norm_eps="abc"), ('"rms_norm_eps"', NUMBER, FIX)),
    "string-theta": ("llama", _rope(rope_theta="abc"),
                     ('"rope_parameters.rope_theta"', "a number > 1")),
    "string-rope_theta": ("llama", _legacy(rope_theta="abc"), ('"rope_theta"', "a number > 1")),
    "zero-experts": ("mixtral", _set(num_local_experts=0), ('"num_local_experts"', "is 0",
                                                            POSITIVE)),
    "bool-vocab": ("llama", _set(vocab_size=True), ('"vocab_size"', POSITIVE)),
    "string-flag": ("mistral", _set(tie_word_embeddings="false"),
                    ('"tie_word_embeddings"', "must be true or false")),
    "string-window": ("mistral", _set(sliding_window="big"), ('"sliding_window"', POSITIVE)),
    "rope-not-an-object": ("llama", _set(rope_parameters=None, rope_scaling="abc"),
                           ('"rope_scaling"', "a JSON object or null")),
    "dropout-range": ("gpt2", _set(attn_pdrop=1.5), ('"attn_pdrop"', "a number in [0, 1)")),
    "gpt2-no-layers": ("gpt2", _pop("n_layer"), ('"n_layer"', MISSING, POSITIVE)),
    "starcoder2-no-layers": ("starcoder2", _pop("num_hidden_layers"),
                             ('"num_hidden_layers"', MISSING, POSITIVE, FIX)),
    "starcoder2-string-eps": ("starcoder2", _set(norm_epsilon="abc"),
                              ('"norm_epsilon"', NUMBER, FIX)),
    "starcoder2-relu": ("starcoder2", _set(hidden_act="relu"),
                        ("StarCoder2 hidden_act='relu' is not supported", "gelu_pytorch_tanh")),
    "starcoder2-odd-head_dim": ("starcoder2", _set(head_dim=7), ('"head_dim" (7)', "even")),
    "phi3-string-resid_pdrop": ("phi3", _set(resid_pdrop="x"), ('"resid_pdrop"', NUMBER, FIX)),
    "phi3-gelu": ("phi3", _set(hidden_act="gelu"),
                  ("Phi-3 hidden_act='gelu' is not supported", "silu")),
    "phi3-odd-rotation": ("phi3", _rope(partial_rotary_factor=0.625),
                          ("int(head_dim * rope_parameters.partial_rotary_factor) = 5",
                           "must be even")),
    "phi3-longrope-lengths": ("phi3", _rope(rope_type="longrope", short_factor=[1.0] * 2,
                                            long_factor=[1.0] * 3),
                              ("rope_parameters.short_factor=[1.0, 1.0] must be 3 numbers > 0",
                               "(one per rotated channel pair")),
    "phi3-longrope-no-long": ("phi3", _rope(rope_type="longrope", short_factor=[1.0] * 3),
                              ('"rope_parameters.long_factor"', MISSING)),
    "no-model_type": ("llama", _pop("model_type"), ('"model_type"', MISSING, "llama, qwen2")),
    "bad-eos": ("llama", _set(eos_token_id="</s>"), ('"eos_token_id"', "a token id")),
    # Rules between keys, in the keys' own names.
    "kv-heads-divide": ("llama", _set(num_key_value_heads=3),
                        ('"num_key_value_heads" (3)', '"num_attention_heads" (4)',
                         "not divisible")),
    "topk-over-experts": ("mixtral", _set(num_experts_per_tok=8),
                          ('"num_experts_per_tok" (8)', '"num_local_experts" (4)')),
    "olmoe-topk-over-experts": ("olmoe", _set(num_experts_per_tok=8),
                                ('"num_experts_per_tok" (8)', '"num_experts" (4)')),
    "odd-head_dim": ("mistral", _set(head_dim=7), ('"head_dim" (7)', "must be even")),
    "gpt2-heads-divide": ("gpt2", _set(n_embd=30), ('"n_embd" (30)', '"n_head" (4)')),
    "llama3-low-over-high": ("llama", _rope(low_freq_factor=8.0),
                             ('"rope_parameters.low_freq_factor" (8.0)', "high_freq_factor")),
    "dense-over-layers": ("qwen3_moe", _set(mlp_only_layers=[0, 1, 2]),
                          ('"mlp_only_layers"', '"num_hidden_layers" (2)')),
    # SmolLM3's NoPE flags and its window (on every layer or none here).
    "smollm3-short-no_rope": ("smollm3", _set(no_rope_layers=[1]),
                              ('"no_rope_layers"', "num_hidden_layers (2)", "1 (RoPE) or 0")),
    "smollm3-no_rope-values": ("smollm3", _set(no_rope_layers=[1, 2]),
                               ('"no_rope_layers"', "1 (RoPE) or 0 (no RoPE)")),
    "smollm3-zero-interval": ("smollm3", _set(no_rope_layers=None, no_rope_layer_interval=0),
                              ('"no_rope_layer_interval"', POSITIVE)),
    "smollm3-bad-layer_types": ("smollm3", _set(layer_types=["full_attention", "chunked"]),
                                ('"layer_types"', '"sliding_attention"')),
    "smollm3-some-sliding": ("smollm3", _set(use_sliding_window=True, sliding_window=8,
                                             layer_types=["full_attention",
                                                          "sliding_attention"]),
                             ("SmolLM3 with a sliding window on layers 1 only",)),
    "smollm3-sliding-off": ("smollm3", _set(layer_types=["sliding_attention"] * 2),
                            ('"use_sliding_window" false', "full_attention")),
}


def _internal_names(line: str, family: str) -> list[str]:
    own = {"olmoe": {"num_experts"}, "qwen3_moe": {"num_experts"}}.get(family, set())
    return [n for n in INTERNAL if n not in own and re.search(rf"\b{n}\b", line)]


def _import(tmp_path: Path, raw: dict, *flags: str) -> tuple[list[str], Path, Path]:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "out" / "run"
    return ["import", str(folder), str(out), *flags], folder / "config.json", out


def test_the_saved_configs_import(configs: dict[str, dict[str, Any]]) -> None:
    """The undamaged configs are accepted: each refusal below is the damage's."""
    for name, raw in configs.items():
        assert config_from_hf(raw)[0] == name
    # Only the required keys, written by hand: every other one has its default.
    least = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    arch, config, eod = config_from_hf(least)
    assert (arch, config.num_query_groups, config.kv_channels, eod) == ("llama", 4, 8, None)
    assert config.rotary_base == 10000.0 and config.rope_scaling_type is None
    # SmolLM3's defaults: tied, theta 2e6, no RoPE on every 4th layer, the window on its NoPE
    # layers (here 3 and 7 of 8, so some layers slide and others not: refused).
    config = config_from_hf({**least, "model_type": "smollm3", "num_hidden_layers": 8})[1]
    assert not config.untie_embeddings_and_output_weights and config.rotary_base == 2e6
    assert config.nope_layers == (3, 7) and config.window_size is None
    with pytest.raises(ValueError, match="sliding window on layers 3, 7 only"):
        config_from_hf({**least, "model_type": "smollm3", "num_hidden_layers": 8,
                        "use_sliding_window": True, "sliding_window": 4})


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_key_is_named_in_one_line(case: str, configs: dict[str, dict[str, Any]],
                                        tmp_path: Path, capfd) -> None:
    family, damage, wanted = CASES[case]
    needs_model_type(family)
    raw = json.loads(json.dumps(configs[family]))
    damage(raw)
    argv, path, out = _import(tmp_path, raw)
    line = _refused(capfd, argv)
    assert f"{path}: " in line, line
    assert all(w in line for w in wanted), (wanted, line)
    assert not _internal_names(line, family), line
    assert not out.exists() and not out.parent.exists()


def test_a_tp_size_that_does_not_divide_names_the_key(configs: dict[str, dict[str, Any]],
                                                      tmp_path: Path, capfd) -> None:
    argv, path, out = _import(tmp_path, configs["llama"], "--tensor-model-parallel-size", "4")
    line = _refused(capfd, argv)
    assert f"{path}: num_key_value_heads=2: not divisible by --tensor-model-parallel-size=4" \
        in line, line
    assert not _internal_names(line, "llama") and not out.parent.exists()


def test_the_configs_own_checks_speak_in_config_json_keys() -> None:
    """A refusal of our config's own checks (the backstop behind the ones above) is
    translated to the config.json keys."""
    keys = HFKeys({}, "/m/config.json")
    with pytest.raises(ValueError) as err:
        keys.build(LLAMA_KEYS, num_layers=2, hidden_size=32, num_attention_heads=4,
                   num_query_groups=3, vocab_size=64)
    line = str(err.value)
    assert line.startswith("/m/config.json: ") and "num_key_value_heads=3" in line, line
    assert not _internal_names(line, "llama"), line
