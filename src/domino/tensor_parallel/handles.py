"""What a collective hands back and who may watch it: :class:`Handle` (an in-flight or finished
collective), :class:`CommStats` (a group's running totals), :class:`CommHook` (the interface of
tools that trace collectives or stand in for their transport) and the pairwise exchange's work
object. :mod:`~domino.tensor_parallel.comm` re-exports them with ``CommGroup``."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from domino.tensor_parallel.comm import CommGroup


@dataclass
class CommStats:
    """Running totals of one group's collectives: how many, how many bytes, and the time this
    rank spent blocked waiting for them (the communication that was *not* hidden)."""

    count: int = 0
    bytes: int = 0
    wait_s: float = 0.0

    def reset(self) -> None:
        self.count, self.bytes, self.wait_s = 0, 0, 0.0


class CommHook(Protocol):
    """Watches a group's collectives and may stand in for their transport.

    The library never implements one; a tool that needs to (the benchmark's timeline tracer and
    its simulated link) attaches it with ``CommGroup(hook=...)`` or ``group.hook = ...``.
    """

    def launch(self, tensor: torch.Tensor, group: CommGroup, kind: str = "all_reduce"
               ) -> Any | None:
        """At a collective's launch (``kind``: all_reduce or reduce_scatter - ``tensor`` its
        input - all_gather - its output - all_to_all - the rows this rank sends to other ranks,
        on the meta device - or p2p - a tensor of the bytes this rank sends, on the meta
        device): a work object (``wait()``,
        ``is_completed()``) to use instead of the real collective, or None to run the real
        one (which runs anyway for a collective whose result decides shapes:
        ``CommGroup.shaping``)."""

    def finished(self, name: str, tags: dict[str, Any], nbytes: int, launched_s: float,
                 wait_s: float, done_s: float) -> None:
        """A collective of ``nbytes`` launched at ``launched_s`` was waited for from ``wait_s``
        to ``done_s`` (``time.perf_counter()`` seconds)."""

    def region(self, name: str, category: str, **tags: Any) -> AbstractContextManager[None]:
        """A stretch of work (e.g. a schedule's compute piece) worth recording."""


class Handle:
    """An in-flight (or finished) collective. ``wait()`` is idempotent."""

    __slots__ = ("_work", "_done", "_stats", "_trace")

    def __init__(self, work: Any = None, stats: CommStats | None = None,
                 trace: tuple | None = None) -> None:
        self._work = work
        self._done = work is None
        self._stats = stats
        self._trace = trace  # (hook, name, tags, bytes, launch time) when a hook watches

    def wait(self) -> None:
        if self._done:
            return
        t0 = time.perf_counter()
        self._work.wait()
        self._done = True
        t1 = time.perf_counter()
        if self._stats is not None:
            self._stats.wait_s += t1 - t0
        if self._trace is not None:
            hook, name, tags, nbytes, launched = self._trace
            hook.finished(name, tags, nbytes, launched, t0, t1)

    def ready(self) -> bool:
        """True when the collective has finished (never blocks)."""
        return self._done or bool(self._work.is_completed())


DONE = Handle()


class _Exchange:
    """Point-to-point sends and receives that make up one collective, finished (e.g. the
    received chunks summed) once all are done: the work object of a pairwise collective."""

    def __init__(self, works: list, finish) -> None:
        self._works, self._finish, self._done = works, finish, False

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        if self._done:
            return
        for w in self._works:
            w.wait()
        with torch.no_grad():  # a collective's data movement, never part of a graph
            self._finish()
        self._done = True
