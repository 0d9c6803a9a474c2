"""The rate this machine multiplies a model's own GEMM shapes at: the denominator of MFU on a CPU.

A CPU has no datasheet peak that its GEMM kernels reach (AMX, AVX-512 and the thread count each
change it several-fold), so MFU on CPU is measured against the machine itself: the GEMMs one
rank runs for a layer (:func:`domino.flops.rank_gemms`: forward, input and weight gradients, at
the rank's TP shard) are timed with ``torch.mm`` in the run's dtype and thread count, and their
FLOPs over their time is the rate. Measured once per machine, torch version, dtype, thread count
and shape set, and cached in ``$DOMINO_CACHE_DIR`` (default ``~/.cache/domino``) as JSON; a
cache that cannot be read is measured again, never trusted.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence

import torch

from domino.flops import Gemm, cuda_peak_flops
from domino.safe_files import read_cache, update_cache
from domino.utils import cache_root

CACHE_FILE = "gemm_rates.json"
MIN_TIME_S = 0.05  # per shape: repeat until this long (and at least twice) after one warm-up


def machine() -> str:
    """The CPU model (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def shape_counts(gemms: Sequence[Gemm]) -> dict[tuple[int, int, int, str], int]:
    """How many GEMMs of each distinct (m, k, n, layout) ``gemms`` holds."""
    counts: dict[tuple[int, int, int, str], int] = {}
    for g in gemms:
        key = (g.m, g.k, g.n, g.layout)
        counts[key] = counts.get(key, 0) + g.count
    return counts


def cache_key(gemms: Sequence[Gemm], dtype: torch.dtype, threads: int) -> str:
    shapes = ",".join(f"{m}x{k}x{n}{lay}*{c}"
                      for (m, k, n, lay), c in sorted(shape_counts(gemms).items()))
    return f"{machine()} | torch {torch.__version__} | {dtype} | {threads} threads | {shapes}"


def time_gemm(gemm: Gemm, dtype: torch.dtype, device: torch.device) -> float:
    """Seconds of one [m, k] x [k, n] ``torch.mm`` with its operands laid out as ``gemm.layout``
    says: the mean over a short loop after a warm-up call, or that first call alone when it
    took ``MIN_TIME_S`` or more (a slow kernel, e.g. bf16 on a CPU without bf16 instructions:
    its warm-up is noise, and more calls only cost)."""
    a_t, b_t = gemm.layout[0] == "t", gemm.layout[1] == "t"
    a = torch.randn(*((gemm.k, gemm.m) if a_t else (gemm.m, gemm.k)), device=device).to(dtype)
    b = torch.randn(*((gemm.n, gemm.k) if b_t else (gemm.k, gemm.n)), device=device).to(dtype)
    a, b = (a.t() if a_t else a), (b.t() if b_t else b)
    out = torch.empty(gemm.m, gemm.n, dtype=dtype, device=device)
    start = time.perf_counter()
    torch.mm(a, b, out=out)  # warm-up (kernel choice, pages)
    first = time.perf_counter() - start
    if first >= MIN_TIME_S:
        return first
    reps, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b, out=out)
        reps += 1
        elapsed = time.perf_counter() - start
        if reps >= 2 and elapsed >= MIN_TIME_S:
            return elapsed / reps


def measure(gemms: Sequence[Gemm], dtype: torch.dtype, device: str = "cpu") -> float:
    """FLOP/s over ``gemms`` (each weighted by its count), timed now."""
    flops = seconds = 0.0
    for (m, k, n, layout), count in shape_counts(gemms).items():  # each distinct one timed once
        flops += Gemm(m, k, n, count).flops
        seconds += time_gemm(Gemm(m, k, n, layout=layout), dtype, torch.device(device)) * count
    return flops / seconds


def gemm_rate(gemms: Sequence[Gemm], dtype: torch.dtype) -> float:
    """FLOP/s this machine reaches on ``gemms`` in ``dtype`` with the current thread count, from
    the cache or measured (and then cached)."""
    key = cache_key(gemms, dtype, torch.get_num_threads())
    path = cache_root() / CACHE_FILE
    value = read_cache(path).get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    rate = measure(gemms, dtype)
    update_cache(path, key, rate)  # (a read-only home: the rate is still right, not kept)
    return rate


def peak_flops(device: torch.device, dtype: torch.dtype, gemms: Sequence[Gemm],
               override_tflops: float | None = None) -> tuple[float | None, str]:
    """(the FLOP/s MFU is taken against, what it is): ``override_tflops`` if given; on CUDA the
    device's dense peak for ``dtype`` (:data:`domino.flops.CUDA_PEAK_TFLOPS`); on CPU the
    measured rate of ``gemms`` (:func:`gemm_rate`)."""
    if override_tflops is not None:
        return override_tflops * 1e12, f"of {override_tflops:g} TFLOP/s (--peak-tflops)"
    if device.type == "cuda":
        peak = cuda_peak_flops(device, dtype)
        name = torch.cuda.get_device_name(device)
        if peak is None:
            return None, f"n/a: no {dtype} peak known for {name}; give --peak-tflops"
        return peak, f"of {name}'s dense {str(dtype).removeprefix('torch.')} peak"
    return gemm_rate(gemms, dtype), "of measured GEMM rate"
