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

Backward is the mirror image (units ``local^T(j+1, m), par^T(j, m)``), driven explicitly here:
PyTorch's autograd engine runs ready nodes in reverse creation order, which would make every
micro-batch wait for its own gradient all-reduce at once; running each piece's backward
ourselves lets other micro-batches' backward run under it. The whole stack is therefore one
autograd Function whose backward runs this schedule (like reentrant checkpointing, parameter
gradients accumulate into ``.grad`` directly).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from domino.plan import Plan
from domino.tensor_parallel.comm import CommGroup, Handle
from domino.tensor_parallel.layers import WgradStash
from domino.utils import even_splits

if TYPE_CHECKING:
    from domino.transformer.attention import InferenceParams
    from domino.transformer.layer import Block

# Column chunks of the forward's last piece (see Executor._chunks): measured on a simulated
# CPU-free 1 Gbit/s link, 2 micro-batches, the forward's exposed tail fell from 17 to 11 ms.
TAIL_CHUNKS = 2


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """What the pieces of one micro-batch read besides their input tensor (read-only: the
    executor hands pieces a new one rather than writing into it)."""

    index: int = 0
    batch_start: int = 0  # first sample of this micro-batch in the full batch
    batch_size: int = 0  # samples in this micro-batch
    self_mask: torch.Tensor | None = None  # bool, True = masked, broadcastable [b, 1, sq, sk]
    causal: bool = False
    cross_mask: torch.Tensor | None = None
    rotary: torch.Tensor | None = None  # [s, b, 1, rot_dim]
    memory: torch.Tensor | None = None  # encoder output [s_enc, b, h] for cross attention
    inference_params: InferenceParams | None = None


class Prologue(Protocol):
    """Work before the stack's first block whose result needs the TP all-reduce (the embedding:
    each rank looks up its vocabulary shard). The schedule all-reduces each micro-batch's
    partial sums asynchronously and hands the sum to :meth:`finish`."""

    shape: tuple[int, int]  # (s, b) of the stack input it produces

    def partial(self, mb: MicroBatch, seq_shard: tuple[int, int] | None = None) -> torch.Tensor:
        """This rank's partial sums for micro-batch ``mb`` (any layout :meth:`finish` reads;
        with ``seq_shard`` = (rank, size), sequence parallelism, [s, b_m, ...]: the schedule
        reduce-scatters them along the sequence)."""

    def finish(self, reduced: torch.Tensor, mb: MicroBatch,
               seq_shard: tuple[int, int] | None = None) -> torch.Tensor:
        """The stack input [s, b_m, h] of ``mb`` from the all-reduced partial sums (with
        ``seq_shard``: rank's shard [s/size, b_m, h] from its reduce-scattered shard)."""

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients its backward produces."""


class LateWork:
    """Gradient work that is complete but need not run yet (items with ``run()``), handed to a
    stack's backward by what follows the stack (the LM head's weight-gradient GEMM) and by the
    stack's own prologue (the embedding's): the schedule runs it under its last all-reduces,
    where nothing else is left to hide them.

    Their gradients are *staged*: each parameter's parts of one backward pass (the head's row
    chunks, every micro-batch's embedding gradient: a tied word table gets both) are summed in a
    scratch tensor in a fixed order - items run oldest first - and added to ``.grad`` once, when
    the pass's late work is done (:meth:`flush`). So the result does not depend on where the
    timing put the split, and accumulating micro-steps adds one tensor per step, as data
    parallelism sums them: DP and gradient accumulation agree bit for bit.

    The first item or stage of a backward pass also queues an autograd-engine callback that
    runs and flushes whatever is left when the pass ends, so nothing is lost when no stack
    backward follows (e.g. ``torch.autograd.grad`` on the head alone).
    """

    def __init__(self) -> None:
        self._items: deque = deque()
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._armed = False

    def __len__(self) -> int:
        return len(self._items)

    def _arm(self) -> None:
        if not self._armed and torch._C._current_graph_task_id() != -1:
            # The engine's end-of-backward callback (what DDP uses to finish its buckets).
            torch.autograd.Variable._execution_engine.queue_callback(self.drain)
            self._armed = True

    def add(self, item) -> None:
        self._items.append(item)
        self._arm()

    def space(self) -> dict:
        """This backward pass's staging space (for items that stage when they run, which may
        be after :meth:`take_all` handed the pass to a pipeline's W pass)."""
        return self._staged

    def stage(self, param: torch.Tensor, space: dict | None = None) -> torch.Tensor:
        """The scratch gradient of ``param`` in ``space`` (default: this backward pass's),
        zeros at first use."""
        space = self._staged if space is None else space
        entry = space.get(id(param))
        if entry is None:
            entry = (param, torch.zeros_like(param))
            space[id(param)] = entry
            self._arm()
        return entry[1]

    def pop(self):
        """The oldest item, or None."""
        return self._items.popleft() if self._items else None

    def take_all(self) -> list:
        """Every item, and a last one that flushes the staged gradients (a zero-bubble
        pipeline's W pass runs them later)."""
        items, self._items = list(self._items), deque()
        # This pass's scratches go with its items: a later pass stages into fresh ones.
        staged, self._staged = self._staged, {}
        return [*items, Task(lambda: _add_staged(staged))] if items or staged else items

    def flush(self) -> None:
        """Add every staged gradient to its parameter's ``.grad``."""
        staged, self._staged = self._staged, {}
        _add_staged(staged)

    def drain(self) -> None:
        """Run every item (oldest first), then :meth:`flush`."""
        self._armed = False
        while self._items:
            self._items.popleft().run()
        self.flush()


def _add_staged(staged: dict) -> None:
    for param, grad in staged.values():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


@dataclass(eq=False)
class Task:
    """A deferred piece of backward work (``run()`` once)."""

    fn: Callable[[], None]

    def run(self) -> None:
        self.fn()


def split_batch(batch: int, micro_batches: int) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch along the batch dim; sizes differ by at most one."""
    Plan(micro_batches).check_fits(batch)
    return even_splits(batch, micro_batches)


@dataclass(eq=False)
class _Pending:
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
class _Local:
    """A local piece's graph outputs and the leaves that feed the next pieces."""

    ln: torch.Tensor
    res: torch.Tensor | None  # None when the residual is the norm output itself
    ln_leaf: torch.Tensor
    res_leaf: torch.Tensor


@dataclass(eq=False)
class _Record:
    """Graph state kept from forward to backward (training only)."""

    mbs: list[MicroBatch]
    prologue: Prologue | None = None
    x_leaves: list[torch.Tensor] = field(default_factory=list)
    mem_leaves: list[torch.Tensor | None] = field(default_factory=list)
    local: dict = field(default_factory=dict)  # (j, m) -> _Local, or final output for j = B
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

    def _snapshot(self, rec: _Record, key: tuple, device: torch.device) -> None:
        rec.rng[key] = self.blocks[0].rng.snapshot(device)

    def _replay(self, rec: _Record, key: tuple, device: torch.device) -> None:
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
                ) -> _Pending:
        """All-reduce (sequence parallel: reduce-scatter) each tensor as soon as ``tensors``
        (possibly a generator) yields it. ``release``: free the tensors' data once sent
        (sequence parallel only; see :class:`_Pending`)."""
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
        pending = _Pending(bufs, handles, sent)
        if self.plan.overlap == "none":
            pending.wait()
        return pending

    def _gather(self, t: torch.Tensor, j: int, m: int, direction: str) -> _Pending:
        """Sequence parallel: all-gather the shard ``t`` (a TP region's input or, in backward,
        its output gradient) into the whole sequence."""
        buf, handle = self.group.all_gather_seq(t.detach(), async_op=True,
                                                name=f"{direction} ag b{j}",
                                                tags={"mb": m, "block": j, "chunk": 0})
        pending = _Pending([buf], [handle])
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
        rec = _Record(mbs, prologue=prologue)
        pending: dict[tuple[int, int], _Pending] = {}  # partial sums in flight, by producer
        gathered: dict[tuple[int, int], _Pending] = {}  # sequence parallel: par inputs
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
                    piece = _Local(None if recompute else ln,
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
            with _Span(self.group, f"fwd par {j}", m) as span:
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

    # -- backward -----------------------------------------------------------------------------
    def backward(self, rec: _Record, grad_y: torch.Tensor, sink: list | None = None,
                 late: LateWork | None = None,
                 on_final: Callable[[Block], None] | None = None):
        """Backward of :meth:`forward`; returns (grad_x or None with a prologue, grad_memory
        or None).

        Weight-gradient GEMMs of the TP pieces are deferred (FIFO, so every parameter still
        accumulates its micro-batches in a fixed order) and run whenever the schedule would
        otherwise block on an unfinished all-reduce - at the latest M pieces later, which bounds
        the activations they keep alive; the first layer's are all kept, with ``late`` (the LM
        head's weight gradient) and the prologue's weight gradient, for the last input-gradient
        all-reduces, which nothing after the stack could hide. With ``sink`` (a zero-bubble
        pipeline), what is left when the input gradients are done goes there instead of running.

        ``on_final(block)`` is called as soon as every gradient of a block's parameters is
        complete (its norm, its TP region and the bias its exit adds), last block first: what a
        data-parallel reducer launches its buckets on.
        """
        B, M = len(self.blocks), len(rec.mbs)
        if on_final is not None and sink is not None:
            raise ValueError("on_final needs the weight gradients run here, not sunk")
        left = [2 * M] * B  # per block: M weight-gradient stashes and M local backwards to go
        shard_grads = (_ShardGrads(self.group, self.blocks, self.final_norm, rec.prologue,
                                   on_final, M) if self.sp else None)

        def done(j: int) -> None:
            left[j] -= 1
            if left[j] == 0:
                if shard_grads is not None:  # on_final once they are summed over TP
                    shard_grads.block_final(j)
                elif on_final is not None:
                    on_final(self.blocks[j])
        late = late if late is not None else LateWork()
        device = grad_y.device
        streams = self.blocks[0].rng.snapshot(device) if self.recompute else None
        pending: dict[tuple[int, int], _Pending] = {}  # input-gradient all-reduces in flight
        deferred: deque[WgradStash] = deque()
        first_layer = self.blocks[0].layer if self.blocks else None
        gathered: dict[tuple[int, int], _Pending] = {}  # sequence parallel: par^T inputs

        def local_bwd(jj: int, m: int) -> None:
            """local^T(jj, m); then (sequence parallel) launch the all-gather of the output
            gradient of par(jj - 1, m) it produced."""
            with self._span(f"bwd local {jj}", m):
                if jj == B:
                    mb = rec.mbs[m]
                    g = grad_y[:, mb.batch_start:mb.batch_start + mb.batch_size]
                    out = rec.local.pop((B, m))
                    if self.recompute:
                        out = self._recomputed_local(rec, B, m, device)
                    torch.autograd.backward([out], [g])
                else:
                    # The last waits (jj = 0) may also use the late work.
                    ready = self._fill(deferred, pending.pop((jj, m)), late if jj == 0 else None)
                    piece = rec.local.pop((jj, m))
                    if self.recompute:
                        ln, res = self._recomputed_local(rec, jj, m, device)
                        piece = _Local(ln, None if res is ln else res, piece.ln_leaf,
                                       piece.res_leaf)
                    self._local_backward(piece, ready.wait())
                    done(jj)
                    if shard_grads is not None:
                        shard_grads.local_done(jj)
            if jj == 0:
                if rec.prologue is not None:
                    self._queue_prologue_backward(rec, m, late)
            elif self.sp:  # the whole sequence's, for the TP region's backward
                gathered[(jj - 1, m)] = self._gather(rec.reduced[(jj - 1, m)].grad, jj - 1, m,
                                                     "bwd")

        def par_bwd(j: int, m: int, between: Callable[[], None] | None) -> None:
            """par^T(j, m); ``between`` (the next piece's local^T) runs between the backward of
            its row-parallel GEMM and the backward of its core."""
            with _Span(self.group, f"bwd par {j}", m) as span:
                parts, stash, core = rec.par.pop((j, m))
                core_in = None
                if self.recompute:
                    stash = WgradStash()
                    self._replay(rec, ("par", j, m), device)
                    with torch.enable_grad():
                        core = self.blocks[j].op.core(rec.local[(j, m)].ln_leaf, rec.mbs[m],
                                                      stash)
                        core_in = core.detach().requires_grad_() if self.sp else core
                        parts = list(self.blocks[j].dense_partials(
                            core_in, self._chunks(j, m, B, M), stash))
                    if not self.sp:
                        core = None
                reduced = rec.reduced.pop((j, m))
                g = self._fill(deferred, gathered.pop((j, m))).wait() if self.sp else reduced.grad
                grads = ([g] if len(parts) == 1
                         else list(torch.split(g, [p.shape[-1] for p in parts], dim=-1)))
                torch.autograd.backward(parts, grads)  # dW GEMMs land in the stash
                if core is not None:  # sequence parallel: the core's backward on its own
                    leaf = core_in if self.recompute else rec.core_leaves.pop((j, m))
                    if between is not None:
                        span.outside(between)()
                    torch.autograd.backward([core], [leaf.grad])
                elif between is not None:
                    span.outside(between)()
                ln_leaf = rec.local[(j, m)].ln_leaf
                pending[(j, m)] = self._launch([ln_leaf.grad], j, m, "bwd")
                deferred.append(_Counted(stash, lambda j=j: done(j)))
                keep = 0 if self.plan.overlap == "none" else (
                    len(deferred) if self.blocks[j].layer == first_layer else M)
                while sink is None and len(deferred) > keep:
                    deferred.popleft().run()

        # Pieces in order, each after the local^T it needs; under sequence parallelism that
        # local^T runs inside the piece before it where it can (fixed places, as in forward).
        order = [(j, m) for j in range(B - 1, -1, -1) for m in range(M)]

        def inside(k: int) -> bool:  # does piece k's local^T run inside piece k - 1?
            j, m = order[k]
            if not self.sp or M == 1 or self.plan.overlap == "none" or k == 0:
                return False
            return m > 0 or not self._syncs_before(j + 1)

        for k, (j, m) in enumerate(order):
            if not inside(k):
                if m == 0 and self._syncs_before(j + 1):
                    for mm in range(M):
                        self._fill(deferred, pending[(j + 1, mm)]).wait()
                local_bwd(j + 1, m)
            nxt = k + 1 < len(order) and inside(k + 1)
            par_bwd(j, m, (lambda k=k: local_bwd(order[k + 1][0] + 1, order[k + 1][1]))
                    if nxt else None)
        for m in range(M):  # the first block's norms (no par^T left to run them in)
            local_bwd(0, m)
        if sink is not None:
            sink.extend(deferred)
            sink.extend(late.take_all())  # (ends with the flush of the staged gradients)
            deferred.clear()
        while deferred:
            deferred.popleft().run()
        late.drain()
        if shard_grads is not None:
            shard_grads.finish()
        if streams is not None:  # where the forward left the dropout streams
            self.blocks[0].rng.restore(device, streams)
        grad_x = _cat_grads(rec.x_leaves) if rec.x_leaves else None
        grad_mem = None
        if rec.mem_leaves[0] is not None:
            # The sum of every cross attention's K/V input gradient (sequence parallel: the
            # memory was gathered, so this rank's shard of that sum).
            grad_mem = _cat_grads(rec.mem_leaves)
            if self.sp:
                grad_mem = self.group.reduce_scatter_seq(grad_mem, name="bwd rs memory")[0]
            else:
                self.group.all_reduce(grad_mem)
        return grad_x, grad_mem

    def _recomputed_local(self, rec: _Record, j: int, m: int, device: torch.device):
        """local(j, m)'s graph rebuilt from its kept input leaves (full recompute)."""
        residual = (rec.local[(j - 1, m)].res_leaf if j > 0
                    else rec.x_leaves[m] if rec.x_leaves else None)
        self._replay(rec, ("local", j, m), device)
        with torch.enable_grad():
            return self._local_piece(j, rec.mbs[m], residual, rec.reduced.get((j - 1, m)),
                                     rec.prologue)

    def _fill(self, deferred: deque, pending: _Pending, late: LateWork | None = None) -> _Pending:
        """Run deferred weight-gradient work (then ``late`` work) while ``pending`` is in
        flight."""
        while not pending.ready():
            if deferred:
                with self._span("bwd wgrad", None):
                    deferred.popleft().run()
            elif late is not None and len(late):
                with self._span("bwd late", None):
                    late.pop().run()
            else:
                break
        return pending

    def _queue_prologue_backward(self, rec: _Record, m: int, late: LateWork) -> None:
        """The prologue's backward for micro-batch m (its weight gradient: an embedding's
        scatter-add) as late work: the remaining all-reduces run under it."""
        (part,), _ = rec.par.pop((-1, m))
        grad = rec.reduced.pop((-1, m)).grad
        params = [p for p in rec.prologue.parameters() if p.requires_grad]
        if grad is None or not part.requires_grad or not params:
            return
        space = late.space()
        gathered = self._gather(grad, -1, m, "bwd") if self.sp else None

        def run() -> None:
            g = grad if gathered is None else gathered.wait()
            grads = torch.autograd.grad([part], params, [g], allow_unused=True)
            for p, g in zip(params, grads, strict=True):
                if g is not None:
                    late.stage(p, space).add_(g)

        late.add(Task(run))

    @staticmethod
    def _local_backward(piece: _Local, ln_grad: torch.Tensor) -> None:
        res_grad = piece.res_leaf.grad
        if piece.res is None:  # the residual is the norm output: both gradients meet there
            torch.autograd.backward([piece.ln], [ln_grad + res_grad])
        else:
            torch.autograd.backward([piece.ln, piece.res], [ln_grad, res_grad])


class _Span:
    """A compute span of the group's hook that other work can step out of (``outside``), so
    spans never nest."""

    def __init__(self, group: CommGroup, name: str, m: int | None) -> None:
        self.group, self.name, self.m = group, name, m
        self.cm = None

    def __enter__(self) -> _Span:
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


class _ShardGrads:
    """Sequence parallelism: the replicated parameters that see only this rank's sequence shard
    (the blocks' norms and row-parallel biases, the final norm, the prologue's position and
    token-type tables) get partial gradients. One backward pass's parts are summed over the TP
    group - a block's, asynchronously, as soon as its local backwards are done, the rest when
    the pass ends - and only then added to what ``.grad`` held before the pass, so accumulating
    micro-steps adds each pass's sum once. ``on_final`` hears of a block once it is final
    (deferred GEMMs included) and summed, in the order blocks became final."""

    def __init__(self, group: CommGroup, blocks: list[Block], final_norm, prologue,
                 on_final: Callable[[Block], None] | None, micro_batches: int) -> None:
        self.group, self.blocks, self.on_final = group, blocks, on_final
        self.per_block = [[*b.norm.parameters(),
                           *([b.op.dense.bias] if b.op.dense.bias is not None else [])]
                          for b in blocks]
        self.tail = [*(final_norm.parameters() if final_norm is not None else []),
                     *(p for p in (prologue.parameters() if prologue is not None else [])
                       if not getattr(p, "tensor_model_parallel", False))]
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for p in [*(p for ps in self.per_block for p in ps), *self.tail]:
            if p.requires_grad and id(p) not in self.before:
                self.before[id(p)] = (p, p.grad)
                p.grad = None
        self.locals_left = [micro_batches] * len(blocks)
        self.inflight: deque = deque()  # (block index or None, params, flat sum, handle)
        self.summed: set[int] = set()
        self.final: deque[int] = deque()  # final blocks not reported yet, in order

    def _launch(self, j: int | None, params: list[torch.Tensor]) -> None:
        params = [p for p in params if p.grad is not None and id(p) in self.before]
        flat = torch.cat([p.grad.reshape(-1) for p in params]) if params else None
        handle = (self.group.all_reduce(flat, async_op=True, name="sp param grads")
                  if params else None)
        self.inflight.append((j, params, flat, handle))

    def _settle(self, wait: bool) -> None:
        while self.inflight and (wait or self.inflight[0][3] is None
                                 or self.inflight[0][3].ready()):
            j, params, flat, handle = self.inflight.popleft()
            if handle is not None:
                handle.wait()
            offset = 0
            for p in params:
                summed = flat[offset:offset + p.numel()].view_as(p.grad)
                offset += p.numel()
                _, old = self.before.pop(id(p))
                if old is None:
                    p.grad.copy_(summed)
                else:  # keep the tensor .grad held before (a reducer may hold it)
                    p.grad = old.add_(summed)
            if j is not None:
                self.summed.add(j)
        while self.final and self.final[0] in self.summed:
            j = self.final.popleft()
            if self.on_final is not None:
                self.on_final(self.blocks[j])

    def local_done(self, j: int) -> None:
        """One of block j's local backwards (its norm's) is done: the last launches its sum
        (its exit's bias was done before, by the next piece's local backward)."""
        self.locals_left[j] -= 1
        if self.locals_left[j] == 0:
            self._launch(j, self.per_block[j])
        self._settle(wait=False)

    def block_final(self, j: int) -> None:
        self.final.append(j)
        self._settle(wait=False)

    def finish(self) -> None:
        """The input gradients are done: sum what is left and wait for every sum. (A zero-bubble
        W pass may still run deferred GEMMs later; they touch none of these parameters.)"""
        self._launch(None, self.tail)
        self._settle(wait=True)
        for p, old in self.before.values():  # no gradient this pass: .grad is as before
            p.grad = old
        self.before.clear()


@dataclass(eq=False)
class _Counted:
    """A block's deferred weight-gradient stash that reports when it has run."""

    stash: WgradStash
    after: Callable[[], None]

    def run(self) -> None:
        self.stash.run()
        self.after()


def _collect(gen, parts: list):
    """Pass through a generator, remembering what it yielded."""
    for t in gen:
        parts.append(t)
        yield t


def _cat_grads(leaves: list[torch.Tensor]) -> torch.Tensor:
    if len(leaves) == 1:
        return leaves[0].grad.clone()
    return torch.cat([leaf.grad for leaf in leaves], dim=1)
