"""Domino schedules: the order of (piece, micro-batch) steps and where the waits go.

The executor runs a stack of blocks under a :class:`~domino.plan.Plan` and hands each piece what
it needs as arguments: a read-only :class:`MicroBatch` (its slice of the batch, masks, RoPE
angles, encoder memory, KV cache) and, when training, the stash its weight-gradient GEMMs are
deferred to (``Block.op.core`` and ``Block.dense_partials``; a block's TP region implements
``layer.BlockOp``).

A stack of B blocks (see ``layer.py``) has, per micro-batch m, pieces

    local(0, m), par(0, m), local(1, m), par(1, m), ..., par(B-1, m), local(B, m)

where ``par(j)`` runs block j from its column-parallel entry to its row-parallel partial sums and
``local(j)`` runs exit(j-1) + enter(j) (local(B) ends with the final norm). The all-reduce of
par(j, m)'s output is consumed by local(j+1, m). In backward the input-gradient all-reduce of
par(j, m) is consumed by local(j, m)'s backward.

Forward runs, for each j, ``local(j, m), par(j, m)`` for every m: micro-batch m's all-reduce is
in flight while micro-batches m+1.. compute. The waits:

* ``none``: right after each launch (micro-batching without overlap; sync TP when m = 1),
* ``intra_layer``: lazily, but all of a layer's all-reduces finish before the next layer starts,
* ``cross_layer``: lazily only, so the last micro-batch's MLP all-reduce runs under the next
  layer's first attention piece.

A :class:`Prologue` (the embedding, whose vocabulary-parallel lookup gives partial sums) is
piece ``par(-1, m)``: its all-reduce runs while the next micro-batches' lookups and the first
block of micro-batch 0 compute, and its weight gradient joins the backward's late work.

Sequence parallelism (``Executor(sequence_parallel=True)``): local pieces run on this rank's
sequence shard; par(j, m) starts with an all-gather of local(j, m)'s norm output and its partial
sums are reduce-scattered instead of all-reduced. local(j, m) then runs inside the par piece
before it, right after that piece's entry GEMM (:meth:`Executor._looks_ahead`), so that the GEMM
hides the reduce-scatter it waits for and the rest of the piece the all-gather it launches. The
places are fixed: every TP rank must launch the same collectives in the same order, so nothing
here may depend on which collective happens to have finished. The backward mirrors it: the
local^T that produces a piece's output gradient runs inside the piece before it, between that
piece's row-parallel GEMM backward and its core's backward, which then hides the gradient's
all-gather.

Backward is the mirror image (units ``local^T(j+1, m), par^T(j, m)``), driven explicitly (by
``backward.BackwardPass``):
PyTorch's autograd engine runs ready nodes in reverse creation order, which would make every
micro-batch wait for its own gradient all-reduce at once; running each piece's backward
ourselves lets other micro-batches' backward run under it. The whole stack is therefore one
autograd Function whose backward runs this schedule (like reentrant checkpointing, parameter
gradients accumulate into ``.grad`` directly).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from domino.plan import Plan
from domino.tensor_parallel.comm import CommGroup, Handle
from domino.tensor_parallel.layers import WgradStash
from domino.transformer.layer import Block
from domino.transformer.microbatch import MicroBatch, Prologue

# Column chunks of the forward's last piece (see Executor._chunks): measured on a simulated
# CPU-free 1 Gbit/s link, 2 micro-batches, the forward's exposed tail fell from 17 to 11 ms.
TAIL_CHUNKS = 2


@dataclass(eq=False)
class Pending:
    """An all-reduce in flight: its buffers (one per column chunk) and handles."""

    buffers: list[torch.Tensor]
    handles: list[Handle]
    # Inputs freed once sent: a reduce-scatter's partial sums stay graph roots of the backward,
    # which needs their shapes and autograd nodes but not their data.
    release: list[torch.Tensor] = field(default_factory=list)

    def ready(self) -> bool:
        return all(h.ready() for h in self.handles)

    def wait(self) -> torch.Tensor:
        for h in self.handles:
            h.wait()
        for t in self.release:
            t.untyped_storage().resize_(0)
        self.release = []
        return self.buffers[0] if len(self.buffers) == 1 else torch.cat(self.buffers, dim=-1)


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


class Executor:
    """Runs a stack of blocks under a :class:`Plan` (forward, and backward when training)."""

    def __init__(self, blocks: list[Block], final_norm: torch.nn.Module | None,
                 group: CommGroup, plan: Plan, recompute: bool = False,
                 sequence_parallel: bool = False) -> None:
        """``recompute``: full activation recomputation - training forwards keep only each
        piece's inputs (the leaves between pieces) and dropout stream states, and the backward
        reruns every piece's forward just before its backward (the all-reduced sums are kept,
        so recomputing communicates nothing).

        ``sequence_parallel``: the local pieces run on this rank's sequence shard
        [s / tp, b, h]; each TP region is entered by an all-gather of its input and left by a
        reduce-scatter of its partial sums (the backward mirrors both), and the gradients of
        the replicated parameters the shards touch (norms, the row-parallel biases, the
        prologue's position tables) are summed over the TP group."""
        self.blocks, self.final_norm, self.group, self.plan = blocks, final_norm, group, plan
        self.recompute = recompute and bool(blocks)
        self.sp = sequence_parallel and group.size > 1

    def _local_piece(self, j: int, mb: MicroBatch, residual: torch.Tensor | None,
                     reduced: torch.Tensor | None, prologue: Prologue | None):
        """local(j, m): exit(j - 1) (or the prologue's finish) then enter(j) -> (ln, residual),
        or for j = B the final norm -> the stack output."""
        h = residual
        if j == 0 and prologue is not None:
            h = prologue.finish(reduced, mb, self._seq_shard())
        elif j > 0:
            h = self.blocks[j - 1].exit(reduced, h, self._seq_shard())
        if j == len(self.blocks):
            return self.final_norm(h) if self.final_norm is not None else h
        return self.blocks[j].enter(h)

    def _snapshot(self, rec: Record, key: tuple, device: torch.device) -> None:
        rec.rng[key] = self.blocks[0].rng.snapshot(device)

    def _replay(self, rec: Record, key: tuple, device: torch.device) -> None:
        self.blocks[0].rng.restore(device, rec.rng.pop(key))

    def _span(self, name: str, m: int | None):
        return self.group.region(name, "compute", mb=m)

    def _syncs_before(self, j: int) -> bool:
        """intra_layer: every all-reduce of the previous layer finishes before block j runs."""
        return (self.plan.overlap == "intra_layer" and 0 < j < len(self.blocks)
                and self.blocks[j].layer != self.blocks[j - 1].layer)

    def _seq_shard(self) -> tuple[int, int] | None:
        return (self.group.rank, self.group.size) if self.sp else None

    def _launch(self, tensors, j: int, m: int, direction: str, release: bool = False
                ) -> Pending:
        """All-reduce (sequence parallel: reduce-scatter) each tensor as soon as ``tensors``
        (possibly a generator) yields it. ``release``: free the tensors' data once sent
        (sequence parallel only; see :class:`Pending`)."""
        bufs, handles, sent = [], [], []
        for c, t in enumerate(tensors):
            tags = {"mb": m, "block": j, "chunk": c}
            if self.sp:
                buf, handle = self.group.reduce_scatter_seq(
                    t.detach(), async_op=True, name=f"{direction} rs b{j}", tags=tags)
                if release and t.is_contiguous():  # (reduce_scatter_seq copied it otherwise)
                    sent.append(t.detach())
            else:
                buf = t.detach()  # reduced in place: no autograd node saved these outputs
                handle = self.group.all_reduce(buf, async_op=True, name=f"{direction} b{j}",
                                               tags=tags)
            bufs.append(buf)
            handles.append(handle)
        pending = Pending(bufs, handles, sent)
        if self.plan.overlap == "none":
            pending.wait()
        return pending

    def _gather(self, t: torch.Tensor, j: int, m: int, direction: str) -> Pending:
        """Sequence parallel: all-gather the shard ``t`` (a TP region's input or, in backward,
        its output gradient) into the whole sequence."""
        buf, handle = self.group.all_gather_seq(t.detach(), async_op=True,
                                                name=f"{direction} ag b{j}",
                                                tags={"mb": m, "block": j, "chunk": 0})
        pending = Pending([buf], [handle])
        if self.plan.overlap == "none":
            pending.wait()
        return pending

    def _looks_ahead(self, j: int, m: int, M: int) -> bool:
        """Sequence parallel: does local(j, m) run inside the par piece before it - par(j, m-1),
        or par(j-1, M-1) for m = 0 - right after that piece's entry GEMM? Then the GEMM hides
        the reduce-scatter local(j, m) waits for, and the rest of the piece (attention or
        activation, the row-parallel GEMM) the all-gather it launches. Not with one
        micro-batch (that reduce-scatter would be the piece's own), nor across a wait the plan
        puts between layers."""
        if M == 1 or self.plan.overlap == "none":
            return False
        return m > 0 or not self._syncs_into(j)

    def _syncs_into(self, j: int) -> bool:
        """Forward: does local(j, 0) wait for every all-reduce of the pieces before it? Under
        intra_layer at each layer boundary, and before the final norm."""
        return self._syncs_before(j) or (self.plan.overlap == "intra_layer"
                                         and j == len(self.blocks))

    def _chunks(self, j: int, m: int, B: int, M: int) -> int:
        """Column chunks of piece (j, m). The forward's very last piece has no later compute to
        hide its all-reduce under, so it is split in at least TAIL_CHUNKS: all but its last
        chunk's all-reduce then run under its own remaining GEMM."""
        if j == B - 1 and m == M - 1 and self.plan.overlap != "none" and M > 1:
            return max(self.plan.column_chunks, TAIL_CHUNKS)
        return self.plan.column_chunks

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor | None, mbs: list[MicroBatch], graph: bool,
                prologue: Prologue | None = None):
        """Run the stack on x [s, b, h] (sequence parallel: this rank's shard [s/tp, b, h]) or
        on what ``prologue`` produces (x None); returns (y, record if ``graph`` else None)."""
        if graph:  # each micro-batch's inputs become leaves: its backward starts there
            mbs = [mb if mb.memory is None else
                   dataclasses.replace(mb, memory=mb.memory.detach().requires_grad_())
                   for mb in mbs]
        B, M = len(self.blocks), len(mbs)
        rec = Record(mbs, prologue=prologue)
        pending: dict[tuple[int, int], Pending] = {}  # partial sums in flight, by producer
        gathered: dict[tuple[int, int], Pending] = {}  # sequence parallel: par inputs
        for mb in mbs:
            rec.mem_leaves.append(mb.memory)
            if prologue is not None:  # par(-1, m): launched now, consumed by local(0, m)
                with self._span("fwd embed", mb.index):
                    part = prologue.partial(mb, self._seq_shard())
                    pending[(-1, mb.index)] = self._launch([part], -1, mb.index, "fwd")
                    if graph:
                        rec.par[(-1, mb.index)] = ([part], None)
                continue
            xm = x[:, mb.batch_start:mb.batch_start + mb.batch_size]  # [s, b/m, h]
            if graph:
                xm = xm.detach().requires_grad_()
            rec.x_leaves.append(xm)
        residual: list[torch.Tensor | None] = list(rec.x_leaves) or [None] * M
        lns: list[torch.Tensor | None] = [None] * M  # each micro-batch's next par input
        outs: list[torch.Tensor] = []
        recompute = graph and self.recompute
        # Recomputed pieces run without a graph now (only their input leaves are kept).
        nograd = torch.no_grad if recompute else contextlib.nullcontext
        device = rec.x_leaves[0].device if rec.x_leaves else None

        def run_local(j: int, m: int) -> None:
            nonlocal device
            if m == 0 and self._syncs_into(j):
                for mm in range(M):
                    pending[(j - 1, mm)].wait()
            with self._span(f"fwd local {j}", m):
                reduced = None
                if j > 0 or prologue is not None:
                    reduced = pending.pop((j - 1, m)).wait()
                    if graph:
                        rec.reduced[(j - 1, m)] = reduced.requires_grad_()
                    device = reduced.device
                if recompute:
                    self._snapshot(rec, ("local", j, m), device)
                with nograd():
                    out = self._local_piece(j, mbs[m], residual[m], reduced, prologue)
                if j == B:
                    outs.append(out)
                    rec.local[(j, m)] = None if recompute else out
                    return
                ln, res = out
                if graph:
                    piece = LocalPiece(None if recompute else ln,
                                   None if res is ln or recompute else res,
                                   ln.detach().requires_grad_(), res.detach().requires_grad_())
                    rec.local[(j, m)] = piece
                    ln, res = piece.ln_leaf, piece.res_leaf
                residual[m] = res
                if self.sp:
                    gathered[(j, m)] = self._gather(ln, j, m, "fwd")
                else:
                    lns[m] = ln

        def run_par(j: int, m: int, between: Callable[[], None] | None) -> None:
            """par(j, m); ``between`` (a local piece) runs right after its entry GEMM."""
            parts: list[torch.Tensor] = []
            stash = WgradStash() if graph and not recompute else None
            with Span(self.group, f"fwd par {j}", m) as span:
                ln = lns[m]
                if self.sp:  # the whole sequence: what the TP region computes on
                    ln = gathered.pop((j, m)).wait()
                    if graph:
                        rec.local[(j, m)].ln_leaf = ln = ln.requires_grad_()
                if recompute:
                    self._snapshot(rec, ("par", j, m), device)
                with nograd():
                    core = self.blocks[j].op.core(
                        ln, mbs[m], stash, None if between is None else span.outside(between))
            core_in = core
            if self.sp and graph and not recompute:
                # The backward runs the row-parallel GEMM's and the core's separately (a
                # local^T goes between them): the GEMM starts from its own leaf.
                core_in = rec.core_leaves[(j, m)] = core.detach().requires_grad_()
            with self._span(f"fwd par {j}", m), nograd():
                gen = self.blocks[j].dense_partials(core_in, self._chunks(j, m, B, M), stash)
                pending[(j, m)] = self._launch(_collect(gen, parts), j, m, "fwd",
                                               release=graph and not recompute)
            if graph:
                rec.par[(j, m)] = (None if recompute else parts, stash,
                                   core if self.sp and not recompute else None)

        # Locals in (j, m) order, each after the par piece before it; under sequence
        # parallelism inside it where it can be (see _looks_ahead). The dropout streams thus
        # draw the same masks either way. The places are fixed, not chosen by which collectives
        # have finished: every TP rank must launch its collectives in the same order.
        run_local(0, 0)
        for k in range(1, (B + 1) * M):
            j, m = divmod(k, M)
            pj, pm = divmod(k - 1, M)
            inside = self.sp and pj < B and self._looks_ahead(j, m, M)
            if pj < B:
                run_par(pj, pm, (lambda j=j, m=m: run_local(j, m)) if inside else None)
            if not inside:
                run_local(j, m)
        y = outs[0] if M == 1 else torch.cat(outs, dim=1)
        return y, (rec if graph else None)


class Span:
    """A compute span of the group's hook that other work can step out of (``outside``), so
    spans never nest."""

    def __init__(self, group: CommGroup, name: str, m: int | None) -> None:
        self.group, self.name, self.m = group, name, m
        self.cm = None

    def __enter__(self) -> Span:
        self.cm = self.group.region(self.name, "compute", mb=self.m)
        self.cm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.cm.__exit__(*exc)

    def outside(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` wrapped to run with this span closed (it reopens after)."""
        def run() -> None:
            self.cm.__exit__(None, None, None)
            try:
                fn()
            finally:
                self.__enter__()
        return run


def _collect(gen, parts: list):
    """Pass through a generator, remembering what it yielded."""
    for t in gen:
        parts.append(t)
        yield t

