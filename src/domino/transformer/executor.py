"""Domino schedules: the pieces of a stack, what its two passes share, and where they wait.

The executor holds one run of a stack of blocks under a :class:`~domino.plan.Plan`: its blocks,
each op's entry and exit for the run (what crosses a piece boundary, and which collective
carries it, is the op's business: ``exits.py``), the local pieces' kernels and the run's
:class:`~domino.transformer.policy.SchedulePolicy` (where the passes wait). Its passes, one
object per call - :class:`~domino.transformer.forward.ForwardPass` and
:class:`~domino.transformer.backward.BackwardPass` - order the pieces, hand each what it needs
as arguments (a read-only :class:`MicroBatch`: its slice of the batch, masks, RoPE angles,
encoder memory, KV cache; when training, the stash its weight-gradient GEMMs are deferred to,
``Block.op.core`` and the op exit's ``parts``; a block's op implements ``layer.BlockOp``) and
launch and wait the ops' in-flight work.

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

Sequence parallelism (``EdgeContext.sequence_parallel``): local pieces run on this rank's
sequence shard; par(j, m) starts with an all-gather of local(j, m)'s norm output and its partial
sums are reduce-scattered instead of all-reduced. local(j, m) then runs inside the par piece
before it, right after that piece's entry GEMM (``SchedulePolicy.runs_ahead``), so that the
GEMM hides the reduce-scatter it waits for and the rest of the piece the all-gather it
launches. The places are fixed: every TP rank must launch the same collectives in the same
order, so nothing may depend on which collective happens to have finished. The backward
mirrors it: the local^T that produces a piece's output gradient runs inside the piece before
it, between that piece's row-parallel GEMM backward and its core's backward, which then hides
the gradient's all-gather (``SchedulePolicy.grad_runs_ahead``).

Backward is the mirror image (units ``local^T(j+1, m), par^T(j, m)``), driven explicitly:
PyTorch's autograd engine runs ready nodes in reverse creation order, which would make every
micro-batch wait for its own gradient all-reduce at once; running each piece's backward
ourselves lets other micro-batches' backward run under it. The whole stack is therefore one
autograd Function whose backward runs this schedule (like reentrant checkpointing, parameter
gradients accumulate into ``.grad`` directly).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from domino.plan import Plan
from domino.tensor_parallel.comm import CommGroup
from domino.transformer.edge import EdgeContext
from domino.transformer.exits import PartialSums
from domino.transformer.kernels import Kernels
from domino.transformer.layer import Block
from domino.transformer.microbatch import MicroBatch, Prologue
from domino.transformer.param_units import NO_UNITS, ParamUnits
from domino.transformer.policy import SchedulePolicy


class Executor:
    """One run of a stack of blocks under a :class:`Plan`: what its forward and backward
    passes share (the blocks, each op's entry and exit, the local pieces, the policy)."""

    def __init__(self, blocks: list[Block], final_norm: torch.nn.Module | None,
                 edges: EdgeContext, plan: Plan, recompute: bool = False,
                 kernels: Kernels | None = None, units: ParamUnits = NO_UNITS) -> None:
        """``edges``: the run's parallel dimensions, which every op's entry and exit are asked
        for (``edge.py``); the schedule's collectives run over its TP group. Under sequence
        parallelism (``edges.sequence_parallel``) the local pieces run on this rank's sequence
        shard [s / tp, b, h]; each TP region is entered by an all-gather of its input and left
        by a reduce-scatter of its partial sums (the backward mirrors both), and the gradients
        of the replicated parameters the shards touch (norms, the row-parallel biases, the
        prologue's position tables) are summed over the TP group.

        ``recompute``: full activation recomputation - training forwards keep only each
        piece's inputs (the leaves between pieces) and dropout stream states, and the backward
        reruns every piece's forward just before its backward (the all-reduced sums are kept,
        so recomputing communicates nothing).

        ``kernels``: the local pieces' function (eager, or compiled; see ``kernels.py``).
        ``units``: who the passes tell which blocks they use (``param_units.py``: a fully
        sharded run gathers and frees its parameters there)."""
        self.blocks, self.final_norm, self.group, self.plan = blocks, final_norm, edges.tp, plan
        self.units = units
        self.kernels = kernels if kernels is not None else Kernels()
        self.recompute = recompute and bool(blocks)
        self.sp = edges.sequence_parallel
        # Each op's collectives for this run; a prologue's result is a sum of partial sums.
        self.entries = [b.op.entry(edges) for b in blocks]
        self.exits = [b.op.exit(edges) for b in blocks]
        self.prologue_exit = PartialSums(edges.tp, edges.sequence_parallel)
        self.policy = SchedulePolicy(plan, [b.layer for b in blocks], self.sp,
                                     [e.lookahead for e in self.entries],
                                     [x.lookahead for x in self.exits])

    def local_piece(self, j: int, mb: MicroBatch, residual: torch.Tensor | None,
                    reduced: torch.Tensor | None, prologue: Prologue | None):
        """local(j, m): exit(j - 1) (or the prologue's finish) then enter(j) -> (ln, residual),
        or for j = B the final norm -> the stack output. ``reduced``: what the collective
        of the piece before delivered. The element-wise work is one kernel
        (``kernels.local``); the dropout mask is drawn before it, eagerly."""
        out = bias = keep = exit_norm = None
        scale, multiplier = 1.0, 1.0
        if j == 0 and prologue is not None:
            residual = prologue.finish(reduced, mb, self.seq_shard())
        elif j > 0:
            out, bias = reduced, self.exits[j - 1].bias()
            keep, scale = self.blocks[j - 1].dropout_keep(reduced, self.seq_shard())
            multiplier = self.blocks[j - 1].residual_multiplier
            exit_norm = self.blocks[j - 1].exit_norm()
        local = self.kernels.serving(mb.inference_params is not None).local
        if j == len(self.blocks):
            norm = self.final_norm() if self.final_norm is not None else None
            return local(out, bias, keep, scale, residual, norm, False, multiplier,
                         exit_norm)[0]
        block = self.blocks[j]
        return local(out, bias, keep, scale, residual, block.entry_norm(),
                     block.residual_post_norm, multiplier, exit_norm)

    def core(self, j: int) -> Callable:
        """Block j's op core in this run: the rest of it where the entry ran its start."""
        return self.entries[j].core or self.blocks[j].op.core

    def seq_shard(self) -> tuple[int, int] | None:
        """(rank, size) of this rank's sequence shard under sequence parallelism, else None."""
        return (self.group.rank, self.group.size) if self.sp else None

    def span(self, name: str, m: int | None) -> ComputeSpan:
        """A compute span of piece ``name`` of micro-batch ``m`` (for the group's hook)."""
        return ComputeSpan(self.group, name, m)


class ComputeSpan:
    """A compute span of the group's hook that other work can step out of (``outside``), so
    spans never nest."""

    def __init__(self, group: CommGroup, name: str, m: int | None) -> None:
        self.group, self.name, self.m = group, name, m
        self.cm = None

    def __enter__(self) -> ComputeSpan:
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
