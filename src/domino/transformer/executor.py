"""Domino schedules: the order of (piece, micro-batch) steps and where the waits go.

The executor runs a stack of blocks under a :class:`~domino.plan.Plan` and hands each piece what
it needs as arguments: a read-only :class:`MicroBatch` (its slice of the batch, masks, RoPE
angles, encoder memory, KV cache) and, when training, the stash its weight-gradient GEMMs are
deferred to (``Block.op.core`` and the op exit's ``parts``; a block's op implements
``layer.BlockOp``). What crosses a piece boundary, and which collective carries it, is the
op's business (its ``entry`` and ``exit``, see ``exits.py``): the executor only launches and
waits their handles.

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
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.layers import WgradStash
from domino.transformer.exits import InFlight, PartialSums
from domino.transformer.kernels import Kernels
from domino.transformer.layer import Block
from domino.transformer.microbatch import MicroBatch, Prologue

# Column chunks of the forward's last piece (see Executor._chunks): measured on a simulated
# CPU-free 1 Gbit/s link, 2 micro-batches, the forward's exposed tail fell from 17 to 11 ms.
TAIL_CHUNKS = 2


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
                 sequence_parallel: bool = False, kernels: Kernels | None = None,
                 context_parallel: bool = False) -> None:
        """``recompute``: full activation recomputation - training forwards keep only each
        piece's inputs (the leaves between pieces) and dropout stream states, and the backward
        reruns every piece's forward just before its backward (the all-reduced sums are kept,
        so recomputing communicates nothing).

        ``sequence_parallel``: the local pieces run on this rank's sequence shard
        [s / tp, b, h]; each TP region is entered by an all-gather of its input and left by a
        reduce-scatter of its partial sums (the backward mirrors both), and the gradients of
        the replicated parameters the shards touch (norms, the row-parallel biases, the
        prologue's position tables) are summed over the TP group.

        ``kernels``: the local pieces' function (eager, or compiled; see ``kernels.py``).

        ``context_parallel``: the run's sequences are split over the CP group (the ops that
        care, MoE's router, are told at their entry)."""
        self.blocks, self.final_norm, self.group, self.plan = blocks, final_norm, group, plan
        self.kernels = kernels if kernels is not None else Kernels()
        self.recompute = recompute and bool(blocks)
        self.sp = sequence_parallel and group.size > 1
        # Each op's collectives for this run; a prologue's result is a sum of partial sums.
        self.entries = [b.op.entry(self.sp, context_parallel) for b in blocks]
        self.exits = [b.op.exit(self.sp, context_parallel) for b in blocks]
        self.prologue_exit = PartialSums(group, self.sp)

    def _local_piece(self, j: int, mb: MicroBatch, residual: torch.Tensor | None,
                     reduced: torch.Tensor | None, prologue: Prologue | None):
        """local(j, m): exit(j - 1) (or the prologue's finish) then enter(j) -> (ln, residual),
        or for j = B the final norm -> the stack output. ``reduced``: what the collective
        of the piece before delivered. The element-wise work is one kernel
        (``kernels.local``); the dropout mask is drawn before it, eagerly."""
        out = bias = keep = None
        scale = 1.0
        if j == 0 and prologue is not None:
            residual = prologue.finish(reduced, mb, self._seq_shard())
        elif j > 0:
            out, bias = reduced, self.exits[j - 1].bias()
            keep, scale = self.blocks[j - 1].dropout_keep(reduced, self._seq_shard())
        local = self.kernels.serving(mb.inference_params is not None).local
        if j == len(self.blocks):
            norm = self.final_norm() if self.final_norm is not None else None
            return local(out, bias, keep, scale, residual, norm, False)[0]
        block = self.blocks[j]
        return local(out, bias, keep, scale, residual, block.norm_args(),
                     block.residual_post_norm)

    def core(self, j: int) -> Callable:
        """Block j's op core in this run: the rest of it where the entry ran its start."""
        return self.entries[j].core or self.blocks[j].op.core

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

    def eager(self, inflight: InFlight) -> InFlight:
        """``inflight``, waited for at once when the plan overlaps nothing."""
        if self.plan.overlap == "none":
            inflight.wait()
        return inflight

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

    def _ahead(self, j: int) -> bool:
        """Forward: may local(j, m) run inside the piece before it? Every local piece under
        sequence parallelism; otherwise one whose entry launches work (``lookahead``: an MoE
        layer's router and dispatch)."""
        return self.sp or (j < len(self.blocks) and self.entries[j].lookahead)

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
        pending: dict[tuple[int, int], InFlight] = {}  # exits in flight, by producer
        entered: dict[tuple[int, int], InFlight] = {}  # par inputs (entries), by consumer
        for mb in mbs:
            rec.mem_leaves.append(mb.memory)
            if prologue is not None:  # par(-1, m): launched now, consumed by local(0, m)
                with self._span("fwd embed", mb.index):
                    part = prologue.partial(mb, self._seq_shard())
                    pending[(-1, mb.index)] = self.eager(
                        self.prologue_exit.launch([part], -1, mb.index))
                    if graph:
                        rec.par[(-1, mb.index)] = ([part], None)
                continue
            xm = x[:, mb.batch_start:mb.batch_start + mb.batch_size]  # [s, b/m, h]
            if graph:
                xm = xm.detach().requires_grad_()
            rec.x_leaves.append(xm)
        residual: list[torch.Tensor | None] = list(rec.x_leaves) or [None] * M
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
                                       ln.detach().requires_grad_(),
                                       res.detach().requires_grad_())
                    rec.local[(j, m)] = piece
                    ln, res = piece.ln_leaf, piece.res_leaf
                residual[m] = res
                entered[(j, m)] = self.eager(self.entries[j].launch(
                    ln, j, m, mbs[m], chunks=self._chunks(j, m, B, M)))

        def run_par(j: int, m: int, between: Callable[[], None] | None) -> None:
            """par(j, m); ``between`` (a local piece) runs right after its entry GEMM."""
            parts: list[torch.Tensor] = []
            stash = WgradStash() if graph and not recompute else None
            with Span(self.group, f"fwd par {j}", m) as span:
                # What the region computes on (sequence parallel: the whole sequence).
                ln = entered.pop((j, m)).wait()
                if graph and ln is not rec.local[(j, m)].ln_leaf:  # the region's own leaf
                    rec.local[(j, m)].ln_leaf = ln = ln.requires_grad_()
                if recompute:
                    self._snapshot(rec, ("par", j, m), device)
                with nograd():
                    core = self.core(j)(
                        ln, mbs[m], stash, None if between is None else span.outside(between))
            core_in = core
            if self.sp and graph and not recompute:
                # The backward runs the row-parallel GEMM's and the core's separately (a
                # local^T goes between them): the GEMM starts from its own leaf.
                core_in = rec.core_leaves[(j, m)] = core.detach().requires_grad_()
            with self._span(f"fwd par {j}", m), nograd():
                gen = self.exits[j].parts(core_in, self._chunks(j, m, B, M), stash, m)
                pending[(j, m)] = self.eager(self.exits[j].launch(
                    _collect(gen, parts), j, m, release=graph and not recompute))
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
            inside = pj < B and self._ahead(j) and self._looks_ahead(j, m, M)
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

