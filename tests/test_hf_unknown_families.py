"""`domino import` of a ``config.json`` whose ``model_type`` no family reads, checked against
``transformers`` itself: every causal-LM type it knows is either read by a family or refused in
one line (exit 2, nothing written) that names what stands in the way, in the file's own keys
and values, or the family whose settings it has, never the bare "not supported"; each family
named so is checked by importing a model of that type, with random weights, under the
family's name and comparing logits with the original's. Config-only refusals need no weights:
they come before any weight is read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_compat import is_v5
from test_bad_inputs import _refused

from domino.checkpoint.families import family_named, readable
from domino.checkpoint.families.gemma import FAMILY as GEMMA
from domino.checkpoint.families.unknown import STRUCTURE
from domino.checkpoint.hf_config import config_from_hf
from domino.checkpoint.hf_import import import_hf
from domino.checkpoint.layout import open_checkpoint
from domino.data import BPETokenizer
from domino.inference.loading import load_saved_model
from domino.parallel_state import ParallelState

BARE = re.compile(r"is not supported; `domino import` reads")
MATCH = re.compile(r'set "model_type": "(\w+)" in config\.json')
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, moe_intermediate_size=32,
             num_local_experts=4, num_experts=4, num_experts_per_tok=2)


def _hf():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


@pytest.fixture(scope="module")
def defaults() -> dict[str, dict[str, Any]]:
    """Each causal-LM model_type's default config.json (its config class built without
    arguments), as transformers saves it; the types whose class needs arguments are left out
    (and counted)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _hf()
    out, failed = {}, []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            out[model_type] = json.loads(CONFIG_MAPPING[model_type]().to_json_string())
        except Exception:  # (a class whose defaults do not validate)
            failed.append(model_type)
    # (transformers 4.45 knows 84 causal-LM types, 5.x over 100)
    assert len(out) >= (100 if is_v5() else 80) and len(failed) <= len(out) // 10, failed
    return out


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(["alpha beta gamma delta " * 40, "def f(x): return x\n" * 20] * 5,
                              vocab_size=300)


def _refusal(tmp_path: Path, capfd, raw: dict[str, Any], name: str) -> str:
    """The one-line refusal of ``domino import`` of a folder holding only this config.json;
    nothing is written."""
    folder, out = tmp_path / name / "hf", tmp_path / name / "out" / "run"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    line = _refused(capfd, ["import", str(folder), str(out)])
    assert f"{folder / 'config.json'}: " in line, line
    assert not out.exists() and not out.parent.exists(), line
    return line


def _names_something(line: str, raw: dict[str, Any], model_type: str) -> bool:
    """The refusal names a setting of the file, what the type's code does (its structure) or
    a family it matches."""
    why = line.split(" is not supported: ", 1)[-1]
    facts = STRUCTURE.get(model_type, ()) + (GEMMA.lacks(model_type) if GEMMA.lacks else ())
    return bool(MATCH.search(line)) or any(
        re.search(rf"\b{re.escape(k)}\b", why) for k in raw if k != "model_type") or any(
        f in why for f in facts)


def test_every_causal_lm_type_is_read_or_refused_by_what_it_has(
        defaults: dict[str, dict[str, Any]], tmp_path: Path, capfd) -> None:
    read = 0
    for model_type, raw in defaults.items():
        # (gpt-sw3 and 4.x's code_llama are built by GPT-2's and Llama's config classes)
        if raw["model_type"] in readable() or model_type == "gpt-sw3":
            assert config_from_hf(raw)[0] == raw["model_type"], model_type
            read += 1
            continue
        line = _refusal(tmp_path, capfd, raw, model_type)
        assert f"model_type {model_type!r} is not" in line, line
        assert not BARE.search(line), line
        assert _names_something(line, raw, model_type), line
    # (gemma's types are refused; 4.x lacks the newer families' types)
    assert read >= len(set(readable()) & set(defaults)) - 1
    # What a type's code hides is listed only for types no family reads (a new family's
    # entry goes with it).
    assert not [t for t in STRUCTURE if (f := family_named(t)) is not None and f.read], STRUCTURE


def test_a_damaged_value_is_still_refused_in_one_line(
        defaults: dict[str, dict[str, Any]]) -> None:
    """Any key of a file no family reads, at a value of the wrong type, is refused as a
    ValueError (one line at the command line), never another exception."""
    values = ["x", -1, True, [1, "a"], {"a": 1}, None, 1e30, [], 3.5]
    types = [t for t in ("helium", "cohere", "ministral", "deepseek_v3") if t in defaults]
    assert "cohere" in types  # (the others are newer than transformers 4.45)
    for model_type in types:
        raw = defaults[model_type]
        for key in raw:
            for value in values:
                with pytest.raises(ValueError):
                    config_from_hf({**raw, key: value})


def _small(raw: dict[str, Any], vocab: int) -> dict[str, Any]:
    """A default config.json at test size (the keys it has set small, one window of 8)."""
    out = {**raw, **{k: v for k, v in SMALL.items() if k in raw}, "vocab_size": vocab}
    if "head_dim" in out:
        out["head_dim"] = 16
    if out.get("sliding_window"):
        out["sliding_window"] = 8
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:2]
    if isinstance(out.get("no_rope_layers"), list):
        out["no_rope_layers"] = out["no_rope_layers"][:2]
    return {**out, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def _imports_as(tmp: Path, bpe: BPETokenizer, raw: dict[str, Any], family: str) -> None:
    """A model of ``raw``'s type with random weights, saved by transformers with model_type
    set to ``family``, imports with the original's logits."""
    t = _hf()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw["model_type"]
    config = CONFIG_MAPPING[model_type].from_dict({k: v for k, v in raw.items()
                                                   if k != "model_type"})
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    folder = tmp / f"hf-{model_type}"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "model_type": family}))
    ids = torch.randint(0, bpe.vocab_size, (1, 20), generator=gen)
    with torch.no_grad():
        want = model(ids).logits
    import_hf(folder, tmp / f"run-{model_type}", 1)
    ours, cfg, _, _ = load_saved_model(open_checkpoint(tmp / f"run-{model_type}")[0],
                                       ParallelState.single())
    with torch.no_grad():
        got = ours(ids, None, None)[..., :cfg.vocab_size]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{model_type}: {m}")


def _matched(raw: dict[str, Any]) -> str | None:
    try:
        config_from_hf(raw)
    except ValueError as err:
        found = MATCH.search(str(err))
        return found[1] if found else None
    return None


def test_each_family_a_refusal_names_is_the_model(defaults: dict[str, dict[str, Any]],
                                                  bpe: BPETokenizer, tmp_path: Path) -> None:
    """Every type whose refusal says "set model_type to F" is F: renamed, it imports with
    transformers' logits (so the match is real, and STRUCTURE lists what the settings hide)."""
    cases = {mt: _small(raw, bpe.vocab_size) for mt, raw in defaults.items()
             if mt not in readable() and _matched(raw)}
    assert {"ministral"} & set(defaults) <= set(cases), sorted(cases)  # (4.57 on)
    for model_type, raw in cases.items():
        family = _matched(raw)
        assert family is not None, model_type
        _imports_as(tmp_path, bpe, raw, family)


# ---- the refusals, word for word ---------------------------------------------------------------

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2)


def _saved(name: str, **kw: Any) -> dict[str, Any]:
    config = getattr(_hf(), name)(**{**TINY, **kw})
    return json.loads(config.to_json_string())


def _has(*names: str) -> bool:
    """Whether the installed transformers has these classes (4.x lacks the newer families)."""
    return all(hasattr(_hf(), name) for name in names)


def _reason(line: str) -> str:
    return line.split(" is not supported: ", 1)[1].split("; `domino import` reads ")[0]


def test_the_refusals_name_each_setting_in_the_files_keys(tmp_path: Path, capfd) -> None:
    """(Each family the installed transformers has: 4.x lacks the newer ones.)"""
    t = _hf()
    if _has("Gemma3Config"):
        vision = json.loads(t.Gemma3Config(text_config=t.Gemma3TextConfig(**TINY))
                            .to_json_string())
        assert _reason(_refusal(tmp_path, capfd, vision, "gemma3")) == (
            "it has a model in several parts (text_config, vision_config; domino import reads "
            "a text decoder's own config.json), which no family domino reads has")
    if _has("VaultGemmaConfig"):
        vault = config_from_hf(_saved("VaultGemmaConfig"))[1]  # read now (test_hf_gemma.py)
        assert not vault.sandwich_norms and vault.full_attention_layers == (1, 3)
    gemma2 = config_from_hf(_saved("Gemma2Config"))[1]  # read now (test_hf_gemma.py)
    assert gemma2.sandwich_norms and gemma2.full_attention_layers == (1, 3)
    if _has("Olmo2Config"):
        olmo2 = config_from_hf(_saved("Olmo2Config"))[1]  # read now (test_hf_olmo2.py)
        assert olmo2.norm_after_sublayer and olmo2.qk_layernorm_full_width
    granite = _saved("GraniteConfig", embedding_multiplier=12.0, residual_multiplier=0.22,
                     attention_multiplier=0.0078125, logits_scaling=8.0)
    assert config_from_hf(granite)[1].logits_scaling == 8.0  # read now (test_hf_granite.py)
    phi4 = _saved("Phi3Config", partial_rotary_factor=0.75)  # as Phi-4-mini: read now
    assert config_from_hf(phi4)[1].rotary_percent == 0.75
    if _has("SmolLM3Config"):
        smollm3 = _saved("SmolLM3Config", no_rope_layer_interval=2)  # (test_hf_interop.py)
        assert config_from_hf(smollm3)[1].nope_layers == (1, 3)


def test_a_renamed_family_is_named_and_an_unread_key_keeps_it_out(tmp_path: Path,
                                                                 capfd) -> None:
    qwen2 = {**_saved("Qwen2Config"), "model_type": "my_qwen"}
    line = _refusal(tmp_path, capfd, qwen2, "renamed")
    assert line.endswith(
        "model_type 'my_qwen' is not one `domino import` reads, but every setting of this "
        "config.json is one Qwen2 has: if the model is a Qwen2 under another name, set "
        '"model_type": "qwen2" in config.json to import it (the import then checks each '
        "weight's name and shape against Qwen2's)"), line
    if _has("MinistralConfig"):  # (4.57 on)
        ministral = _saved("MinistralConfig", sliding_window=16)  # every layer sliding
        assert 'set "model_type": "mistral"' in _refusal(tmp_path, capfd, ministral,
                                                          "ministral")
    # A key no family reads keeps the match out, named with its value.
    odd = {**qwen2, "frobnicate_heads": 3}
    assert _reason(_refusal(tmp_path, capfd, odd, "odd")) == (
        "read as Qwen2, the nearest family domino reads, it still sets frobnicate_heads=3 (a "
        "setting domino does not read), which Qwen2 has not")
    # A file no family reads at all: the nearest family's own refusal, in the file's keys.
    llama = {**_saved("LlamaConfig"), "model_type": "my_llama", "pretraining_tp": 2}
    assert _reason(_refusal(tmp_path, capfd, llama, "tp")) == (
        "as Llama, the nearest family domino reads, Llama pretraining_tp=2 is not supported "
        "(only 1)")
