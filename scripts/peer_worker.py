"""What the benchmark peers' worker ranks share (``compare_deepspeed/ds_worker.py``,
``compare_megatron_moe/mcore_worker.py``): the timed steps and the report file. torch only -
the workers run in the peers' own venvs and never import ``domino``.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist


def timed_steps(step: Callable[[], float], warmup: int, steps: int,
                after: Callable[[bool], None] | None = None) -> tuple[list[float], float]:
    """``warmup`` then ``steps`` calls of ``step`` (returns the loss), each after a barrier and
    timed with ``perf_counter``, the garbage collector run between steps rather than inside
    one; ``after(measured)`` runs after each. Returns (the measured steps' seconds, the last
    loss)."""
    import time

    times: list[float] = []
    loss = float("nan")
    gc.collect()
    gc.disable()
    try:
        for i in range(warmup + steps):
            tdist.barrier()
            t0 = time.perf_counter()
            loss = step()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
            if after is not None:
                after(i >= warmup)
            gc.collect()
    finally:
        gc.enable()
    return times, loss


def gather_rows(values: list, world: int, dtype: torch.dtype = torch.float64) -> list[list]:
    """Every rank's ``values`` (the same length everywhere), in rank order."""
    mine = torch.tensor(values, dtype=dtype)
    rows = [torch.zeros_like(mine) for _ in range(world)]
    tdist.all_gather(rows, mine)
    return [r.tolist() for r in rows]


def write_report(path: str, report: dict[str, Any]) -> str:
    """``report`` as indented JSON into ``path``, atomically (a reader never sees half of
    it); returns the text."""
    text = json.dumps(report, indent=2)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return text
