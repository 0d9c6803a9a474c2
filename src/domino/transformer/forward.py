"""The forward of a stack, run by the schedule (see ``executor``): one :class:`ForwardPass` per
call.

The pass holds that call's state - the exits in flight (by the piece that launched them), the
entered region inputs (by the piece that reads them), each micro-batch's residual stream and,
when training, the :class:`Record` its backward (``backward.BackwardPass``) starts from - and
runs, for each j, ``local(j, m), par(j, m)`` for every micro-batch m. Where a local piece runs
inside the par piece before it, and where a wait goes, is the run's
:class:`~domino.transformer.policy.SchedulePolicy`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch

from domino.tensor_parallel.handles import InFlight
from domino.tensor_parallel.layers import WgradStash
from domino.transformer.executor import Executor
from domino.transformer.microbatch import MicroBatch, Prologue


@dataclass(eq=False)
class LocalPiece:
    """A local piece's graph outputs and the leaves that feed the next pieces."""

    ln: torch.Tensor
    res: torch.Tensor | None  # None when the residual is the norm output itself
    ln_leaf: torch.Tensor
    res_leaf: torch.Tensor


@dataclass(eq=False)
class Record:
    """Graph state kept from forward to backward (training only)."""

    mbs: list[MicroBatch]
    prologue: Prologue | None = None
    x_leaves: list[torch.Tensor] = field(default_factory=list)
    mem_leaves: list[torch.Tensor | None] = field(default_factory=list)
    local: dict = field(default_factory=dict)  # (j, m) -> LocalPiece, or final output for j = B
    par: dict = field(default_factory=dict)  # (j, m) -> (partial sums, deferred dW GEMMs)
    reduced: dict = field(default_factory=dict)  # (j, m) -> leaf holding the reduced partials
    core_leaves: dict = field(default_factory=dict)  # sequence parallel: (j, m) -> dense input
    rng: dict = field(default_factory=dict)  # full recompute: ("local"|"par", j, m) -> streams


class ForwardPass:
    """One forward of ``executor``'s stack on ``mbs`` (:meth:`run`, once). ``graph``: record
    what the backward needs (training); ``prologue``: what produces the stack's input, run as
    piece par(-1, m) (the embedding), instead of an input tensor."""

    def __init__(self, executor: Executor, mbs: list[MicroBatch], graph: bool,
                 prologue: Prologue | None = None) -> None:
        if graph:  # each micro-batch's inputs become leaves: its backward starts there
            mbs = [mb if mb.memory is None else
                   dataclasses.replace(mb, memory=mb.memory.detach().requires_grad_())
                   for mb in mbs]
        self.ex, self.policy, self.mbs = executor, executor.policy, mbs
        self.graph, self.prologue = graph, prologue
        self.B, self.M = len(executor.blocks), len(mbs)
        self.rec = Record(mbs, prologue=prologue)
        self.delivering: dict[tuple[int, int], InFlight] = {}  # exits in flight, by producer
        self.entered: dict[tuple[int, int], InFlight] = {}  # par inputs (entries), by consumer
        self.residual: list[torch.Tensor | None] = []
        self.outs: list[torch.Tensor] = []
        # Full recompute: the pieces run without a graph now (only their input leaves are kept).
        self.recompute = graph and executor.recompute
        self.device: torch.device | None = None

    def run(self, x: torch.Tensor | None) -> tuple[torch.Tensor, Record | None]:
        """The stack on x [s, b, h] (sequence parallel: this rank's shard [s/tp, b, h]) or on
        what the prologue produces (x None) -> (y, the record if ``graph`` else None).

        Locals run in (j, m) order, each after the par piece before it, or inside it where the
        policy says (``runs_ahead``): the dropout streams draw the same masks either way, and
        the places are fixed, not chosen by which collectives have finished."""
        self.start(x)
        self.local(0, 0)
        B, M = self.B, self.M
        for k in range(1, (B + 1) * M):
            j, m = divmod(k, M)
            pj, pm = divmod(k - 1, M)
            inside = pj < B and self.policy.runs_ahead(j, m, M)
            if pj < B:
                self.par(pj, pm, partial(self.local, j, m) if inside else None)
            if not inside:
                self.local(j, m)
            if m == M - 1 and j > 0:  # block j - 1's last par and exit's last local are done
                self.ex.units.forward_leave(j - 1)
        y = self.outs[0] if M == 1 else torch.cat(self.outs, dim=1)
        return y, (self.rec if self.graph else None)

    def start(self, x: torch.Tensor | None) -> None:
        """Each micro-batch's input: a leaf of its slice of ``x``, or the prologue's partial
        sums, launched now (par(-1, m), consumed by local(0, m))."""
        rec = self.rec
        self.ex.units.forward_start(self.graph)  # (a sharded first unit: under the embedding)
        for mb in self.mbs:
            rec.mem_leaves.append(mb.memory)
            if self.prologue is not None:
                self.launch_prologue(mb)
                continue
            xm = x[:, mb.batch_start:mb.batch_start + mb.batch_size]  # [s, b/m, h]
            if self.graph:
                xm = xm.detach().requires_grad_()
            rec.x_leaves.append(xm)
        self.residual = list(rec.x_leaves) or [None] * self.M
        self.device = rec.x_leaves[0].device if rec.x_leaves else None

    def launch_prologue(self, mb: MicroBatch) -> None:
        """par(-1, m): the prologue's partial sums and the launch of their sum."""
        ex = self.ex
        with ex.span("fwd embed", mb.index):
            part = self.prologue.partial(mb, ex.seq_shard())
            self.delivering[(-1, mb.index)] = self.policy.eager(
                ex.prologue_exit.launch([part], -1, mb.index))
            if self.graph:
                self.rec.par[(-1, mb.index)] = ([part], None)

    def local(self, j: int, m: int) -> None:
        """local(j, m): what the exit before delivered (or the prologue's), the element-wise
        work, then the launch of block j's entry; for j = B the final norm, the output."""
        ex = self.ex
        if m == 0 and self.policy.syncs_into(j):
            for mm in range(self.M):
                self.delivering[(j - 1, mm)].wait()
        if m == 0 and j < self.B:
            ex.units.forward_enter(j)
        with ex.span(f"fwd local {j}", m):
            reduced = self.delivered(j, m)
            if self.recompute:
                self.snapshot(("local", j, m))
            with self.no_graph():
                out = ex.local_piece(j, self.mbs[m], self.residual[m], reduced, self.prologue)
            if j == self.B:
                self.outs.append(out)
                self.rec.local[(j, m)] = None if self.recompute else out
                return
            ln = self.keep_local(j, m, *out)
            self.entered[(j, m)] = self.policy.eager(ex.entries[j].launch(
                ln, j, m, self.mbs[m], chunks=self.policy.chunks(j, m, self.M)))

    def delivered(self, j: int, m: int) -> torch.Tensor | None:
        """What the exit of par(j - 1, m) (or the prologue) delivered to local(j, m), waited
        for; a leaf of the graph when training."""
        if j == 0 and self.prologue is None:
            return None
        reduced = self.delivering.pop((j - 1, m)).wait()
        if self.graph:
            self.rec.reduced[(j - 1, m)] = reduced.requires_grad_()
        self.device = reduced.device
        return reduced

    def keep_local(self, j: int, m: int, ln: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        """local(j, m)'s outputs kept for the backward (training: the region's input and the
        residual continue from leaves of their own) -> what block j's entry reads."""
        if self.graph:
            piece = LocalPiece(None if self.recompute else ln,
                               None if res is ln or self.recompute else res,
                               ln.detach().requires_grad_(), res.detach().requires_grad_())
            self.rec.local[(j, m)] = piece
            ln, res = piece.ln_leaf, piece.res_leaf
        self.residual[m] = res
        return ln

    def par(self, j: int, m: int, between: Callable[[], None] | None) -> None:
        """par(j, m): block j's region from its entered input to its exit's launch;
        ``between`` (a local piece) runs right after its entry GEMM."""
        ex, rec = self.ex, self.rec
        keep = self.graph and not self.recompute  # the graph kept now (not recomputed)
        stash = WgradStash() if keep else None
        with ex.span(f"fwd par {j}", m) as span:
            ln = self.region_input(j, m)
            if self.recompute:
                self.snapshot(("par", j, m))
            with self.no_graph():
                core = ex.core(j)(ln, self.mbs[m], stash,
                                  None if between is None else span.outside(between))
        core_in = core
        if ex.sp and keep:
            # The backward runs the row-parallel GEMM's and the core's separately (a local^T
            # goes between them): the GEMM starts from its own leaf.
            core_in = rec.core_leaves[(j, m)] = core.detach().requires_grad_()
        parts: list[torch.Tensor] = []
        with ex.span(f"fwd par {j}", m), self.no_graph():
            sent = ex.exits[j].parts(core_in, self.policy.chunks(j, m, self.M), stash, m)
            self.delivering[(j, m)] = self.policy.eager(ex.exits[j].launch(
                _collect(sent, parts), j, m, release=keep))
        if self.graph:
            rec.par[(j, m)] = (parts if keep else None, stash,
                               core if ex.sp and keep else None)

    def region_input(self, j: int, m: int) -> torch.Tensor:
        """What block j's region computes on for micro-batch m (sequence parallel: the whole
        sequence), waited for; training, the region's own leaf where the entry made one."""
        ln = self.entered.pop((j, m)).wait()
        piece = self.rec.local.get((j, m))
        if self.graph and ln is not piece.ln_leaf:
            piece.ln_leaf = ln = ln.requires_grad_()
        return ln

    def no_graph(self) -> contextlib.AbstractContextManager:
        """Where a piece runs: without a graph under full recompute (rebuilt in backward)."""
        return torch.no_grad() if self.recompute else contextlib.nullcontext()

    def snapshot(self, key: tuple) -> None:
        """Full recompute: keep the dropout streams' state for the piece ``key``'s rerun."""
        self.rec.rng[key] = self.ex.blocks[0].rng.snapshot(self.device)


def _collect(gen: Iterable[torch.Tensor], parts: list) -> Iterator[torch.Tensor]:
    """Pass through a generator, remembering what it yielded."""
    for t in gen:
        parts.append(t)
        yield t
