"""Phi-3 / Phi-4 (``Phi3ForCausalLM``) against the real ``transformers`` (random weights from a
config, nothing downloaded): fused ``qkv_proj`` and ``gate_up_proj``, grouped-query attention,
RoPE on the whole head or on part of it (Phi-4-mini's ``partial_rotary_factor`` 0.75), a
sliding window on every layer. Imported at TP=1 and TP=2 with the original's logits and greedy
output; exported (our models with partial RoPE, and the import round trip) with the same
logits and greedy output in ``transformers``. LongRoPE (the 128k models):
``test_hf_phi3_longrope.py``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hf_compat import needs_phi3_partial_rotary
from test_hf_interop import (
    TEXT,
    _hf_logits,
    _ours,
    _perturb,
    export_matches,
    import_matches,
)

from domino.checkpoint.families import family_for
from domino.checkpoint.hf_export import export_hf
from domino.checkpoint.layout import open_checkpoint
from domino.config import TransformerConfig
from domino.data import BPETokenizer
from domino.inference.sampling import generate
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState

# name: Phi3Config settings beyond the common ones (head size 16: 64 wide, 4 heads).
MODELS = {
    # as Phi-3-medium: GQA, RoPE on the whole head, untied
    "gqa-full-rope-untied": dict(partial_rotary_factor=1.0, num_key_value_heads=2,
                                 tie_word_embeddings=False),
    # as Phi-4-mini (without its longrope): RoPE on 75% of each head, GQA, tied
    "gqa-partial-0.75-tied": dict(partial_rotary_factor=0.75, num_key_value_heads=2,
                                  tie_word_embeddings=True, rope_theta=250000.0),
    # as Phi-3-mini-4k: a window on every layer (shorter than the text), one K/V per head
    "mha-partial-0.5-window": dict(partial_rotary_factor=0.5, num_key_value_heads=4,
                                   sliding_window=6, tie_word_embeddings=False),
}


def _hf():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


def _phi3_config(bpe: BPETokenizer, **kw):
    eod = bpe.eod
    base = dict(vocab_size=bpe.vocab_size, hidden_size=64, intermediate_size=80,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                rms_norm_eps=1e-5, bos_token_id=eod, eos_token_id=eod, pad_token_id=eod)
    return _hf().Phi3Config(**{**base, **kw})


def _phi3_folder(tmp: Path, bpe: BPETokenizer, name: str) -> tuple[Path, torch.nn.Module]:
    """A transformers Phi-3 with random weights, saved the way the Hub holds models."""
    model = _hf().Phi3ForCausalLM(_phi3_config(bpe, **MODELS[name]))
    _perturb(model, 7)
    folder = tmp / "hf-phi3"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder, model.eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_import_matches_transformers(tmp_path: Path, bpe: BPETokenizer, name: str,
                                     capfd) -> None:
    if MODELS[name]["partial_rotary_factor"] < 1:
        needs_phi3_partial_rotary()
    folder, original = _phi3_folder(tmp_path, bpe, name)
    got = import_matches(tmp_path, folder, original, bpe, capfd, new_tokens=12)
    config, ids, expected, two = got.config, got.ids, got.expected, got.two
    settings = MODELS[name]
    assert config.rotary_percent == settings["partial_rotary_factor"]
    assert config.window_size == settings.get("sliding_window")
    assert config.num_query_groups == settings["num_key_value_heads"]
    assert expected.abs().max() > 1.0
    # Greedy: transformers.generate == ours at TP=1 with and without the cache (TP=2 above).
    prompt = bpe.encode("def forward")
    for cache in (True, False):
        assert generate(got.model, got.state, prompt, 12, config.vocab_size, 64,
                        stop=(bpe.eod,), use_cache=cache) == got.hf_ids
    # Round trip: exported again, transformers reads the original back (as Phi-3 with partial
    # RoPE; rotating whole heads, the same model is a Llama, the first family that expresses it).
    step_dir, meta, _ = open_checkpoint(two)
    back = tmp_path / "back"
    arch = "phi3" if config.rotary_percent < 1 else "llama"
    assert export_hf(step_dir, meta, back) == arch
    assert json.loads((back / "config.json").read_text())["model_type"] == arch
    torch.testing.assert_close(_hf_logits(back, ids), expected, rtol=1e-5, atol=1e-5)


def _partial_config(vocab: int, **kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                kv_channels=16, ffn_hidden_size=64, vocab_size=vocab, seq_length=64,
                max_position_embeddings=64, position_embedding_type="rope",
                rotary_percent=0.75, rotary_base=10000.0, normalization="RMSNorm",
                activation="swiglu", add_bias_linear=False, layernorm_epsilon=1e-5,
                untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                attention_dropout=0.0)
    return TransformerConfig(**{**base, **kw})


@pytest.mark.parametrize("case", ["partial-gqa-untied", "partial-window-tied"])
def test_export_of_partial_rope_is_phi3(tmp_path: Path, bpe: BPETokenizer, case: str) -> None:
    """Our model with RoPE on 75% of each head (12 of 16 channels, GQA) exports as Phi-3:
    transformers' logits and greedy output equal ours, with and without the KV cache."""
    needs_phi3_partial_rotary()
    extra = {} if case.startswith("partial-gqa") else dict(
        window_size=7, untie_embeddings_and_output_weights=False)
    config = _partial_config(bpe.vocab_size, **extra)
    ours, folder = _ours(tmp_path / "run", config, bpe)
    out = tmp_path / "hf"
    assert export_hf(folder, open_checkpoint(folder)[1], out) == "phi3"
    ids, mine = export_matches(ours, config, out, bpe, cache_tokens=64)
    state = ParallelState.single()
    # The partial rotation bites: rotating whole heads gives other logits.
    whole = GPTModel(dataclasses.replace(config, rotary_percent=1.0), parallel_state=state)
    whole.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert not torch.allclose(whole.eval()(ids, None, None)[..., :config.vocab_size],
                                  mine, atol=1e-3)


def test_a_llama_stays_a_llama_and_phi3_refuses_what_it_lacks(bpe: BPETokenizer) -> None:
    """Whole-head RoPE without biases is still written as Llama (listed first); Phi-3 names what
    it cannot express."""
    assert family_for(_partial_config(bpe.vocab_size, rotary_percent=1.0)).model_type == "llama"
    config = _partial_config(bpe.vocab_size, add_bias_linear=True)
    with pytest.raises(ValueError, match=r"As Phi-3 it has biases \(Phi-3 has none\)"):
        family_for(config)
    with pytest.raises(ValueError, match=r"As Phi-3 it has logits_scaling=2.0 \(Phi-3 has "
                                         r"no such setting\)"):
        family_for(_partial_config(bpe.vocab_size, logits_scaling=2.0))
    with pytest.raises(ValueError, match=r"As Phi-3 it has a head size of 16, not hidden size"):
        family_for(_partial_config(bpe.vocab_size, hidden_size=48))
