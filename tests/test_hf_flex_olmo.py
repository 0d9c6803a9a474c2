"""FlexOlmo against the real ``transformers`` (random weights from a config, nothing
downloaded): OLMoE's experts under OLMo 2's layer (norms after attention and the MLP, query/key
norms over all heads). Imported at TP=1 it gives the original's logits and greedy tokens and
exports back to the same logits; imported at TP=2 it gives them at TP=2 x EP=2 and TP=1 x EP=4.
A model of ours with those settings exports as FlexOlmo and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_compat import hf_class, rope_kwargs
from test_hf_interop import TEXT, _hf, _llama_config, _perturb, moe_import_matches

from domino.checkpoint.families import family_for
from domino.data import BPETokenizer

FLEX = dict(num_experts=4, qk_layernorm=True, qk_layernorm_full_width=True,
            norm_after_sublayer=True, norm_scale_in_fp32=True, rope_scaling_type=None,
            rotary_base=10000.0, kv_channels=12)


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


def _flex_folder(tmp: Path, bpe: BPETokenizer) -> tuple[Path, torch.nn.Module]:
    """A FlexOlmoForCausalLM: 4 experts of width 24, top-2 as scored, GQA, untied."""
    cfg = hf_class("FlexOlmoConfig")(
        vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        **rope_kwargs({"rope_type": "default", "rope_theta": 10000.0}),
        bos_token_id=bpe.eod, eos_token_id=bpe.eod, pad_token_id=bpe.eod)
    model = _hf().AutoModelForCausalLM.from_config(cfg)
    _perturb(model, 7)
    folder = tmp / "hf-flex"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder, model.eval()


def test_flex_olmo_imports_and_exports_with_transformers_logits(
        tmp_path: Path, bpe: BPETokenizer) -> None:
    folder, original = _flex_folder(tmp_path, bpe)
    config = moe_import_matches(tmp_path, folder, original, bpe, "flex_olmo")
    assert config.num_experts == 4 and config.norm_after_sublayer and config.norm_scale_in_fp32
    assert config.qk_layernorm_full_width and config.moe_router_pre_softmax
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["architectures"] == ["FlexOlmoForCausalLM"] and "head_dim" not in saved


def test_only_flex_olmo_expresses_experts_under_norms_after(bpe: BPETokenizer) -> None:
    config = _llama_config(bpe.vocab_size, **FLEX)
    assert family_for(config).model_type == "flex_olmo"
    # Without the experts it is OLMo 2; with norms before the sublayers, OLMoE.
    dense = {**FLEX, "num_experts": None}
    assert family_for(_llama_config(bpe.vocab_size, **dense)).model_type == "olmo2"
    before = {**FLEX, "norm_after_sublayer": False, "norm_scale_in_fp32": False}
    assert family_for(_llama_config(bpe.vocab_size, **before)).model_type == "olmoe"
