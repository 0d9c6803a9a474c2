"""Shared by the benchmarks' memory measurements (``worker.py``, ``pipeline.py``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_fd2() -> Iterator[None]:
    """Silence fd 2 (the profiler's native log lines would garble the bench's output)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
