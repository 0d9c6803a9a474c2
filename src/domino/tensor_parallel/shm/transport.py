"""The shared-memory transport's public face: the calls CommGroup makes, checked on the
caller's thread, and the worker thread that runs them in launch order."""

from __future__ import annotations

import math
import queue
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from domino.tensor_parallel.shm import ops
from domino.tensor_parallel.shm.channel import Channel
from domino.tensor_parallel.split_sizes import all_to_all_splits

_REDUCE = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
}
_DTYPES = frozenset(ops.DTYPES)


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
    """All-reduce, reduce-scatter, all-gather and all-to-all of contiguous CPU tensors over one
    shared mapping (see the package's docstring); each call queues the collective for the
    worker thread and returns its work object (``wait()``, ``is_completed()``). Built by
    :func:`~domino.tensor_parallel.shm.open_transport`. ``close()`` stops the worker after
    what was queued; dropping the transport does the same (the thread holds only the channel,
    never the transport)."""

    def __init__(self, channel: Channel) -> None:
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
        return self._submit(lambda: ops.all_reduce(c, flat, reduce))

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> _Work:
        self._check("reduce_scatter", output, tensor, output.numel() * self.size,
                    tensor.numel())
        c, out, flat = self._channel, output.view(-1), tensor.view(-1)
        return self._submit(lambda: ops.reduce_scatter(c, out, flat))

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> _Work:
        self._check("all_gather", output, tensor, output.numel(), tensor.numel() * self.size)
        c, out, flat = self._channel, output.view(-1), tensor.view(-1)
        return self._submit(lambda: ops.all_gather(c, out, flat))

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor,
                   output_split_sizes: Sequence[int] | None = None,
                   input_split_sizes: Sequence[int] | None = None) -> _Work:
        """Rows (dim 0) ``input_split_sizes[q]`` of ``tensor`` to rank q; ``output`` gets
        ``output_split_sizes[q]`` rows from rank q (None: even splits). Malformed sizes fail
        here; sizes that do not match the peers' fail on the worker, every rank alike."""
        self._check_each("all_to_all", dist.ReduceOp.SUM, output, tensor)
        outs, ins = all_to_all_splits(output, tensor, self.size, output_split_sizes,
                                      input_split_sizes)
        c, out, flat = self._channel, output.view(-1), tensor.view(-1)
        row = math.prod(tensor.shape[1:])
        return self._submit(lambda: ops.all_to_all(c, out, flat, outs, ins, row))

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


def _serve(channel: Channel, jobs: queue.SimpleQueue) -> None:
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
