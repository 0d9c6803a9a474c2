"""What a collective hands back and who may watch it.

In-flight work has one protocol, :class:`InFlight` (``ready()``, ``wait()``), and two kinds:
:class:`Handle` (one collective as launched: its result lands in buffers the launcher holds) and
:class:`Arriving` (in-flight parts and what is made of them on arrival: a sum's chunks
concatenated, rows put back in order, a gradient's backward finished). Besides them:
:class:`CommStats` (a group's running totals), :class:`CommHook` (the interface of tools that
trace collectives or stand in for their transport) and :class:`PairwiseWork` (the transport's
work object of a collective made of point-to-point messages, what a ``Handle`` waits on).
:mod:`~domino.tensor_parallel.comm` re-exports them with ``CommGroup``."""

from __future__ import annotations

import time
from collections.abc import Callable
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


class InFlight(Protocol):
    """Work on its way: poll with :meth:`ready` (never blocks), take the result with
    :meth:`wait` (any number of times; the first blocks until it is there)."""

    def ready(self) -> bool: ...

    def wait(self) -> Any: ...


class Handle:
    """One collective as launched, in flight or finished (an :class:`InFlight` whose result,
    None, is that its buffers are filled). ``wait()`` is idempotent."""

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
        self._work, self._done = None, True  # (a finished work may hold its buffers)
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


class Arriving:
    """In-flight parts (``handles``: any :class:`InFlight`) and what is made of them on arrival
    (``finish``, run once, on the first :meth:`wait`, which returns its result from then on).
    ``handles`` None: not launched yet (``start``, run by the first wait, launches them).
    :func:`arrived` makes one that needs nothing to arrive."""

    def __init__(self, handles: list[InFlight] | None, finish: Callable[[], Any] | None,
                 start: Callable[[], None] | None = None) -> None:
        self.handles, self.finish, self.value, self.start = handles, finish, None, start
        self.done = False

    def ready(self) -> bool:
        return self.done or (self.handles is not None and all(h.ready() for h in self.handles))

    def wait(self) -> Any:
        if not self.done:
            if self.handles is None:
                self.start()
            for h in self.handles:
                h.wait()
            self.value, self.done = self.finish(), True
            # Drop what made it (receive buffers) and the launch (which may refer back to this
            # object: a cycle only the garbage collector would free, buffers and all). The
            # parts stay: a consumer may take them apart (one backward step per part).
            self.finish, self.start = None, None
        return self.value


def arrived(value: Any) -> Arriving:
    """A result that needed no collective (e.g. a region entered without sequence
    parallelism), as an :class:`InFlight`."""
    return Arriving([], lambda: value)


class PairwiseWork:
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
