"""OLMo 2 against the real ``transformers`` (random weights from a config, nothing downloaded):
its norms after the sublayers (``post_attention_layernorm``, ``post_feedforward_layernorm``)
and its query/key RMSNorms over all heads, imported at TP=1 and TP=2, give the original's
logits and greedy tokens and export back to the same logits; a model of ours with those
settings exports as OLMo 2 with transformers' logits and greedy output (with and without the
KV cache). The norm placement itself is checked against the independent reference under TP in
``test_gpt_tp.py`` (``olmo2_norms_after``, ``norms_after_ln_bias_gelu``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_compat import hf_class, needs_model_type, rope_kwargs
from test_hf_interop import (
    TEXT,
    _hf,
    _hf_logits,
    _llama_config,
    _ours,
    _perturb,
    export_matches,
    import_matches,
)

from domino.checkpoint.families import family_for
from domino.checkpoint.hf_config import config_from_hf
from domino.checkpoint.hf_export import export_hf
from domino.checkpoint.layout import open_checkpoint
from domino.data import BPETokenizer
from domino.inference.sampling import generate

OLMO2 = dict(qk_layernorm=True, qk_layernorm_full_width=True, norm_after_sublayer=True,
             kv_channels=12, rope_scaling_type=None, rotary_base=10000.0)


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


def _olmo2_folder(tmp: Path, bpe: BPETokenizer, **kw) -> tuple[Path, torch.nn.Module]:
    """An Olmo2ForCausalLM (GQA, every norm's weight perturbed)."""
    cfg = hf_class("Olmo2Config")(
        vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, **rope_kwargs({"rope_type": "default", "rope_theta": 10000.0}),
        bos_token_id=bpe.eod, eos_token_id=bpe.eod, pad_token_id=bpe.eod, **kw)
    model = _hf().AutoModelForCausalLM.from_config(cfg)
    _perturb(model, 3)
    folder = tmp / "hf-olmo2"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder, model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_olmo2_imports_and_exports_with_transformers_logits(
        tmp_path: Path, bpe: BPETokenizer, tied: bool, capfd) -> None:
    folder, original = _olmo2_folder(tmp_path, bpe, tie_word_embeddings=tied)
    got = import_matches(tmp_path, folder, original, bpe, capfd)
    config = got.config
    assert config.norm_after_sublayer and config.qk_layernorm_full_width
    assert config.norm_scale_in_fp32  # its bf16 rounding (tests/test_bf16_rounding.py)
    assert config.untie_embeddings_and_output_weights == (not tied)
    step_dir, meta, _ = open_checkpoint(got.two)
    assert export_hf(step_dir, meta, tmp_path / "back") == "olmo2"
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["architectures"] == ["Olmo2ForCausalLM"]
    torch.testing.assert_close(_hf_logits(tmp_path / "back", got.ids), got.expected,
                               rtol=1e-5, atol=1e-5)
    prompt = bpe.encode("def forward")
    assert generate(got.model, got.state, prompt, 10, config.vocab_size, 32) == got.hf_ids

def test_our_post_norm_model_exports_as_olmo2(tmp_path: Path, bpe: BPETokenizer) -> None:
    needs_model_type("olmo2")
    config = _llama_config(bpe.vocab_size, **OLMO2)
    ours, folder = _ours(tmp_path / "run", config, bpe)
    out = tmp_path / "hf"
    assert export_hf(folder, open_checkpoint(folder)[1], out) == "olmo2"
    export_matches(ours, config, out, bpe)


def test_only_olmo2_expresses_norms_after_the_sublayers() -> None:
    with pytest.raises(ValueError, match=r"norms after each sublayer instead of before \(only "
                                         r"OLMo 2 has them\).*As OLMo 2 it has not query/key"):
        family_for(_llama_config(64, norm_after_sublayer=True, kv_channels=12))
    with pytest.raises(ValueError, match=r"As Llama it has query/key norms over all heads in "
                                         r"a dense model with norms before the sublayers"):
        family_for(_llama_config(64, qk_layernorm=True, qk_layernorm_full_width=True,
                                 kv_channels=12))
    raw = {"model_type": "olmo2", "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = config_from_hf(raw)[1]
    assert config.norm_after_sublayer and config.qk_layernorm_full_width
    assert config.norm_scale_in_fp32  # its bf16 rounding (tests/test_bf16_rounding.py)
    assert config.layernorm_epsilon == 1e-5  # Olmo2Config's default
    with pytest.raises(ValueError, match="OLMo 2 attention_bias=true is not supported"):
        config_from_hf({**raw, "attention_bias": True})
