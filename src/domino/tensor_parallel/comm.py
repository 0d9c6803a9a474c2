"""Tier 1: collectives over one tensor-parallel group, with handles, device/backend agnostic.

Everything above this file talks to a :class:`CommGroup`; nothing else calls
``torch.distributed`` collectives. A group can be *disabled* (every collective becomes a no-op),
which is how the benchmark measures the ``nocomm`` ideal on the very same compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Running totals of one group's collectives: how many, how many bytes, and the time this
    rank spent blocked waiting for them (the communication that was *not* hidden)."""

    count: int = 0
    bytes: int = 0
    wait_s: float = 0.0

    def reset(self) -> None:
        self.count, self.bytes, self.wait_s = 0, 0, 0.0


class Handle:
    """An in-flight (or finished) collective. ``wait()`` is idempotent."""

    __slots__ = ("_work", "_done", "_trace", "_launch", "_stats")

    def __init__(self, work: Any = None, trace: tuple | None = None,
                 stats: CommStats | None = None) -> None:
        self._work = work
        self._done = work is None
        self._trace = trace  # (timeline, name, args) of a traced collective
        self._stats = stats
        self._launch = time.perf_counter() if trace is not None else 0.0

    def wait(self) -> None:
        if self._done:
            return
        t0 = time.perf_counter()
        self._work.wait()
        self._done = True
        if self._stats is not None:
            self._stats.wait_s += time.perf_counter() - t0
        if self._trace is not None:
            timeline, name, args = self._trace
            t1 = time.perf_counter()
            # The comm span runs from launch to the moment the waiter saw it finish.
            timeline.record(name, "comm", self._launch, t1, **args)
            if t1 - t0 > 1e-5:
                timeline.record(f"wait {name}", "wait", t0, t1, **args)

    def ready(self) -> bool:
        """True when the collective has finished (never blocks)."""
        return self._done or bool(self._work.is_completed())


DONE = Handle()


@dataclass
class SimulatedLink:
    """A link that costs wall time but no CPU, for timing schedules alone.

    An all-reduce of ``n`` bytes over ``size`` ranks moves ``2 (size - 1) / size * n`` bytes per
    rank (ring); transfers queue on the one link in launch order. Tensors are left as they are
    (like a disabled group), so only timings mean anything.
    """

    bits_per_s: float
    free_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.bits_per_s > 0:
            raise ValueError(f"SimulatedLink.bits_per_s={self.bits_per_s} must be > 0.")

    def schedule(self, nbytes: int, size: int) -> _SimulatedWork:
        seconds = 2 * (size - 1) / size * nbytes * 8 / self.bits_per_s
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


@dataclass(eq=False)
class CommGroup:
    """A process group plus this rank's place in it.

    ``group=None`` with ``size=1`` is the single-process case: every collective is the identity.
    """

    group: Any = None
    size: int = 1
    rank: int = 0
    enabled: bool = True
    timeline: Any = field(default=None, repr=False)  # set by the benchmark to trace collectives
    # Set by the benchmark's --simulate-link: all-reduces take the link's time, no CPU, no data.
    simulated_link: SimulatedLink | None = field(default=None, repr=False)
    stats: CommStats = field(default_factory=CommStats, repr=False)

    @property
    def active(self) -> bool:
        return self.size > 1 and self.enabled

    def _handle(self, work: Any, name: str, tensor: torch.Tensor, trace: dict | None) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.count += 1
        self.stats.bytes += nbytes
        if self.timeline is None:
            return Handle(work, stats=self.stats)
        args = dict(trace or {})
        args["bytes"] = nbytes
        return Handle(work, (self.timeline, name, args), self.stats)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False,
                   op: dist.ReduceOp = dist.ReduceOp.SUM, name: str = "all_reduce",
                   trace: dict | None = None) -> Handle:
        """In-place all-reduce of ``tensor``; returns a handle (already done when sync)."""
        if not self.active:
            return DONE
        if self.simulated_link is not None:
            work: Any = self.simulated_link.schedule(tensor.numel() * tensor.element_size(),
                                                     self.size)
        else:
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        handle = self._handle(work, name, tensor, trace)
        if not async_op:
            handle.wait()
        return handle

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along the last dimension (rank order)."""
        if self.size == 1:
            return tensor
        if not self.enabled:
            return torch.cat([tensor] * self.size, dim=-1)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of the last dimension."""
        if self.size == 1:
            return tensor
        width = tensor.shape[-1] // self.size
        return tensor[..., self.rank * width:(self.rank + 1) * width].contiguous()

    def broadcast(self, tensor: torch.Tensor, src_local_rank: int = 0) -> None:
        """Broadcast in place from the group's ``src_local_rank``."""
        if not self.active:
            return
        src = dist.get_global_rank(self.group, src_local_rank)
        dist.broadcast(tensor, src=src, group=self.group)
