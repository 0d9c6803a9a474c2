"""The core attention's paths in low precision on CPU (docs/performance.md#attention): SDPA on
its math backend without dropout, fp32 batched matmuls with dropout (same mask draws); every
path's output and gradients against an fp64 computation of the same math."""

from __future__ import annotations

import math

import pytest
import torch

from domino.transformer import kernels as attention
from domino.transformer.kernels import attention_keep


def core_attention(q, k, v, mask, causal, p, training, gen, softmax_fp32):
    """The attention kernel with its dropout mask drawn as the attention module draws it."""
    keep = attention_keep(q, k.shape[0], p, training, gen, v.dtype)
    return attention.attention(q, k, v, mask, causal, keep, p, softmax_fp32)

S, B, N, D = 24, 2, 3, 16


def _qkv(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(S, B, N, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for _ in range(3)]


def _reference(q, k, v, masked: torch.Tensor | None, keep: torch.Tensor | None, p: float):
    """The math in fp64, on the same (rounded) inputs; ``keep`` a dropout mask."""
    qh, kh, vh = (t.detach().double().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(D)
    if masked is not None:
        scores = scores.masked_fill(masked, torch.finfo(torch.float64).min)
    probs = torch.softmax(scores, -1)
    if keep is not None:
        probs = probs * keep.double() / (1.0 - p)
    ctx = (probs @ vh).permute(2, 0, 1, 3).reshape(S, B, N * D)
    return ctx, (qh, kh, vh)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())


def _agree(out, qkv, ref, leaves) -> None:
    """Output and input gradients within bf16 tolerance of the fp64 computation."""
    assert _rel(out, ref) < 2e-2
    dy = torch.randn(S, B, N * D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(dy.to(torch.bfloat16))
    ref.backward(dy)
    for mine, theirs in zip(qkv, leaves, strict=True):
        assert _rel(mine.grad.permute(1, 2, 0, 3), theirs.grad) < 3e-2


@pytest.mark.parametrize("case", ["causal", "padding"])
def test_no_dropout_runs_sdpas_math_backend_and_matches_fp64(case, monkeypatch) -> None:
    used = []
    real = attention.sdpa_kernel
    monkeypatch.setattr(attention, "sdpa_kernel", lambda b: used.append(b) or real(b))
    q, k, v = _qkv(torch.bfloat16)
    pad = None
    if case == "padding":  # the last 5 keys of batch row 1 masked out, plus the causal rule
        pad = torch.zeros(B, 1, S, S, dtype=torch.bool)
        pad[1, :, :, -5:] = True
    out = core_attention(q, k, v, pad, True, 0.0, True, torch.Generator(), True)
    assert out.dtype == torch.bfloat16 and used == [attention.SDPBackend.MATH]
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    ref, leaves = _reference(q, k, v, causal if pad is None else (pad | causal), None, 0.0)
    _agree(out, (q, k, v), ref, leaves)


def test_fp32_keeps_pytorchs_own_choice(monkeypatch) -> None:
    used = []
    monkeypatch.setattr(attention, "sdpa_kernel", lambda b: used.append(b))
    q, k, v = _qkv(torch.float32)
    core_attention(q, k, v, None, True, 0.0, True, torch.Generator(), True)
    assert used == []


def test_dropout_in_bf16_draws_the_same_masks_and_computes_in_fp32() -> None:
    p = 0.3
    q, k, v = _qkv(torch.bfloat16)
    out = core_attention(q, k, v, None, True, p, True, torch.Generator().manual_seed(7), True)
    assert out.dtype == torch.bfloat16
    # The mask: the same generator drawing over bf16 probabilities of the same shape.
    keep = torch.empty(B, N, S, S, dtype=torch.bfloat16).bernoulli_(
        1.0 - p, generator=torch.Generator().manual_seed(7))
    ref, leaves = _reference(q, k, v, torch.ones(S, S, dtype=torch.bool).triu(1), keep, p)
    _agree(out, (q, k, v), ref, leaves)
