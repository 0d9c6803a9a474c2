"""In bf16 our RMSNorms and Gemma's embedding scale round where transformers' do: Llama's
(and most families') norm rounds the normalised activations, then multiplies by the weight;
OLMo 2's (``norm_scale_in_fp32``) and Gemma's (``layernorm_zero_centered_gamma``: 1 + weight)
multiply in fp32, then round; Gemma's sqrt(hidden) is rounded before it scales the embeddings.
Checked bit for bit against transformers' own classes on the same weights and inputs (older
releases round otherwise in two places, each checked as that release rounds: OLMo 2's norm as
Llama's before 4.52, Gemma 3's unrounded sqrt(hidden) in 4.50)."""

from __future__ import annotations

import pytest
import torch
from hf_compat import hf_version, needs_model_type

from domino.config import TransformerConfig
from domino.transformer.norms import build_norm

HIDDEN = 96


def _config(**over) -> TransformerConfig:
    return TransformerConfig(**{"num_layers": 1, "hidden_size": HIDDEN,
                                "num_attention_heads": 4, "normalization": "RMSNorm",
                                "layernorm_epsilon": 1e-6, "params_dtype": torch.bfloat16,
                                **over})


def _theirs(kind: str) -> torch.nn.Module:
    """transformers' RMSNorm of ``kind`` (skipped where the installed version lacks it)."""
    import importlib

    needs_model_type({"gemma3": "gemma3_text"}.get(kind, kind))
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    cls = getattr(module, {"llama": "LlamaRMSNorm", "olmo2": "Olmo2RMSNorm",
                           "gemma": "GemmaRMSNorm", "gemma3": "Gemma3RMSNorm"}[kind])
    return cls(HIDDEN, eps=1e-6).to(torch.bfloat16)


@pytest.mark.parametrize("kind, over", [
    ("llama", {}),
    ("olmo2", {"norm_scale_in_fp32": True}),
    ("gemma", {"layernorm_zero_centered_gamma": True}),  # (Gemma 1, in every transformers)
    ("gemma3", {"layernorm_zero_centered_gamma": True}),
])
def test_bf16_rmsnorm_rounds_as_transformers(kind: str, over: dict) -> None:
    if kind == "olmo2" and hf_version() < (4, 52):
        over = {}  # (Olmo2RMSNorm rounded before the weight, as Llama's, until 4.52)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 7, HIDDEN, generator=gen) * 3).to(torch.bfloat16)
    weight = (torch.randn(HIDDEN, generator=gen) * 0.5 + (0.0 if over.get(
        "layernorm_zero_centered_gamma") else 1.0)).to(torch.bfloat16)
    ours, theirs = build_norm(_config(**over)), _theirs(kind)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    # The other order differs somewhere on these values: the setting is what matches.
    other = {} if over else {"norm_scale_in_fp32": True}
    swapped = build_norm(_config(**other))
    with torch.no_grad():
        swapped.weight.copy_(weight if not over.get("layernorm_zero_centered_gamma")
                             else weight + 1)
        assert not torch.equal(swapped(x), want)


def test_scale_in_fp32_changes_nothing_in_fp32() -> None:
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    plain = build_norm(_config(params_dtype=torch.float32))
    fp32 = build_norm(_config(params_dtype=torch.float32, norm_scale_in_fp32=True))
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        fp32.weight.copy_(plain.weight)
        assert torch.equal(plain(x), fp32(x))


def test_bf16_gemma_embedding_scale_rounds_as_transformers() -> None:
    """Gemma's normaliser sqrt(hidden) is rounded to the embeddings' dtype before it scales them
    (``embedding_multiplier_rounded``); sqrt(96) = 9.798 is 9.8125 in bf16."""
    needs_model_type("gemma3_text")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from domino.models.embedding import Embedding
    from domino.parallel_state import ParallelState

    vocab, scale = 64, HIDDEN ** 0.5
    rounded = hf_version() >= (4, 51)  # (4.50 multiplied by the unrounded float)
    cfg = _config(vocab_size=vocab, embedding_multiplier=scale,
                  embedding_multiplier_rounded=rounded, hidden_dropout=0.0,
                  position_embedding_type="rope")
    ours = Embedding(HIDDEN, vocab, 16, 0.0, cfg, parallel_state=ParallelState.single())
    theirs = Gemma3TextScaledWordEmbedding(vocab, HIDDEN, 0, embed_scale=scale).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs.weight.copy_(ours.word_embeddings.weight)
        want = theirs(ids)  # [b, s, h]
        got = ours(ids, None).transpose(0, 1)
        assert torch.equal(got, want)
        other = Embedding(HIDDEN, vocab, 16, 0.0, _config(
            vocab_size=vocab, embedding_multiplier=scale, hidden_dropout=0.0,
            embedding_multiplier_rounded=not rounded, position_embedding_type="rope"),
            parallel_state=ParallelState.single())
        other.word_embeddings.weight.copy_(ours.word_embeddings.weight)
        assert not torch.equal(other(ids, None).transpose(0, 1), want)
