"""Time the core attention's paths on this machine, as ``--attention-backend auto`` does
(``domino.transformer.attention_paths``: forward + backward of ``kernels.attention`` itself,
a warm-up and a screening call each, then the median of 3 rotated rounds), and print, per dtype
and sequence length, each path's time, its worst relative gradient error against fp64, and the
path auto picks. The header names the CPU and its bf16 instructions (AMX-BF16, AVX512-BF16),
which decide the bf16 figures.

    python scripts/attention_paths.py [--batch 8] [--heads 4] [--kv-heads G] [--head-dim 64]
        [--seqs 256,512,1024] [--mask causal|masked|windowed] [--window W] [--threads 1]
        [--dtypes fp32,bf16]

Nothing is cached or read from the cache: every call measures.
"""

from __future__ import annotations

import argparse

import torch

from domino.gemm_rate import machine
from domino.runtime import AttentionChoice
from domino.transformer.attention_paths import AttentionShapes, choose, path_steps, time_paths
from domino.transformer.kernels import attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_flags() -> str:
    """The bf16-relevant instruction sets /proc/cpuinfo lists (what decides bf16 speed)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return "flags unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return "flags " + " ".join(w if w in flags else f"no-{w}" for w in wanted)


def grad_errors(shapes: AttentionShapes, kind: str) -> dict[str, float]:
    """Each path's worst relative input-gradient error against the same math in fp64."""
    seq = min(shapes.seq, 128)
    small = AttentionShapes(2, shapes.heads, shapes.groups, seq, shapes.head_dim,
                            torch.float64, shapes.kinds,
                            None if shapes.window is None else min(shapes.window, seq - 1),
                            shapes.causal, shapes.softmax_fp32)
    gen = torch.Generator().manual_seed(0)
    s, b, d = small.seq, small.batch, small.head_dim
    q, k, v = [torch.randn(s, b, h, d, generator=gen, dtype=torch.float64)
               for h in (small.heads, small.groups, small.groups)]
    dy = torch.randn(s, b, small.heads * d, generator=gen, dtype=torch.float64)
    mask, window = None, None
    if kind == "masked":
        mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
        mask[..., s - max(1, s // 8):] = True
    if kind == "windowed":
        window = small.window

    def grads(dtype: torch.dtype, path: str) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, mask, True, None, 0.0, True, small.heads // small.groups,
                        window, paths=AttentionChoice.fixed(path))
        out.backward(dy.to(dtype))
        return [t.grad.double() for t in leaves]

    exact = grads(torch.float64, "explicit")
    return {p: max(float((g - r).abs().max() / r.abs().max())
                   for g, r in zip(grads(shapes.dtype, p), exact, strict=True))
            for p in shapes.candidates}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=4, help="per rank (hidden 512, 8 heads, TP=2)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads per rank (GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seqs", default="256,512,1024")
    p.add_argument("--mask", choices=("causal", "masked", "windowed"), default="causal")
    p.add_argument("--window", type=int, default=None, help="--mask windowed: its window")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtypes", default="fp32,bf16")
    a = p.parse_args()
    kv = a.kv_heads or a.heads
    if kv < 1 or a.heads % kv:
        p.error(f"--kv-heads={kv} must divide --heads={a.heads}")
    torch.set_num_threads(a.threads)
    print(f"{machine()} ({cpu_flags()}; torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
          f"{a.threads} thread(s)")
    for name in a.dtypes.split(","):
        for s in map(int, a.seqs.split(",")):
            window = (a.window or s // 4) if a.mask == "windowed" else None
            shapes = AttentionShapes(a.batch, a.heads, kv, s, a.head_dim, DTYPES[name],
                                     (a.mask,), window)
            times = time_paths(path_steps(shapes, a.mask))
            errors = grad_errors(shapes, a.mask)
            pick = choose({a.mask: times}, shapes).path(a.mask)
            print(f"{shapes.describe()}: " + ", ".join(
                f"{path} {times[path] * 1e3:.1f} ms (grad err {errors[path]:.1e})"
                for path in shapes.candidates) + f" -> auto picks {pick}")


if __name__ == "__main__":
    main()
