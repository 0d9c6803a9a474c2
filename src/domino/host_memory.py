"""A CPU rank keeps the memory its step freed for the next step (glibc's malloc settings).

PyTorch's CPU tensors come from ``malloc`` and go back with ``free``; there is no caching
allocator as on CUDA. glibc hands large freed blocks back to the kernel: a block above the
mapping threshold (dynamic, at most 32 MiB by default) is unmapped, and free space at the top of
the heap above the trim threshold is trimmed. A training step frees its activations and
gradients and allocates them again in the next, so every step faults those pages back in one
by one and the kernel zeroes each: system time on the rank's core, which on a CPU host comes
straight out of compute. In the MoE unit bench that was thousands of minor faults per step
and rank, and keeping the memory removed nearly all of them and made the steps faster (the
figures: docs/benchmark.md, "Freed memory kept: no page faults per step").

:func:`keep_freed_memory` raises both thresholds (``mallopt``), so blocks up to
:data:`MMAP_THRESHOLD` come from the heap and up to :data:`TRIM_THRESHOLD` of free heap stays
mapped: a rank holds on to its peak step memory, as PyTorch's CUDA caching allocator does on a
GPU. ``domino train``, ``bench``, ``generate`` and ``eval`` call it in every CPU rank;
``DOMINO_MALLOC_TUNING=off`` keeps glibc's defaults. It only exists on glibc (Linux); elsewhere,
or under another allocator (an ``LD_PRELOAD``-ed jemalloc or tcmalloc, whose own settings then
apply), it changes nothing. It is a setting rather than an allocator library because the
measured faults are all of glibc's returning memory, which two parameters stop; a preloaded
allocator would have to be installed, found and injected before the interpreter starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ENV = "DOMINO_MALLOC_TUNING"
MMAP_THRESHOLD = 256 << 20  # bytes: a block this large or smaller comes from the heap
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept mapped
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_VALUES = {"on": True, "off": False}


def enabled() -> bool:
    """Does ``DOMINO_MALLOC_TUNING`` (default ``on``) ask for the tuning? ValueError naming it
    for any other value than ``on`` / ``off``."""
    value = os.environ.get(ENV, "on")
    if value not in _VALUES:
        raise ValueError(f"{ENV}={value!r}: must be 'on' (a CPU rank keeps the memory its steps "
                         "free, the default) or 'off' (glibc's malloc defaults)")
    return _VALUES[value]


def keep_freed_memory() -> bool:
    """Raise glibc's mapping and trim thresholds in this process (see the module docstring);
    True when applied, False where off, not glibc, or refused."""
    if not enabled() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
