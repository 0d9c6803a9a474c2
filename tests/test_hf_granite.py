"""Granite against the real ``transformers`` (random weights from a config, nothing
downloaded): its four scalars (embedding, residual, attention and logit multipliers) imported at
TP=1 and TP=2 give the original's logits and greedy tokens, export back to the same logits, and
a model of ours with the scalars exports as Granite with transformers' logits and greedy output
(with and without the KV cache). The scalars themselves are checked against the independent
reference under TP in ``test_gpt_tp.py`` (``granite_multipliers``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_compat import hf_version, rope_kwargs
from test_hf_interop import (
    TEXT,
    _as_old_transformers_runs,
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


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


SCALARS = dict(embedding_multiplier=12.0, residual_multiplier=0.22,
               attention_multiplier=0.0078125, logits_scaling=8.0)


def _granite_folder(tmp: Path, bpe: BPETokenizer, **kw) -> tuple[Path, torch.nn.Module]:
    """A GraniteForCausalLM as granite-3 has it (scaled, GQA, head_dim 16 != 48 / 4; 12 before
    transformers 4.48, whose Granite takes hidden size / heads whatever head_dim says)."""
    t = _hf()
    cfg = t.GraniteConfig(
        vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        head_dim=16 if hf_version() >= (4, 48) else 12, rms_norm_eps=1e-6,
        **rope_kwargs({"rope_type": "default", "rope_theta": 10000.0}),
        bos_token_id=bpe.eod, eos_token_id=bpe.eod, **{**SCALARS, **kw})
    model = t.GraniteForCausalLM(cfg)
    _perturb(model, 3)
    folder = tmp / "hf-granite"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder, model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_granite_imports_and_exports_with_transformers_logits(
        tmp_path: Path, bpe: BPETokenizer, tied: bool, capfd) -> None:
    folder, original = _granite_folder(tmp_path, bpe, tie_word_embeddings=tied,
                                       attention_bias=tied, mlp_bias=tied)
    got = import_matches(tmp_path, folder, original, bpe, capfd)
    config = got.config
    assert (config.embedding_multiplier, config.residual_multiplier, config.softmax_scale,
            config.logits_scaling) == tuple(SCALARS.values())
    step_dir, meta, _ = open_checkpoint(got.two)
    assert export_hf(step_dir, meta, tmp_path / "back") == "granite"
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: saved[k] for k in SCALARS} == SCALARS
    torch.testing.assert_close(_hf_logits(tmp_path / "back", got.ids), got.expected,
                               rtol=1e-5, atol=1e-5)
    prompt = bpe.encode("def forward")
    assert generate(got.model, got.state, prompt, 10, config.vocab_size, 32) == got.hf_ids

def test_our_scaled_model_exports_as_granite(tmp_path: Path, bpe: BPETokenizer) -> None:
    config = _llama_config(bpe.vocab_size, rope_scaling_type=None, rotary_base=10000.0,
                           embedding_multiplier=3.0, residual_multiplier=0.5,
                           softmax_scale=0.2, logits_scaling=2.0)
    config = _as_old_transformers_runs(config, tmp_path / "old", bpe)
    ours, folder = _ours(tmp_path / "run", config, bpe)
    out = tmp_path / "hf"
    assert export_hf(folder, open_checkpoint(folder)[1], out) == "granite"
    export_matches(ours, config, out, bpe)


def test_only_granite_expresses_the_scalars_and_its_keys_are_checked() -> None:
    plain = _llama_config(64)
    assert family_for(plain).model_type == "llama"  # unit scalars stay Llama's
    with pytest.raises(ValueError, match=r"As Llama it has sliding-window attention \(Llama "
                                         r"has none\); the logits divided by 2.0 \(only "
                                         r"Granite has it\).*As Granite it has sliding"):
        family_for(_llama_config(64, window_size=8, logits_scaling=2.0))
    raw = {"model_type": "granite", "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert config_from_hf(raw)[1].softmax_scale == 1.0  # transformers' default, not 1/sqrt(d)
    for key in SCALARS:
        for bad in (0, -1.0, None, "x"):
            with pytest.raises(ValueError, match=rf'"{key}" is .*it must be a number > 0'):
                config_from_hf({**raw, key: bad})
    with pytest.raises(ValueError, match="Granite attention_bias != mlp_bias"):
        config_from_hf({**raw, "attention_bias": True})
