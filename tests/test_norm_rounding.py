"""In bf16 our RMSNorms round where transformers' do: Llama's (and most families') rounds the
normalised activations, then multiplies by the weight; OLMo 2's (``norm_scale_in_fp32``) and
Gemma's (``layernorm_zero_centered_gamma``: 1 + weight) multiply in fp32, then round. Checked
bit for bit against transformers' own norm classes on the same weights and inputs."""

from __future__ import annotations

import pytest
import torch

from domino.config import TransformerConfig
from domino.transformer.norms import build_norm

HIDDEN = 96


def _config(**over) -> TransformerConfig:
    return TransformerConfig(**{"num_layers": 1, "hidden_size": HIDDEN,
                                "num_attention_heads": 4, "normalization": "RMSNorm",
                                "layernorm_epsilon": 1e-6, "params_dtype": torch.bfloat16,
                                **over})


def _theirs(kind: str) -> torch.nn.Module:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    cls = {"llama": LlamaRMSNorm, "olmo2": Olmo2RMSNorm, "gemma3": Gemma3RMSNorm}[kind]
    return cls(HIDDEN, eps=1e-6).to(torch.bfloat16)


@pytest.mark.parametrize("kind, over", [
    ("llama", {}),
    ("olmo2", {"norm_scale_in_fp32": True}),
    ("gemma3", {"layernorm_zero_centered_gamma": True}),
])
def test_bf16_rmsnorm_rounds_as_transformers(kind: str, over: dict) -> None:
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
