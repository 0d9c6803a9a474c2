"""The schedule policy: where one run of a stack launches and waits, for both of its passes.

A stack of B blocks runs, per micro-batch m, the pieces ``local(0, m), par(0, m), ...,
par(B-1, m), local(B, m)`` (``executor``); the forward (``forward.ForwardPass``) and the
backward (``backward.BackwardPass``) order them and launch and wait the ops' collectives. What
they may not choose themselves is here, in one object per run: where a wait goes (the plan's
overlap), which local piece runs inside the piece before it, how many column chunks a piece
is cut into, how long weight-gradient work may wait. Every answer depends on the plan, the
blocks and the ops' edges only, never on which collective happens to have finished: every TP
rank must launch the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

from domino.plan import Plan
from domino.tensor_parallel.handles import InFlight

# Column chunks at least of the forward's last piece (see SchedulePolicy.chunks; measured in
# docs/schedules.md).
TAIL_CHUNKS = 2


class SchedulePolicy:
    """Where one run's passes wait and what runs inside what.

    ``plan``: the run's schedule; ``layers``: each block's layer (``Block.layer``), whose
    boundaries the ``intra_layer`` overlap waits at; ``sequence_parallel``: the run's local
    pieces hold sequence shards; ``entry_lookahead`` / ``exit_lookahead``: per block, whether
    launching its entry (forward) or its exit's gradient (backward) is work worth hiding
    (``exits.Entry.lookahead``).
    """

    def __init__(self, plan: Plan, layers: Sequence[int], sequence_parallel: bool,
                 entry_lookahead: Sequence[bool], exit_lookahead: Sequence[bool]) -> None:
        self.plan, self.layers, self.sp = plan, list(layers), sequence_parallel
        self.entry_lookahead, self.exit_lookahead = list(entry_lookahead), list(exit_lookahead)
        self.blocks = len(self.layers)

    @property
    def overlaps(self) -> bool:
        """Does the plan overlap anything (else every collective is waited for at launch)?"""
        return self.plan.overlap != "none"

    def eager(self, inflight: InFlight) -> InFlight:
        """``inflight``, waited for at once when the plan overlaps nothing."""
        if not self.overlaps:
            inflight.wait()
        return inflight

    def syncs_before(self, j: int) -> bool:
        """intra_layer: every all-reduce of the previous layer finishes before block j runs
        (and, in backward, before the backward of the block before it)."""
        return (self.plan.overlap == "intra_layer" and 0 < j < self.blocks
                and self.layers[j] != self.layers[j - 1])

    def syncs_into(self, j: int) -> bool:
        """Forward: does local(j, 0) wait for every all-reduce of the pieces before it? Under
        intra_layer at each layer boundary, and before the final norm."""
        return self.syncs_before(j) or (self.plan.overlap == "intra_layer"
                                        and j == self.blocks)

    def chunks(self, j: int, m: int, micro_batches: int) -> int:
        """Column chunks of piece (j, m). The forward's very last piece has no later compute to
        hide its all-reduce under, so it is split in at least TAIL_CHUNKS: all but its last
        chunk's all-reduce then run under its own remaining GEMM."""
        if (j == self.blocks - 1 and m == micro_batches - 1 and self.overlaps
                and micro_batches > 1):
            return max(self.plan.column_chunks, TAIL_CHUNKS)
        return self.plan.column_chunks

    def looks_ahead(self, m: int, micro_batches: int, boundary_sync: bool) -> bool:
        """May micro-batch m's local piece run inside the piece before it? Not with one
        micro-batch (the collective it waits for would be that piece's own), nor when nothing
        overlaps, nor across a wait the plan puts there (``boundary_sync``, for m = 0)."""
        if micro_batches == 1 or not self.overlaps:
            return False
        return m > 0 or not boundary_sync

    def runs_ahead(self, j: int, m: int, micro_batches: int) -> bool:
        """Forward: does local(j, m) run inside the par piece before it - par(j, m-1), or
        par(j-1, M-1) for m = 0 - right after that piece's entry GEMM? Then the GEMM hides the
        collective local(j, m) waits for, and the rest of the piece (attention or activation,
        the row-parallel GEMM) what it launches. Every local piece under sequence parallelism
        (its all-gather), otherwise one whose entry launches work (an MoE layer's router and
        dispatch, the ring's first exchange)."""
        ahead = self.sp or (j < self.blocks and self.entry_lookahead[j])
        return ahead and self.looks_ahead(m, micro_batches, self.syncs_into(j))

    def grad_runs_ahead(self, j: int, m: int, micro_batches: int) -> bool:
        """Backward: does local^T(j + 1, m) run inside the par^T piece before it (between its
        row-parallel GEMM's backward and its core's, which then hides what local^T
        launches)? Under sequence parallelism, or where block j's exit's gradient launches
        work (an MoE combine); never for the backward's first piece."""
        if not (self.sp or self.exit_lookahead[j]) or (j == self.blocks - 1 and m == 0):
            return False
        return self.looks_ahead(m, micro_batches, self.syncs_before(j + 1))

    def wgrad_backlog(self, j: int, queued: int, micro_batches: int) -> int:
        """Backward: how many deferred weight-gradient stashes may stay queued after par^T(j,
        m) (``queued`` are): none when nothing overlaps; in the first layer all of them (they
        run under the last input-gradient all-reduces, which nothing after the stack could
        hide); elsewhere M, which bounds the activations they keep alive."""
        if not self.overlaps:
            return 0
        return queued if self.layers[j] == self.layers[0] else micro_batches
