"""One rank's end of the shared-memory transport: the mapping's slots and the FIFO barrier.

Used by the transport's worker thread only (:mod:`.ops` runs the algorithms over it).
"""

from __future__ import annotations

import os
import select
import time

import torch

_POLL_MAX_MS = 2**31 - 1  # poll()'s limit
LEFT = "left a collective (it exited, or its transport failed)"


class Channel:
    """The mapping (two sets of ``size`` slots of ``slot_bytes``) and this rank's FIFOs: one
    read end per peer (``reads``) and one write end per peer (``writes``)."""

    def __init__(self, rank: int, size: int, buffer: torch.Tensor, slot_bytes: int,
                 reads: dict[int, int], writes: dict[int, int], timeout_s: float,
                 label: str) -> None:
        self.rank, self.size, self.slot_bytes, self.label = rank, size, slot_bytes, label
        self._buffer, self._reads, self._writes = buffer, reads, writes
        self._timeout_s = timeout_s
        self._step = 0  # which buffer set the next piece uses
        self.failed: BaseException | None = None

    def failure(self) -> RuntimeError:
        err = RuntimeError(f"shared-memory collective of the {self.label} group: {self.failed}")
        err.__cause__ = self.failed
        return err

    def close(self) -> None:
        for fd in [*self._reads.values(), *self._writes.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._reads, self._writes = {}, {}
        self._buffer = None  # the mapping goes with the last view of it

    def barrier(self) -> None:
        """Return once every peer got here too: one byte to each, one byte from each."""
        for peer, fd in self._writes.items():
            try:
                os.write(fd, b"\x01")
            except BrokenPipeError:
                raise RuntimeError(f"rank {peer} of the group {LEFT}") from None
        poller = select.poll()
        for fd in self._reads.values():
            poller.register(fd, select.POLLIN | select.POLLHUP)
        by_fd = {fd: peer for peer, fd in self._reads.items()}
        deadline = time.monotonic() + self._timeout_s
        while by_fd:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                peers = ", ".join(str(p) for p in sorted(by_fd.values()))
                raise RuntimeError(
                    f"rank(s) {peers} of the group did not join a collective within the "
                    f"process group's timeout ({self._timeout_s:.0f} s)")
            for fd, _ in poller.poll(min(left_s * 1000.0, _POLL_MAX_MS)):
                if os.read(fd, 1) != b"\x01":
                    raise RuntimeError(f"rank {by_fd[fd]} of the group {LEFT}")
                poller.unregister(fd)
                del by_fd[fd]

    def slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The next piece's set of slots, one per rank, viewed as ``dtype`` (the two sets
        alternate: see the package's docstring)."""
        base = (self._step % 2) * self.size * self.slot_bytes
        self._step += 1
        raw = self._buffer[base:base + self.size * self.slot_bytes]
        return list(raw.view(dtype).chunk(self.size))
