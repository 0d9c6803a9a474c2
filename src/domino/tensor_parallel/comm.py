"""Tier 1: collectives over one process group, with handles, device/backend agnostic.

A :class:`CommGroup` is a process group plus this rank's place in it (``size``, ``rank``), the
device of its own buffers, and optional attachments. Every collective in the library goes
through one (each group of a ``ParallelState``: one per parallel dimension, the derived
gradient groups, the tied-embedding group and ``world``); nothing else calls
``torch.distributed`` collectives.

- Collectives: ``all_reduce`` (in place), ``reduce_scatter`` / ``all_gather_into`` (flat or
  along dim 0; ``*_seq`` allocate the output for sequence parallelism), ``all_to_all`` (dim 0
  cut by uneven split sizes), ``broadcast``, point-to-point ``isend`` / ``irecv``, ``barrier``,
  a blocking ``all_gather_last_dim``, and JSON object collectives (never pickles).
- Transports: the process group's backend (gloo on CPU, NCCL on CUDA; on gloo a
  reduce-scatter and an all-to-all run as pairwise exchanges that post every receive before
  any send, see ``pairwise``) or, when ``transport`` is set,
  the shared-memory transport of :mod:`domino.tensor_parallel.shm` for CPU tensors of ranks
  on one host (``ParallelState`` opens it for tp, dp, ep and embedding; what it does not
  support goes to the process group).
- Handles: the bulk collectives take ``async_op`` and return a :class:`Handle` (``wait()``
  is idempotent, ``ready()`` never blocks), already waited for when ``async_op`` is False;
  ``isend`` / ``irecv`` always return one still in flight.
  ``stats`` counts collectives, bytes and the time spent blocked in ``wait()``.
- Disabled: ``disabled()`` (or ``enabled=False``; a group of one always) makes every
  collective a no-op whose output is filled locally, as a group of one would: the same compute
  without communication (the benchmark's ``nocomm``). What is launched under ``shaping()``
  still runs: the few integers that decide the compute's shapes (an MoE dispatch's counts).
- The hook: tools that trace collectives or stand in for their transport (the benchmark's
  timeline and simulated link) attach a :class:`CommHook`; it sees each bulk collective's
  launch (kind and bytes) and wait, and may replace its transfer (the output then filled as
  when disabled). This tier knows nothing else about them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from domino.tensor_parallel.handles import DONE, CommHook, CommStats, Handle, PairwiseWork
from domino.tensor_parallel.split_sizes import all_to_all_splits

__all__ = ["DONE", "CommGroup", "CommHook", "CommStats", "Handle"]


@dataclass(eq=False)
class CommGroup:
    """A process group plus this rank's place in it.

    ``group=None`` with ``size=1`` is the single-process case: every collective is the identity.
    ``device`` is where the group's own buffers live (object collectives; NCCL needs CUDA).
    """

    group: Any = None
    size: int = 1
    rank: int = 0
    enabled: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    hook: CommHook | None = field(default=None, repr=False)
    stats: CommStats = field(default_factory=CommStats, repr=False)
    # Carries all-reduces, reduce-scatters, all-gathers and all-to-alls of CPU tensors in
    # place of the process group when set (shm.SharedMemoryTransport: ranks on one host).
    transport: Any = field(default=None, repr=False)
    _backend: str | None = field(default=None, repr=False)
    _shaping: bool = field(default=False, repr=False)  # inside shaping(): the real collective

    @property
    def pairwise(self) -> bool:
        """Run reduce-scatters and all-to-alls as pairwise point-to-point exchanges, every
        receive posted before any send? On gloo, yes. gloo's reduce-scatter costs a whole
        all-reduce, where the pairwise exchange costs much less; and a gloo pair whose two ranks
        both send before they receive moves one direction at a time, which its
        ``all_to_all_single`` pays too. gloo's all-gather is near the link's rate and beats an
        exchange: it is kept. NCCL's collectives are used as they are. (The figures, from
        ``scripts/probe_exchange.py``: docs/sequence-parallel.md and docs/moe-measurements.md.)
        """
        if self._backend is None:
            self._backend = str(dist.get_backend(self.group)) if self.group is not None else ""
        return self._backend == "gloo"

    @classmethod
    def world(cls, device: torch.device | str = "cpu") -> CommGroup:
        """Every rank of the default process group (a group of one when it is not initialised)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(device=torch.device(device))
        return cls(dist.group.WORLD, dist.get_world_size(), dist.get_rank(),
                   device=torch.device(device))

    @property
    def active(self) -> bool:
        return self.size > 1 and self.enabled

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the enclosed code with every collective of this group a no-op."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    @contextlib.contextmanager
    def shaping(self) -> Iterator[None]:
        """Collectives launched inside run even while the group is disabled: those whose result
        decides the shapes of the compute after them (an MoE dispatch's per-expert row
        counts). A disabled group stands for the same compute without communication, and
        that compute is only the same when each rank works on the rows it really gets; for
        the same reason a hook's stand-in (a simulated link) is not used for them: the hook
        sees them launched, the real collective runs. (A stand-in group without a process
        group stays disabled.)"""
        before = self.enabled, self._shaping
        self.enabled, self._shaping = before[0] or self.group is not None, True
        try:
            yield
        finally:
            self.enabled, self._shaping = before

    def region(self, name: str, category: str = "compute",
               **tags: Any) -> AbstractContextManager[None]:
        """A stretch of work the hook may record (a no-op without a hook)."""
        if self.hook is None:
            return contextlib.nullcontext()
        return self.hook.region(name, category, **tags)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False,
                   op: dist.ReduceOp = dist.ReduceOp.SUM, name: str = "all_reduce",
                   tags: dict | None = None) -> Handle:
        """In-place all-reduce of ``tensor``; returns a handle (already done when sync).
        ``tags`` describe it to the hook (e.g. micro-batch and block of a schedule)."""
        if not self.active:
            return DONE
        if self._shared(tensor, op=op):
            real = partial(self.transport.all_reduce, tensor, op)
        else:
            real = partial(dist.all_reduce, tensor, op=op, group=self.group, async_op=True)
        return self._start(tensor, name, real, async_op, lambda: None, tags)

    def _shared(self, *tensors: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> bool:
        """Does the shared-memory transport carry a collective of these tensors?"""
        return self.transport is not None and all(
            self.transport.supports(t, op) for t in tensors)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False,
                       name: str = "reduce_scatter", tags: dict | None = None) -> Handle:
        """Sum contiguous ``tensor`` over the group and keep this rank's part of its first
        dimension (``size`` equal chunks) in ``output``: a flat buffer's chunk, or a
        sequence shard of [s, ...]. Disabled: ``output`` gets this rank's own chunk."""
        def local() -> None:
            output.copy_(tensor.chunk(self.size)[self.rank])

        if not self.active:
            local()
            return DONE
        if self._shared(output, tensor):
            real = partial(self.transport.reduce_scatter, output, tensor)
        elif self.pairwise:
            real = partial(self._exchange_reduce_scatter, output, tensor)
        else:
            real = partial(dist.reduce_scatter_single, output, tensor, group=self.group,
                           async_op=True)
        return self._start(tensor, name, real, async_op, local, tags, "reduce_scatter")

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False,
                        name: str = "all_gather", tags: dict | None = None) -> Handle:
        """Every rank's contiguous ``tensor`` concatenated along the first dimension, in rank
        order, into ``output``. Disabled: ``output`` gets ``size`` copies of this rank's."""
        def local() -> None:
            output.copy_(torch.cat([tensor] * self.size))

        if not self.active:
            local()
            return DONE
        if self._shared(output, tensor):
            real = partial(self.transport.all_gather, output, tensor)
        else:
            real = partial(dist.all_gather_single, output, tensor, group=self.group,
                           async_op=True)
        return self._start(output, name, real, async_op, local, tags, "all_gather")

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: Sequence[int] | None = None,
                   input_split_sizes: Sequence[int] | None = None, async_op: bool = False,
                   name: str = "all_to_all", tags: dict | None = None) -> Handle:
        """``torch.distributed.all_to_all_single``: rows (dim 0) ``input_split_sizes[q]`` of
        ``input`` go to rank q, ``output`` gets ``output_split_sizes[q]`` rows from rank q, in
        rank order (None: even splits). Sizes are checked here, on the caller's thread.
        Disabled: ``output`` gets ``input`` (a group of one's), rows past it zeroed."""
        outs, ins = all_to_all_splits(output, input, self.size, output_split_sizes,
                                      input_split_sizes)

        def local() -> None:
            n = min(output.shape[0], input.shape[0])
            output[:n].copy_(input[:n])
            output[n:].zero_()

        if not self.active:
            local()
            return DONE
        if self._shared(output, input):
            real = partial(self.transport.all_to_all, output, input, outs, ins)
        elif self.pairwise:
            real = partial(self._exchange_all_to_all, output, input, outs, ins)
        else:
            real = partial(dist.all_to_all_single, output, input, outs, ins, group=self.group,
                           async_op=True)
        # Counted and shown to the hook: the rows that go to other ranks (a rank's own rows
        # cross no link), as a tensor of their shape holding no data.
        crossing = input.new_empty((sum(ins) - ins[self.rank], *input.shape[1:]),
                                   device="meta")
        return self._start(crossing, name, real, async_op, local, tags, "all_to_all")

    def _exchange_all_to_all(self, output: torch.Tensor, input: torch.Tensor, outs: list[int],
                             ins: list[int]) -> PairwiseWork:
        """Every peer's rows sent and received point to point, each receive posted before any
        send (gloo then moves both directions of a pair at once; see ``pairwise``). Empty
        messages are sent too, so the ranks post the same messages whatever the splits."""
        if input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
            input = input.clone()  # in place: a receive must not land on rows still to send
        at_out, at_in = list(accumulate(outs, initial=0)), list(accumulate(ins, initial=0))
        works = self._post_pairwise(lambda q: output[at_out[q]:at_out[q + 1]],
                                    lambda q: input[at_in[q]:at_in[q + 1]])
        me = self.rank
        output[at_out[me]:at_out[me + 1]].copy_(input[at_in[me]:at_in[me + 1]])
        return PairwiseWork(works, lambda: None)

    def _post_pairwise(self, into, of) -> list:
        """Receive ``into(q)`` from every peer q, then send ``of(q)`` to every peer: every
        receive posted before any send (``pairwise``). At distance d every rank sends to
        rank + d while rank - d sends to it, so the exchanges do not queue; receives from
        rank - 1 first, the peer that sends here first."""
        glob = partial(dist.get_global_rank, self.group)
        near = range(1, self.size)
        works = [dist.irecv(into(q), glob(q), group=self.group)
                 for q in ((self.rank - d) % self.size for d in near)]
        return works + [dist.isend(of(q), glob(q), group=self.group)
                        for q in ((self.rank + d) % self.size for d in near)]

    def _exchange_reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor
                                 ) -> PairwiseWork:
        """Each rank sends every peer that peer's chunk and sums the chunks it receives."""
        chunks = tensor.chunk(self.size)
        parts = {q: torch.empty_like(output) for q in range(self.size) if q != self.rank}
        works = self._post_pairwise(parts.__getitem__, chunks.__getitem__)

        def finish() -> None:  # summed in rank order, the same order on every rank
            parts[self.rank] = chunks[self.rank]
            torch.add(parts[0], parts[1], out=output)
            for r in range(2, self.size):
                output.add_(parts[r])
        return PairwiseWork(works, finish)

    def reduce_scatter_seq(self, tensor: torch.Tensor, async_op: bool = False,
                           name: str = "reduce_scatter", tags: dict | None = None
                           ) -> tuple[torch.Tensor, Handle]:
        """Sequence parallelism's exit: partial sums [s, ...] -> this rank's summed sequence
        shard [s / size, ...] (a new tensor, filled when the handle is done)."""
        tensor = tensor.contiguous()
        if self.size == 1:
            return tensor, DONE
        out = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        return out, self.reduce_scatter(out, tensor, async_op, name, tags)

    def all_gather_seq(self, tensor: torch.Tensor, async_op: bool = False,
                       name: str = "all_gather", tags: dict | None = None
                       ) -> tuple[torch.Tensor, Handle]:
        """Sequence parallelism's entry: this rank's shard [s / size, ...] -> the whole
        sequence [s, ...] (a new tensor, filled when the handle is done)."""
        tensor = tensor.contiguous()
        if self.size == 1:
            return tensor, DONE
        out = tensor.new_empty((tensor.shape[0] * self.size, *tensor.shape[1:]))
        return out, self.all_gather_into(out, tensor, async_op, name, tags)

    def seq_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous part of the first (sequence) dimension."""
        if self.size == 1:
            return tensor
        return tensor.chunk(self.size)[self.rank]

    def _start(self, tensor: torch.Tensor, name: str, real, async_op: bool, local,
               tags: dict | None = None, kind: str = "all_reduce") -> Handle:
        """A collective moving ``tensor``'s bytes: counted, traced, or replaced by the hook's
        transport (then ``local()`` fills the output as a disabled group would)."""
        nbytes = tensor.numel() * tensor.element_size()
        trace = work = None
        if self.hook is not None:
            trace = (self.hook, name, dict(tags or {}), nbytes, time.perf_counter())
            work = self.hook.launch(tensor, self, kind)
            if self._shaping:  # it watches, but the shapes need the real result
                work = None
            if work is not None:
                local()
        if work is None:
            work = real()
        self.stats.count += 1
        self.stats.bytes += nbytes
        handle = Handle(work, self.stats, trace)
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

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, name: str = "send",
              tags: dict | None = None, traced: bool = True) -> Handle:
        """Send ``tensor`` to the group's rank ``dst`` (point to point, asynchronous). ``tag``
        tells messages of one pair apart (gloo; NCCL matches them in order). ``traced=False``
        keeps it off the hook (a send waited for long after it finished would show as a
        transfer lasting until then)."""
        peer = dist.get_global_rank(self.group, dst)
        work = dist.isend(tensor, dst=peer, group=self.group, tag=tag)
        return self._p2p(work, tensor, name, tags if traced else None, traced)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, name: str = "recv",
              tags: dict | None = None) -> Handle:
        """Receive into ``tensor`` from the group's rank ``src`` (asynchronous)."""
        peer = dist.get_global_rank(self.group, src)
        work = dist.irecv(tensor, src=peer, group=self.group, tag=tag)
        return self._p2p(work, tensor, name, tags)

    def _p2p(self, work: Any, tensor: torch.Tensor, name: str, tags: dict | None,
             traced: bool = True) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.count += 1
        self.stats.bytes += nbytes
        trace = None
        if self.hook is not None and traced:
            trace = (self.hook, name, dict(tags or {}), nbytes, time.perf_counter())
        return Handle(work, self.stats, trace)

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]], name: str = "exchange",
                 tags: dict | None = None) -> Handle:
        """Point-to-point sends ``(group rank, tensor)`` and receives ``(group rank, buffer)``
        launched together (``batch_isend_irecv``: NCCL needs a rank's sends and receives in one
        group, or two ranks sending to each other deadlock); one handle for all. The i-th send
        of a rank is the i-th receive of its peer (tag i). Disabled: receive i gets send i,
        as a group of one (every peer itself) would; the hook sees it as one ``p2p`` transfer
        of the bytes sent."""
        sends, recvs = list(sends), list(recvs)

        def local() -> None:
            for (_, buf), (_, sent) in zip(recvs, sends, strict=False):
                buf.copy_(sent)
            for _, buf in recvs[len(sends):]:
                buf.zero_()

        if not self.active:
            local()
            return DONE
        for (peer, t) in sends + recvs:
            if not 0 <= peer < self.size:
                raise ValueError(f"{name}: peer {peer} is not a rank of this group of "
                                 f"{self.size}")
            if not t.is_contiguous():
                raise ValueError(f"{name}: point-to-point tensors must be contiguous")

        def real():
            glob = partial(dist.get_global_rank, self.group)
            # Receives first: on gloo a pair then moves both directions at once (``pairwise``).
            ops = [dist.P2POp(dist.irecv, t, glob(p), self.group, i)
                   for i, (p, t) in enumerate(recvs)]
            ops += [dist.P2POp(dist.isend, t, glob(p), self.group, i)
                    for i, (p, t) in enumerate(sends)]
            return PairwiseWork(dist.batch_isend_irecv(ops), lambda: None)

        # What the hook sees: the bytes this rank sends (a meta tensor: no memory).
        sent = torch.empty(sum(t.numel() * t.element_size() for _, t in sends),
                           dtype=torch.uint8, device="meta")
        return self._start(sent, name, real, True, local, tags, "p2p")

    def barrier(self) -> None:
        """Return once every rank of the group got here."""
        if self.active:
            dist.barrier(group=self.group)

    def broadcast_json(self, obj: Any, src_local_rank: int = 0) -> Any:
        """``obj`` of rank ``src_local_rank`` on every rank (JSON-serialisable values only)."""
        if not self.active:
            return obj
        data = _encode(obj, self.device) if self.rank == src_local_rank else None
        length = torch.tensor([0 if data is None else data.numel()], device=self.device)
        self.broadcast(length, src_local_rank)
        if data is None:
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(data, src_local_rank)
        return _decode(data)

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (JSON-serialisable values only)."""
        if not self.active:
            return [obj] * self.size
        data = _encode(obj, self.device)
        lengths = [torch.zeros(1, dtype=torch.int64, device=self.device)
                   for _ in range(self.size)]
        dist.all_gather(lengths, torch.tensor([data.numel()], device=self.device),
                        group=self.group)
        top = max(int(n.item()) for n in lengths)
        padded = torch.zeros(top, dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data
        parts = [torch.empty(top, dtype=torch.uint8, device=self.device)
                 for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return [_decode(p[:int(n.item())]) for p, n in zip(parts, lengths, strict=True)]


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    raw = json.dumps(obj).encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def _decode(data: torch.Tensor) -> Any:
    return json.loads(data.cpu().numpy().tobytes().decode("utf-8"))
