"""What the benchmark attaches to a CommGroup (``group.hook``): a timeline tracer and a simulated
link, through the collectives tier's one hook interface (``domino.tensor_parallel.comm.CommHook``).
"""

from __future__ import annotations

import contextlib
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from domino.bench.timeline import Timeline


@dataclass
class SimulatedLink:
    """A link that costs wall time but no CPU, for timing schedules alone.

    An all-reduce of ``n`` bytes over ``size`` ranks moves ``2 (size - 1) / size * n`` bytes per
    rank (ring), a reduce-scatter of ``n`` bytes (its input) or an all-gather into ``n`` bytes
    half that; an all-to-all (shown the ``n`` bytes it sends other ranks) and point-to-point
    sends of ``n`` bytes all ``n``; transfers queue on the one link in launch order. Tensors are
    left as they are (like a disabled group), so only timings mean anything.
    """

    bits_per_s: float
    free_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.bits_per_s > 0:
            raise ValueError(f"SimulatedLink.bits_per_s={self.bits_per_s} must be > 0.")

    def schedule(self, nbytes: int, size: int, kind: str = "all_reduce") -> _SimulatedWork:
        if kind in ("p2p", "all_to_all"):  # the bytes sent to other ranks: all cross the link
            seconds = nbytes * 8 / self.bits_per_s
        else:
            passes = 2 if kind == "all_reduce" else 1
            seconds = passes * (size - 1) / size * nbytes * 8 / self.bits_per_s
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + seconds
        return _SimulatedWork(self.free_at)


class _SimulatedWork:
    __slots__ = ("done_at",)

    def __init__(self, done_at: float) -> None:
        self.done_at = done_at

    def wait(self) -> None:
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at


@dataclass
class BenchHook:
    """Records a group's collectives and compute regions on ``timeline`` (when set) and sends
    its all-reduces over ``link`` instead of the network (when set)."""

    timeline: Timeline | None = None
    link: SimulatedLink | None = None

    def launch(self, tensor: torch.Tensor, group: Any, kind: str = "all_reduce"
               ) -> _SimulatedWork | None:
        if self.link is None:
            return None
        return self.link.schedule(tensor.numel() * tensor.element_size(), group.size, kind)

    def finished(self, name: str, tags: dict[str, Any], nbytes: int, launched_s: float,
                 wait_s: float, done_s: float) -> None:
        if self.timeline is None:
            return
        # The comm span runs from launch to the moment the waiter saw it finish.
        self.timeline.record(name, "comm", launched_s, done_s, **tags, bytes=nbytes)
        if done_s - wait_s > 1e-5:
            self.timeline.record(f"wait {name}", "wait", wait_s, done_s, **tags, bytes=nbytes)

    def region(self, name: str, category: str, **tags: Any) -> AbstractContextManager[None]:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(name, category, **tags)
