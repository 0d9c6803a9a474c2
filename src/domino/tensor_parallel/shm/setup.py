"""Setting the shared-memory transport up: whether every rank of a group is on one host, the
files under /dev/shm (one mapping, one FIFO per ordered rank pair) and the agreement, over the
group itself, that every rank could open them (see the package's docstring)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from domino.tensor_parallel.comm import CommGroup  # the agreement's JSON collectives
from domino.tensor_parallel.shm.channel import Channel
from domino.tensor_parallel.shm.transport import SharedMemoryTransport

# One slot per rank and per buffer set: large enough that a piece's barriers cost little next
# to its copies, while the whole mapping stays within _BUDGET_BYTES (containers often give
# /dev/shm 64 MiB), so slots shrink in large groups.
SLOT_BYTES = 4 << 20
_BUDGET_BYTES = 32 << 20
_PREFIX = "domino-shm-"  # + the creating process's pid + "-" + random
_STALE_S = 600.0  # a set-up lasts seconds: an older folder of a dead pid is left over


def host_key() -> str:
    """What two processes must share for the transport to work between them: the kernel (boot
    id), the network namespace (ranks in separate namespaces stand for separate hosts, as in
    the benchmark's emulated links) and the /dev/shm file system."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
        parts.append(str(os.stat("/dev/shm").st_dev))
    except OSError as e:  # not Linux, or no /dev/shm: no transport
        parts.append(f"unavailable:{os.getpid()}:{e}")
    return "|".join(parts)


def _slot_bytes(size: int) -> int:
    return max(64 << 10, min(SLOT_BYTES, _BUDGET_BYTES // (2 * size)) // 64 * 64)


def _group_timeout(group: Any) -> float:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()


def open_transport(group: Any, rank: int, size: int, label: str = "tp",
                   slot_bytes: int | None = None) -> SharedMemoryTransport | None:
    """The transport for gloo process group ``group`` (this rank is ``rank`` of ``size``), or
    None on every rank when it cannot be used. Collective: every rank of the group calls it.
    Agreement runs over ``group`` itself, as JSON (never pickles). ``slot_bytes`` overrides
    the slot size (a multiple of 64; tests use small ones to cut tensors into many pieces)."""
    _check_slot_bytes(slot_bytes, size)
    if size < 2:
        return None
    comm = CommGroup(group, size, rank)
    if len(set(comm.all_gather_json(host_key()))) != 1:
        return None
    slot = _slot_bytes(size) if slot_bytes is None else slot_bytes
    nbytes = 2 * size * slot
    where = comm.broadcast_json(_create(size, nbytes) if rank == 0 else "")
    if not where:
        return None
    ends = _Ends(where, rank, size)
    # Each step's outcome is agreed on: a rank that failed makes every rank give up.
    if any(comm.all_gather_json(_failure(ends.open_mapping_and_reads, nbytes))):
        return _abandon(comm, rank, where, ends.fds())
    if any(comm.all_gather_json(_failure(ends.open_writes))):
        return _abandon(comm, rank, where, ends.fds())
    comm.barrier()  # every rank holds every file open: the names can go
    if rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return SharedMemoryTransport(Channel(rank, size, ends.buffer, slot, ends.reads, ends.writes,
                                         _group_timeout(group), label))


def _check_slot_bytes(slot_bytes: int | None, size: int) -> None:
    if slot_bytes is not None and (slot_bytes % 64 or slot_bytes < max(64, 8 * size)):
        raise ValueError(f"slot_bytes={slot_bytes} must be a multiple of 64 and at least "
                         f"max(64, 8 x the group size {size}) (a reduce-scatter's piece holds "
                         "at least one 8-byte element per rank)")


def _failure(step: Callable[..., None], *args: Any) -> str:
    """What went wrong in ``step(*args)`` ("" when it succeeds): every rank must hear of it."""
    try:
        step(*args)
    except Exception as e:  # noqa: BLE001 - any failure: the others give up too
        return f"{type(e).__name__}: {e}"
    return ""


class _Ends:
    """This rank's ends of the set-up's files: the mapping, and a FIFO from and to each peer."""

    def __init__(self, where: str, rank: int, size: int) -> None:
        self.where, self.rank, self.size = where, rank, size
        self.buffer: torch.Tensor | None = None
        self.reads: dict[int, int] = {}
        self.writes: dict[int, int] = {}

    def fds(self) -> list[int]:
        return [*self.reads.values(), *self.writes.values()]

    def open_mapping_and_reads(self, nbytes: int) -> None:
        self.buffer = torch.from_file(os.path.join(self.where, "slots"), shared=True,
                                      size=nbytes, dtype=torch.uint8)
        for src in range(self.size):  # a read end opens at once without O_NONBLOCK's writer
            if src != self.rank:
                self.reads[src] = os.open(os.path.join(self.where, f"{src}-{self.rank}"),
                                          os.O_RDONLY | os.O_NONBLOCK)

    def open_writes(self) -> None:
        """Once every read end is open: a reader gone since fails (ENXIO) instead of
        blocking. Then every end blocks, as the channel expects."""
        for dst in range(self.size):
            if dst != self.rank:
                self.writes[dst] = os.open(os.path.join(self.where, f"{self.rank}-{dst}"),
                                           os.O_WRONLY | os.O_NONBLOCK)
        for fd in self.fds():
            os.set_blocking(fd, True)


def _abandon(comm: Any, rank: int, where: str, fds: list[int]) -> None:
    """Some rank could not open the files: every rank closes what it opened, then rank 0
    removes the folder; the group keeps to gloo."""
    for fd in fds:
        os.close(fd)
    comm.barrier()
    if rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return None


def _create(size: int, nbytes: int) -> str:
    """A private directory under /dev/shm holding the mapping (its pages reserved, so a full
    /dev/shm fails here rather than with SIGBUS mid-run) and one FIFO per ordered rank pair;
    "" when any of it fails."""
    _remove_stale()
    where = ""
    try:
        where = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir="/dev/shm")
        fd = os.open(os.path.join(where, "slots"), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        for src in range(size):
            for dst in range(size):
                if src != dst:
                    os.mkfifo(os.path.join(where, f"{src}-{dst}"), 0o600)
        return where
    except (OSError, AttributeError):
        if where:
            shutil.rmtree(where, ignore_errors=True)
        return ""


def _remove_stale() -> None:
    """Remove set-up directories left by processes that no longer exist."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        pid = name[len(_PREFIX):].split("-", 1)[0]
        path = os.path.join("/dev/shm", name)
        if not (name.startswith(_PREFIX) and pid.isdigit()):
            continue
        try:  # old as well as ownerless: a pid of another pid namespace may look dead
            if time.time() - os.stat(path).st_mtime < _STALE_S:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive and another user's, or already gone
            pass
