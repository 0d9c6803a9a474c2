"""Timing candidates against each other on a noisy machine: the one loop the benchmark and the
autotuner share.

Each round runs every candidate once, in an order rotated by one per round (no candidate always
runs first, right after the previous round's garbage), with a barrier and a device sync before
each timed run (the group starts together; CUDA work is counted) and Python's garbage collector
paused inside the rounds (a collection would land on whichever candidate is unlucky).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from domino.tensor_parallel.comm import CommGroup


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to do on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rotated(count: int, run: Callable[[int], object], warmup: int, rounds: int,
                 group: CommGroup, device: torch.device) -> list[list[float]]:
    """Seconds of ``run(i)`` for each candidate ``i < count`` in each of ``rounds`` measured
    rounds (after ``warmup`` unmeasured ones), as this rank saw them; ``group`` is the set of
    ranks that run together (barrier before each run)."""
    if count < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"time_rotated needs count >= 1, warmup >= 0 and rounds >= 1; got "
                         f"{count}, {warmup}, {rounds}.")
    rows: list[list[float]] = [[] for _ in range(count)]
    gc.collect()
    gc.disable()
    try:
        for r in range(warmup + rounds):
            k = r % count
            for i in [*range(k, count), *range(k)]:
                group.barrier()
                device_sync(device)
                t0 = time.perf_counter()
                run(i)
                device_sync(device)
                if r >= warmup:
                    rows[i].append(time.perf_counter() - t0)
            gc.collect()
    finally:
        gc.enable()
    return rows
