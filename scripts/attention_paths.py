"""Time the causal core attention's paths, forward + backward, on this machine: PyTorch's
``scaled_dot_product_attention`` (its default backend choice, and its math backend) against the
explicit path (Q K^T, softmax in fp32, P V) that domino runs under dropout. Prints one table per
dtype, the paths interleaved per round and compared by medians; the gradients of every path are
checked against an fp64 reference first.

    python scripts/attention_paths.py [--batch 8] [--heads 4] [--head-dim 64] [--seqs 256,512,1024]
        [--mask causal|bias] [--threads 1] [--kv-heads G]

``--kv-heads G`` (fewer than ``--heads``: grouped-query attention) adds SDPA's own GQA
(``enable_gqa=True``, on its default and its math backend) against repeating K and V to every
query head first (``repeat_interleave``, what the other paths get).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MASK = {"kind": "causal"}  # or "bias": the causal rule as an additive mask (the masked path)


def _expand(q, k, v):
    """K and V repeated to every query head (query head i reads K/V head i // (n / g))."""
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _kw(q):
    if MASK["kind"] == "causal":
        return {"is_causal": True}
    s = q.shape[-2]
    bias = torch.zeros(s, s, dtype=q.dtype, device=q.device)
    return {"attn_mask": bias.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1),
                                          torch.finfo(q.dtype).min)}


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, *_expand(q, k, v), **_kw(q))


def sdpa_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, *_expand(q, k, v), **_kw(q))


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **_kw(q))


def sdpa_math_gqa(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **_kw(q))


def explicit(q, k, v):
    k, v = _expand(q, k, v)
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, torch.finfo(torch.float32).min), dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


PATHS = {"sdpa": sdpa, "sdpa math": sdpa_math, "explicit": explicit}
GQA_PATHS = {"sdpa gqa": sdpa_gqa, "sdpa math gqa": sdpa_math_gqa}
KV = {"heads": None}  # K/V heads (None: as many as query heads)


def _inputs(b, n, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = KV["heads"] or n
    return [torch.randn(b, heads, s, d, generator=g).to(dtype).requires_grad_()
            for heads in (n, kv, kv)]


def _step(fn, qkv, dy):
    for t in qkv:
        t.grad = None
    fn(*qkv).backward(dy)


def check(b, n, s, d, dtype) -> dict[str, float]:
    """Each path's worst relative gradient error against the fp64 math."""
    ref = _inputs(b, n, s, d, torch.float64)
    dy = torch.randn(b, n, s, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_fn = explicit
    _step(ref_fn, ref, dy)
    out = {}
    for name, fn in PATHS.items():
        qkv = [t.detach().to(dtype).requires_grad_() for t in ref]
        _step(fn, qkv, dy.to(dtype))
        out[name] = max(float((a.grad.double() - r.grad).abs().max() / r.grad.abs().max())
                        for a, r in zip(qkv, ref, strict=True))
    return out


def timed(b, n, s, d, dtype, rounds) -> dict[str, float]:
    qkv = _inputs(b, n, s, d, dtype)
    dy = torch.randn(b, n, s, d).to(dtype)
    times = {name: [] for name in PATHS}
    for fn in PATHS.values():
        _step(fn, qkv, dy)  # warm-up
    for r in range(rounds):
        names = list(PATHS)
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated order
            t0 = time.perf_counter()
            _step(PATHS[name], qkv, dy)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=4, help="per rank (hidden 512, 8 heads, TP=2)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seqs", default="256,512,1024")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mask", choices=("causal", "bias"), default="causal",
                   help="causal: SDPA's is_causal; bias: the same rule as an additive mask")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="K/V heads per rank (grouped-query attention; must divide --heads)")
    a = p.parse_args()
    MASK["kind"] = a.mask
    if a.kv_heads is not None and a.kv_heads != a.heads:
        if a.kv_heads < 1 or a.heads % a.kv_heads:
            p.error(f"--kv-heads={a.kv_heads} must divide --heads={a.heads}")
        KV["heads"] = a.kv_heads
        PATHS.update(GQA_PATHS)
    torch.set_num_threads(a.threads)
    kv = f" ({KV['heads']} K/V heads)" if KV["heads"] else ""
    print(f"torch {torch.__version__}, {a.threads} thread(s), batch {a.batch}, {a.heads} heads"
          f"{kv} of {a.head_dim}, {a.mask} mask, forward + backward, median of {a.rounds} "
          "rotated rounds")
    for dtype in (torch.float32, torch.bfloat16):
        for s in map(int, a.seqs.split(",")):
            errs = check(2, a.heads, min(s, 128), a.head_dim, dtype)
            t = timed(a.batch, a.heads, s, a.head_dim, dtype, a.rounds)
            best = min(t, key=t.get)
            print(f"{str(dtype).removeprefix('torch.'):8s} seq {s:5d}: " + ", ".join(
                f"{name} {t[name] * 1e3:.1f} ms (grad err {errs[name]:.1e})" for name in PATHS)
                + f" -> fastest {best}")


if __name__ == "__main__":
    main()
