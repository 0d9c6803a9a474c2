"""The core attention's paths (docs/performance.md#attention): each path an AttentionChoice
names - SDPA with PyTorch's own backend (flash on a CPU), SDPA's math backend, explicit
matmuls in the dtype or in fp32 - runs as named, and its output and gradients match an fp64
computation of the same math for every kind of mask (causal, masked, windowed), with and
without GQA, in fp32 and bf16; dropout runs the explicit variant the choice names and draws
the same masks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from domino.runtime import ATTENTION_PATHS, MASK_KINDS, AttentionChoice
from domino.transformer import kernels
from domino.transformer.kernels import attention_keep, mask_kind

S, B, N, D = 24, 2, 4, 16
WINDOW = 7
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 3e-2)}  # (output, gradients)


def _qkv(dtype: torch.dtype, groups: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(S, B, h, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for h in (N, groups, groups)]


def _mask(kind: str) -> tuple[torch.Tensor | None, int | None, torch.Tensor | None]:
    """(the kernel's mask, its window, the whole masked-out set [b, 1, s, s] for fp64)."""
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    if kind == "causal":
        return None, None, causal
    if kind == "windowed":
        pos = torch.arange(S)
        return None, WINDOW, causal | (pos[None, :] <= pos[:, None] - WINDOW)
    pad = torch.zeros(B, 1, S, S, dtype=torch.bool)  # the last 5 keys of batch row 1
    pad[1, :, :, -5:] = True
    return pad, None, pad | causal


def _reference(q, k, v, masked, keep=None, p=0.0):
    """The math in fp64 on the same (rounded) inputs; K/V heads repeated for GQA."""
    qh, kh, vh = (t.detach().double().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    rep = N // kh.shape[1]
    ke, ve = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    scores = (qh @ ke.transpose(-1, -2) / math.sqrt(D)).masked_fill(
        masked, torch.finfo(torch.float64).min)
    probs = torch.softmax(scores, -1)
    if keep is not None:
        probs = probs * keep.double() / (1.0 - p)
    return (probs @ ve).permute(2, 0, 1, 3).reshape(S, B, N * D), (qh, kh, vh)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())


def _agree(out, qkv, ref, leaves, dtype) -> None:
    out_tol, grad_tol = TOL[dtype]
    assert out.dtype == dtype and _rel(out, ref) < out_tol
    dy = torch.randn(S, B, N * D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(dy.to(dtype))
    ref.backward(dy)
    for mine, theirs in zip(qkv, leaves, strict=True):
        assert mine.grad.dtype == dtype
        assert _rel(mine.grad.permute(1, 2, 0, 3), theirs.grad) < grad_tol


class _Ops(TorchDispatchMode):
    """What ran: PyTorch's fused CPU kernel, and the dtypes of the batched matmuls."""

    def __init__(self) -> None:
        super().__init__()
        self.fused, self.bmm = False, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.fused |= name.startswith("_scaled_dot_product_flash_attention")
        if name == "bmm":
            self.bmm.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [N, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_every_path_matches_fp64(path, kind, groups, dtype, monkeypatch) -> None:
    backends = []
    real = kernels.sdpa_kernel
    monkeypatch.setattr(kernels, "sdpa_kernel", lambda b: backends.append(b) or real(b))
    q, k, v = _qkv(dtype, groups)
    mask, window, masked = _mask(kind)
    assert mask_kind(mask, True, S, S, window) == kind
    ops = _Ops()
    with ops:
        out = kernels.attention(q, k, v, mask, True, None, 0.0, True, N // groups, window,
                                paths=AttentionChoice(**{kind: path}))
    # The path named ran: the fused kernel, SDPA's math backend, or our matmuls (in fp32).
    assert ops.fused == (path == "flash")
    assert backends == ([kernels.SDPBackend.MATH] if path == "math" else [])
    if path.startswith("explicit"):
        assert ops.bmm == {torch.float32 if path == "explicit_fp32" else dtype}
    ref, leaves = _reference(q, k, v, masked)
    _agree(out, (q, k, v), ref, leaves, dtype)


def test_unmeasured_default_is_pytorchs_own_choice(monkeypatch) -> None:
    used = []
    monkeypatch.setattr(kernels, "sdpa_kernel", lambda b: used.append(b))
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = _qkv(dtype, N)
        kernels.attention(q, k, v, None, True, None, 0.0, True)
        assert kernels.Kernels().paths == AttentionChoice()
    assert used == []


@pytest.mark.parametrize("variant", ["explicit", "explicit_fp32"])
def test_dropout_runs_the_chosen_explicit_variant_with_the_same_masks(variant) -> None:
    p = 0.3
    q, k, v = _qkv(torch.bfloat16, N)
    keep = attention_keep(q, S, p, True, torch.Generator().manual_seed(7), v.dtype)
    ops = _Ops()
    with ops:  # flash for every mask: dropout still takes the explicit path
        out = kernels.attention(q, k, v, None, True, keep, p, True,
                                paths=AttentionChoice(explicit=variant))
    assert not ops.fused
    assert ops.bmm == {torch.float32 if variant == "explicit_fp32" else torch.bfloat16}
    # The mask: the same generator drawing over bf16 probabilities of the same shape.
    again = torch.empty(B, N, S, S, dtype=torch.bfloat16).bernoulli_(
        1.0 - p, generator=torch.Generator().manual_seed(7))
    assert torch.equal(keep, again)
    ref, leaves = _reference(q, k, v, _mask("causal")[2], keep, p)
    _agree(out, (q, k, v), ref, leaves, torch.bfloat16)


def test_compiled_kernels_run_their_paths() -> None:
    """A compiled attention takes the choice as a static argument: the same graph per path."""
    q, k, v = _qkv(torch.float32, N)
    for path in ATTENTION_PATHS:
        compiled = kernels.Kernels("aot_eager", paths=AttentionChoice.fixed(path))
        out = compiled.attention(q, k, v, None, True, None, 0.0, True)
        assert compiled.eager.paths == compiled.paths
        ref, _ = _reference(q, k, v, _mask("causal")[2])
        assert _rel(out, ref) < TOL[torch.float32][0]
