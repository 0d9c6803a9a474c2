"""A shared-memory transport for the collectives of CPU ranks that share one host.

gloo moves every byte between two processes of one host through loopback TCP: each rank's
worker thread copies into the kernel, the kernel copies to the peer, and the sums run on top.
On this project's 2-CPU host an 8 MiB all-reduce at TP=2 costs 3-5 ms of CPU per rank that way
(and 4.5-7 ms of wall time), CPU the ranks' compute needs: overlapping the transfer then
cannot hide it. Through one shared mapping the same all-reduce is one copy in, a sum of this
rank's 1/N segment and one copy out: 1.1-1.4 ms of wall time and of CPU per rank.

How one collective runs (every rank of the group runs the same steps, in launch order, on its
own worker thread):

- each rank copies its input into its own slot of the mapping;
- a barrier;
- all-reduce: rank r sums segment r of every slot, in rank order, and publishes the sum in its
  own slot; after a second barrier every rank copies every other segment from its owner's slot
  (two ranks: each sums the whole tensor, its own and the peer's slot, and is done: fewer
  copies, one barrier);
- reduce-scatter: each rank copies in only the chunks the others sum; rank r sums chunk r of
  every slot and its own, in rank order, into its output;
- all-gather: every rank copies every slot into its output.

Sums run in rank order on one rank, so every rank gets the same bits, and a reduce-scatter the
bits of the pairwise gloo exchange it replaces. Two sets of slots alternate, so a rank may run
one collective ahead of the slowest without overwriting what that one still reads; tensors
larger than a slot go through in pieces. A barrier is one byte written to a FIFO per peer and
one read from each: a waiting rank sleeps in the kernel and takes no CPU. A peer that exits
closes its FIFOs, so the others see end-of-file and fail at once; a peer that stops taking
part makes them fail after the process group's timeout.

The files (one mapping, the FIFOs) live in a fresh private directory under /dev/shm that is
removed as soon as every rank has opened them, so a crash later leaves nothing behind; one
during set-up can, and the next set-up removes directories whose creating process is gone.
:func:`open_transport` decides on every rank alike whether the transport can be used (one
host: same boot, same network namespace, same /dev/shm; the files could be created, sized and
opened) and returns None everywhere otherwise, so the group keeps to gloo.
"""

from __future__ import annotations

import os
import queue
import select
import shutil
import socket
import tempfile
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SLOT_BYTES", "SharedMemoryTransport", "host_key", "open_transport"]

# One slot per rank and per buffer set: large enough that a piece's barriers cost little next
# to its copies, while the whole mapping stays within _BUDGET_BYTES (containers often give
# /dev/shm 64 MiB), so slots shrink in large groups.
SLOT_BYTES = 4 << 20
_BUDGET_BYTES = 32 << 20
_PREFIX = "domino-shm-"  # + the creating process's pid + "-" + random
_STALE_S = 600.0  # a set-up lasts seconds: an older folder of a dead pid is left over
_POLL_MAX_MS = 2**31 - 1  # poll()'s limit
_LEFT = "left a collective (it exited, or its transport failed)"
_REDUCE = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
}
_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
           torch.int64, torch.uint8, torch.int8}


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


class _Work:
    """One queued collective: ``wait()`` blocks until the worker ran it (and re-raises what
    failed there), ``is_completed()`` never blocks."""

    __slots__ = ("run", "done", "error")

    def __init__(self, run) -> None:
        self.run, self.done, self.error = run, threading.Event(), None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class SharedMemoryTransport:
    """All-reduce, reduce-scatter and all-gather of contiguous CPU tensors over one shared
    mapping (see the module's docstring); each call queues the collective for the worker
    thread and returns its work object (``wait()``, ``is_completed()``). Built by
    :func:`open_transport`. ``close()`` stops the worker after what was queued; dropping the
    transport does the same (the thread holds only the channel, never the transport)."""

    def __init__(self, channel: _Channel) -> None:
        self.rank, self.size = channel.rank, channel.size
        self._channel = channel
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(channel, self._queue),
                                        name=f"domino-shm-{channel.label}", daemon=True)
        self._thread.start()
        self._stop = weakref.finalize(self, self._queue.put, None)
        # Not at interpreter exit: there the FIFOs close with the process, as gloo's sockets
        # do, rather than while a rank leaving on an error is still tearing down.
        self._stop.atexit = False
        self._closed = False

    def supports(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> bool:
        return (tensor.device.type == "cpu" and tensor.is_contiguous()
                and tensor.dtype in _DTYPES and op in _REDUCE)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> _Work:
        self._check_each("all_reduce", op, tensor)
        c, flat, reduce = self._channel, tensor.view(-1), _REDUCE[op]
        return self._submit(lambda: c.all_reduce(flat, reduce))

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> _Work:
        self._check("reduce_scatter", output, tensor, output.numel() * self.size,
                    tensor.numel())
        c, out, flat = self._channel, output.view(-1), tensor.view(-1)
        return self._submit(lambda: c.reduce_scatter(out, flat))

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> _Work:
        self._check("all_gather", output, tensor, output.numel(), tensor.numel() * self.size)
        c, out, flat = self._channel, output.view(-1), tensor.view(-1)
        return self._submit(lambda: c.all_gather(out, flat))

    def close(self, wait: bool = True) -> None:
        """Stop the worker once what was queued has run (``wait``: and wait for it; a run
        leaving on an error does not), closing the FIFOs. Later collectives raise."""
        self._closed = True
        self._stop()
        if wait:
            self._thread.join()

    def _check_each(self, kind: str, op: Any, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if not self.supports(t, op):
                raise ValueError(
                    f"{kind}: the shared-memory transport takes contiguous CPU tensors of "
                    f"{sorted(str(d).removeprefix('torch.') for d in _DTYPES)} and ops "
                    "SUM, MAX and MIN; got a "
                    f"{'contiguous' if t.is_contiguous() else 'non-contiguous'} {t.dtype} "
                    f"tensor on {t.device} with {op} (CommGroup sends the others to gloo)")

    def _check(self, kind: str, output: torch.Tensor, tensor: torch.Tensor, have: int,
               need: int) -> None:
        """A malformed call fails here, on the caller's thread, before any rank waits on it."""
        self._check_each(kind, dist.ReduceOp.SUM, output, tensor)
        if output.dtype != tensor.dtype or have != need:
            raise ValueError(
                f"{kind}: output {tuple(output.shape)} {output.dtype} does not fit input "
                f"{tuple(tensor.shape)} {tensor.dtype} over {self.size} ranks (the output "
                f"must hold {'1/size' if kind == 'reduce_scatter' else 'size times'} the "
                "input's elements, of the same dtype)")

    def _submit(self, run) -> _Work:
        if self._closed:
            raise RuntimeError(f"the shared-memory transport of the {self._channel.label} "
                               "group is closed; build a new ParallelState")
        work = _Work(run)
        if self._channel.failed is not None:  # a peer is gone: nothing more can complete
            work.error = self._channel.failure()
            work.done.set()
        else:
            self._queue.put(work)
        return work


def _serve(channel: _Channel, jobs: queue.SimpleQueue) -> None:
    """The worker thread: run queued collectives in order until told to stop. After a failure
    every later collective fails with it (the ranks are out of step)."""
    try:
        while (work := jobs.get()) is not None:
            if channel.failed is None:
                try:
                    with torch.no_grad():
                        work.run()
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    channel.failed = e
                    channel.close()  # the peers see end-of-file now, not at their timeout
            work.run = None  # its tensors and the channel: not kept alive by a handle
            if channel.failed is not None:
                work.error = channel.failure()
            work.done.set()
    finally:
        channel.close()


class _Channel:
    """One rank's end of the mapping and the FIFOs, and the three algorithms over them; used
    by the worker thread only."""

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

    def _barrier(self) -> None:
        for peer, fd in self._writes.items():
            try:
                os.write(fd, b"\x01")
            except BrokenPipeError:
                raise RuntimeError(f"rank {peer} of the group {_LEFT}") from None
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
                    raise RuntimeError(f"rank {by_fd[fd]} of the group {_LEFT}")
                poller.unregister(fd)
                del by_fd[fd]

    def _slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """This piece's set of slots, one per rank, viewed as ``dtype``."""
        base = (self._step % 2) * self.size * self.slot_bytes
        self._step += 1
        raw = self._buffer[base:base + self.size * self.slot_bytes]
        return list(raw.view(dtype).chunk(self.size))

    def all_reduce(self, flat: torch.Tensor, reduce) -> None:
        per = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per):
            piece = flat[start:start + per]
            n = piece.numel()
            slots = [s[:n] for s in self._slots(flat.dtype)]
            slots[self.rank].copy_(piece)
            self._barrier()
            if self.size == 2:  # both sum the whole piece: one barrier, less copying
                first, second = (slots[0], piece) if self.rank else (piece, slots[1])
                reduce(first, second, out=piece)
                continue
            bounds = [n * q // self.size for q in range(self.size + 1)]
            a, b = bounds[self.rank], bounds[self.rank + 1]
            # Summed into this rank's own tensor (its own slot holds an input still to read),
            # then published in its slot for the others.
            mine = piece[a:b]
            _combine([s[a:b] for s in slots], mine, reduce)
            slots[self.rank][a:b].copy_(mine)
            self._barrier()
            for q in range(self.size):
                if q != self.rank:
                    piece[bounds[q]:bounds[q + 1]].copy_(slots[q][bounds[q]:bounds[q + 1]])

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        m = out.numel()
        per = self.slot_bytes // flat.element_size() // self.size
        # This rank's own chunk is read where it is, not copied in, unless the output overlaps
        # the input (then the sum could overwrite it before it is read).
        o, f = out.data_ptr(), flat.data_ptr()  # both contiguous: these are their byte ranges
        apart = o + out.nbytes <= f or f + flat.nbytes <= o
        for start in range(0, m, per):
            n = min(per, m - start)
            slots = self._slots(flat.dtype)
            mine = slots[self.rank][:self.size * n].view(self.size, n)
            src = flat.view(self.size, m)[:, start:start + n]
            for q in range(self.size):
                if q != self.rank or not apart:
                    mine[q].copy_(src[q])
            self._barrier()
            parts = [s[self.rank * n:(self.rank + 1) * n] for s in slots]
            if apart:
                parts[self.rank] = src[self.rank]
            _combine(parts, out[start:start + n], torch.add)

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        m = flat.numel()
        per = self.slot_bytes // flat.element_size()
        whole = out.view(self.size, m)
        for start in range(0, m, per):
            n = min(per, m - start)
            slots = self._slots(flat.dtype)
            slots[self.rank][:n].copy_(flat[start:start + n])
            self._barrier()
            for q in range(self.size):
                whole[q, start:start + n].copy_(slots[q][:n])


def _combine(parts: list[torch.Tensor], out: torch.Tensor, reduce) -> None:
    """``out`` = ``parts`` reduced in rank order (``out`` may be ``parts[0]`` or ``parts[1]``,
    never a later one: it is written before those are read)."""
    reduce(parts[0], parts[1], out=out)
    for part in parts[2:]:
        reduce(out, part, out=out)


def open_transport(group: Any, rank: int, size: int, label: str = "tp",
                   slot_bytes: int | None = None) -> SharedMemoryTransport | None:
    """The transport for gloo process group ``group`` (this rank is ``rank`` of ``size``), or
    None on every rank when it cannot be used. Collective: every rank of the group calls it.
    Agreement runs over ``group`` itself, as JSON (never pickles). ``slot_bytes`` overrides
    the slot size (a multiple of 64; tests use small ones to cut tensors into many pieces)."""
    from domino.tensor_parallel.comm import CommGroup  # the JSON collectives

    if slot_bytes is not None and (slot_bytes % 64 or slot_bytes < max(64, 8 * size)):
        raise ValueError(f"slot_bytes={slot_bytes} must be a multiple of 64 and at least "
                         f"max(64, 8 x the group size {size}) (a reduce-scatter's piece holds "
                         "at least one 8-byte element per rank)")
    if size < 2:
        return None
    comm = CommGroup(group, size, rank)
    if len(set(comm.all_gather_json(host_key()))) != 1:
        return None
    slot = _slot_bytes(size) if slot_bytes is None else slot_bytes
    nbytes = 2 * size * slot
    where = ""
    if rank == 0:
        where = _create(size, nbytes)
    where = comm.broadcast_json(where)
    if not where:
        return None
    buffer, reads, writes, error = None, {}, {}, ""
    try:
        buffer = torch.from_file(os.path.join(where, "slots"), shared=True, size=nbytes,
                                 dtype=torch.uint8)
        for src in range(size):  # a read end opens at once without O_NONBLOCK's writer
            if src != rank:
                reads[src] = os.open(os.path.join(where, f"{src}-{rank}"),
                                     os.O_RDONLY | os.O_NONBLOCK)
    except Exception as e:  # noqa: BLE001 - any failure here: every rank must hear of it
        error = f"{type(e).__name__}: {e}"
    if any(comm.all_gather_json(error)):
        return _abandon(comm, rank, where, list(reads.values()))
    try:  # every read end is open now; a reader gone since fails (ENXIO) instead of blocking
        for dst in range(size):
            if dst != rank:
                writes[dst] = os.open(os.path.join(where, f"{rank}-{dst}"),
                                      os.O_WRONLY | os.O_NONBLOCK)
        for fd in [*reads.values(), *writes.values()]:
            os.set_blocking(fd, True)
    except Exception as e:  # noqa: BLE001 - any failure here: every rank must hear of it
        error = f"{type(e).__name__}: {e}"
    if any(comm.all_gather_json(error)):
        return _abandon(comm, rank, where, [*reads.values(), *writes.values()])
    comm.barrier()  # every rank holds every file open: the names can go
    if rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return SharedMemoryTransport(_Channel(rank, size, buffer, slot, reads, writes,
                                          _group_timeout(group), label))


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
