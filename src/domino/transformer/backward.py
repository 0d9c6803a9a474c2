"""The backward of a stack's recorded forward, run by the schedule itself (see ``executor``).

One :class:`BackwardPass` per backward call holds that call's state (input-gradient collectives
in flight, deferred weight-gradient work, what is left per block) and runs the units
``local^T(j+1, m), par^T(j, m)`` in the mirror order of the forward
(``forward.ForwardPass``), under the same :class:`~domino.transformer.policy.SchedulePolicy`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

import torch

from domino.tensor_parallel.handles import InFlight
from domino.tensor_parallel.layers import WgradStash
from domino.transformer import sp_grads
from domino.transformer.context import BackwardContext
from domino.transformer.executor import Executor
from domino.transformer.forward import LocalPiece, Record
from domino.transformer.late_work import LateWork, Task
from domino.transformer.sp_grads import ShardGrads


class BackwardPass:
    """Backward of a :class:`~domino.transformer.forward.ForwardPass` for its record
    (:meth:`run`, once).

    Weight-gradient GEMMs of the TP pieces are deferred (FIFO, so every parameter still
    accumulates its micro-batches in a fixed order) and run whenever the schedule would
    otherwise block on an unfinished all-reduce - at the latest M pieces later, which bounds
    the activations they keep alive; the first layer's are all kept, with ``late`` (the LM
    head's weight gradient) and the prologue's weight gradient, for the last input-gradient
    all-reduces, which nothing after the stack could hide. ``late``, ``sink`` (a zero-bubble
    pipeline's: what is left when the input gradients are done goes there instead of running)
    and ``on_final`` (told of each block's parameters once final, last block first) come from
    the step's :class:`~domino.transformer.context.BackwardContext`.
    """

    def __init__(self, executor: Executor, rec: Record, grad_y: torch.Tensor,
                 context: BackwardContext) -> None:
        ex = self.ex = executor
        self.policy = executor.policy
        self.rec, self.grad_y = rec, grad_y
        self.sink, self.on_final, self.late = context.sink, context.on_final, context.late
        self.B, self.M = B, M = len(ex.blocks), len(rec.mbs)
        self.left = [2 * M] * B  # per block: M weight-gradient stashes and M local backwards
        self.uses_left = [2 * M] * B  # per block: M par^T and M local^T pieces
        self.shard_grads = (ShardGrads(ex.group, ex.blocks, ex.exits, ex.final_norm,
                                       rec.prologue, self.on_final, M, ex.sp)
                            if sp_grads.needed(ex.group, ex.blocks, ex.sp) else None)
        self.device = grad_y.device
        self.pending: dict[tuple[int, int], InFlight] = {}  # entries' gradients in flight
        self.deferred: deque = deque()  # weight-gradient stashes not run yet, oldest first
        self.exit_grads: dict[tuple[int, int], InFlight] = {}  # par^T inputs, in flight
        # Pieces in order, each after the local^T it needs.
        self.order = [(j, m) for j in range(B - 1, -1, -1) for m in range(M)]

    def run(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Returns (grad_x or None with a prologue, grad_memory or None)."""
        ex = self.ex
        streams = ex.blocks[0].rng.snapshot(self.device) if ex.recompute else None
        self.pieces()
        self.finish_weights()
        if streams is not None:  # where the forward left the dropout streams
            ex.blocks[0].rng.restore(self.device, streams)
        return self.input_grads()

    def pieces(self) -> None:
        """Every unit ``local^T(j+1, m), par^T(j, m)``, then the first block's norms. A piece's
        local^T runs inside the piece before it where the policy says (fixed places, as in
        forward)."""
        order, M = self.order, self.M
        for k, (j, m) in enumerate(order):
            if not self._inside(k):
                if m == 0 and self.policy.syncs_before(j + 1):
                    for mm in range(M):
                        self._fill(self.pending[(j + 1, mm)]).wait()
                self.local_bwd(j + 1, m)
            between = None
            if k + 1 < len(order) and self._inside(k + 1):
                between = partial(self.local_bwd, order[k + 1][0] + 1, order[k + 1][1])
            self.par_bwd(j, m, between)
        for m in range(M):  # the first block's norms (no par^T left to run them in)
            self.local_bwd(0, m)

    def finish_weights(self) -> None:
        """The weight-gradient work left: handed to the sink (zero-bubble's W pass), or run
        here with the late work; then the sequence-parallel sums."""
        if self.sink is not None:
            self.sink.extend(self.deferred)
            self.sink.extend(self.late.take_all())  # (ends with the flush of the staged grads)
            self.deferred.clear()
        while self.deferred:
            self.deferred.popleft().run()
        self.late.drain()
        if self.shard_grads is not None:
            self.shard_grads.finish()

    def input_grads(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gradients of the stack's inputs: x (None with a prologue) and the encoder
        memory (None without one)."""
        ex, rec = self.ex, self.rec
        grad_x = _cat_grads(rec.x_leaves) if rec.x_leaves else None
        grad_mem = None
        if rec.mem_leaves[0] is not None:
            # The sum of every cross attention's K/V input gradient (sequence parallel: the
            # memory was gathered, so this rank's shard of that sum).
            grad_mem = _cat_grads(rec.mem_leaves)
            if ex.sp:
                grad_mem = ex.group.reduce_scatter_seq(grad_mem, name="bwd rs memory")[0]
            else:
                ex.group.all_reduce(grad_mem)
        return grad_x, grad_mem

    def _inside(self, k: int) -> bool:
        """Does piece k's local^T run inside piece k - 1?"""
        j, m = self.order[k]
        return self.policy.grad_runs_ahead(j, m, self.M)

    def _done(self, j: int) -> None:
        """One of block j's stashes or local backwards is done; the last makes it final."""
        self.left[j] -= 1
        if self.left[j] == 0:
            if self.shard_grads is not None:  # on_final once they are summed over TP
                self.shard_grads.block_final(j)
            elif self.on_final is not None:
                self.on_final(self.ex.blocks[j].parameters())

    def local_bwd(self, jj: int, m: int) -> None:
        """local^T(jj, m); then launch the backward of par(jj - 1, m)'s exit on the gradient
        it produced (sequence parallel: an all-gather)."""
        ex, rec, B = self.ex, self.rec, self.B
        if m == 0 and jj > 0:
            ex.units.backward_enter(jj - 1)  # (its exit's backward is in this piece)
        with ex.span(f"bwd local {jj}", m):
            if jj == B:
                mb = rec.mbs[m]
                g = self.grad_y[:, mb.batch_start:mb.batch_start + mb.batch_size]
                out = rec.local.pop((B, m))
                if ex.recompute:
                    out = self._recomputed_local(B, m)
                torch.autograd.backward([out], [g])
            else:
                # The last waits (jj = 0) may also use the late work.
                ready = self._fill(self.pending.pop((jj, m)), self.late if jj == 0 else None)
                piece = rec.local.pop((jj, m))
                if ex.recompute:
                    ln, res = self._recomputed_local(jj, m)
                    piece = LocalPiece(ln, None if res is ln else res, piece.ln_leaf,
                                       piece.res_leaf)
                _local_backward(piece, ready.wait())
                self._done(jj)
                if self.shard_grads is not None:
                    self.shard_grads.local_done(jj)
                self._used(jj)
        if jj == 0:
            if rec.prologue is not None:
                self._queue_prologue_backward(m)
        else:  # the exit's backward (sequence parallel: the whole sequence's gradient)
            self.exit_grads[(jj - 1, m)] = self.policy.eager(ex.exits[jj - 1].launch_grad(
                rec.reduced[(jj - 1, m)].grad, jj - 1, m))

    def par_bwd(self, j: int, m: int, between: Callable[[], None] | None) -> None:
        """par^T(j, m); ``between`` (the next piece's local^T) runs between the backward of its
        row-parallel GEMM and the backward of its core."""
        ex, rec = self.ex, self.rec
        with ex.span(f"bwd par {j}", m) as span:
            if between is not None and ex.exits[j].lookahead:
                # An exit whose gradient's launch is work (an MoE combine): the next piece's
                # local^T goes first, so its launch runs under this piece's whole backward.
                span.outside(between)()
                between = None
            parts, stash, core = rec.par.pop((j, m))
            core_in = None
            if ex.recompute:
                stash = WgradStash()
                self._replay(("par", j, m))
                with torch.enable_grad():
                    core = ex.core(j)(rec.local[(j, m)].ln_leaf, rec.mbs[m], stash)
                    core_in = core.detach().requires_grad_() if ex.sp else core
                    parts = list(ex.exits[j].parts(
                        core_in, self.policy.chunks(j, m, self.M), stash, m))
                if not ex.sp:
                    core = None
            del rec.reduced[(j, m)]
            # The dW GEMMs land in the stash.
            for step in ex.exits[j].grad_steps(self.exit_grads.pop((j, m)), parts):
                torch.autograd.backward(step.parts, step.cut(self._fill(step.grad).wait()))
            if core is not None:  # sequence parallel: the core's backward on its own
                leaf = core_in if ex.recompute else rec.core_leaves.pop((j, m))
                if between is not None:
                    span.outside(between)()
                torch.autograd.backward([core], [leaf.grad])
            elif between is not None:
                span.outside(between)()
            ln_leaf = rec.local[(j, m)].ln_leaf
            self.pending[(j, m)] = self.policy.eager(
                ex.entries[j].launch_grad(ln_leaf.grad, j, m))
            self.deferred.append(Task(partial(self._run_stash, stash, j)))
            self._used(j)
            keep = self.policy.wgrad_backlog(j, len(self.deferred), self.M)
            while self.sink is None and len(self.deferred) > keep:
                self.deferred.popleft().run()

    def _used(self, j: int) -> None:
        """One of block j's par^T or (its norms') local^T pieces is done: after the last of
        them, the backward is done with the block's parameters (``param_units``)."""
        self.uses_left[j] -= 1
        if self.uses_left[j] == 0:
            self.ex.units.backward_leave(j)

    def _recomputed_local(self, j: int, m: int):
        """local(j, m)'s graph rebuilt from its kept input leaves (full recompute)."""
        ex, rec = self.ex, self.rec
        residual = (rec.local[(j - 1, m)].res_leaf if j > 0
                    else rec.x_leaves[m] if rec.x_leaves else None)
        self._replay(("local", j, m))
        with torch.enable_grad():
            return ex.local_piece(j, rec.mbs[m], residual, rec.reduced.get((j - 1, m)),
                                  rec.prologue)

    def _replay(self, key: tuple) -> None:
        """Full recompute: the dropout streams as the forward left them for piece ``key``."""
        self.ex.blocks[0].rng.restore(self.device, self.rec.rng.pop(key))

    def _run_stash(self, stash: WgradStash, j: int) -> None:
        """A deferred weight-gradient stash of block j's (then one less left of the block)."""
        stash.run()
        self._done(j)

    def _fill(self, pending: InFlight, late: LateWork | None = None) -> InFlight:
        """Run deferred weight-gradient work (then ``late`` work) while ``pending`` is in
        flight."""
        while not pending.ready():
            if self.deferred:
                with self.ex.span("bwd wgrad", None):
                    self.deferred.popleft().run()
            elif late is not None and len(late):
                with self.ex.span("bwd late", None):
                    late.pop().run()
            else:
                break
        return pending

    def _queue_prologue_backward(self, m: int) -> None:
        """The prologue's backward for micro-batch m (its weight gradient: an embedding's
        scatter-add) as late work: the remaining all-reduces run under it."""
        rec, late = self.rec, self.late
        (part,), _ = rec.par.pop((-1, m))
        grad = rec.reduced.pop((-1, m)).grad
        params = [p for p in rec.prologue.parameters() if p.requires_grad]
        if grad is None or not part.requires_grad or not params:
            return
        space = late.space()
        arriving = self.policy.eager(self.ex.prologue_exit.launch_grad(grad, -1, m))

        def run() -> None:
            g = arriving.wait()
            grads = torch.autograd.grad([part], params, [g], allow_unused=True)
            for p, g in zip(params, grads, strict=True):
                if g is not None:
                    late.stage(p, space).add_(g)

        late.add(Task(run))


def _local_backward(piece: LocalPiece, ln_grad: torch.Tensor) -> None:
    res_grad = piece.res_leaf.grad
    if piece.res is None:  # the residual is the norm output: both gradients meet there
        torch.autograd.backward([piece.ln], [ln_grad + res_grad])
    else:
        torch.autograd.backward([piece.ln, piece.res], [ln_grad, res_grad])


def _cat_grads(leaves: list[torch.Tensor]) -> torch.Tensor:
    if len(leaves) == 1:
        return leaves[0].grad.clone()
    return torch.cat([leaf.grad for leaf in leaves], dim=1)
