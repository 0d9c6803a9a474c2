"""The collectives at a block's edges, owned by its op: what is sent and what the receiver does.

A schedule (``forward``, ``backward``) only orders steps and launches and waits what they
return: in-flight work (:class:`~domino.tensor_parallel.handles.InFlight`). A block op
(``layer.BlockOp``) says, per run, how its region is entered (:class:`Entry`) and left
(:class:`Exit`), in both directions:

* the TP regions of today (attention, MLP) are entered by a column-parallel GEMM and left by
  a row-parallel one: :class:`ColumnParallelEntry` (forward: nothing, or an all-gather of the
  sequence shards under sequence parallelism; backward: the input gradient's all-reduce, or
  reduce-scatter) and :class:`RowParallelExit` (forward: the partial sums' all-reduce, or
  reduce-scatter, per column chunk; backward: nothing, or an all-gather);
* an op with another exit (an MoE layer's all-to-all combine, ``moe/edges.py``) brings its
  own classes.

An entry or exit whose ``lookahead`` is true does work worth hiding where the schedule launches
it (an MoE layer's router and dispatch; its combine's gradient): the schedule then runs the
local piece that launches it inside the piece before, as it does for every piece under
sequence parallelism (``policy.SchedulePolicy.runs_ahead``).

Every rank launches the same collectives in the same order: what a launch sends may depend on
the data, never whether or when it is launched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from domino.precision import compute
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.handles import Arriving, InFlight, arrived
from domino.tensor_parallel.layers import RowParallelLinear, WgradStash, column_chunks
from domino.transformer.microbatch import MicroBatch


def sum_parts(group: CommGroup, sp: bool, parts: Iterable[torch.Tensor], direction: str,
              j: int, m: int, release: bool = False) -> Arriving:
    """Sum each part over ``group`` as soon as ``parts`` (possibly a generator) yields it: an
    all-reduce in place, or under sequence parallelism (``sp``) a reduce-scatter along the
    sequence (dim 0); on arrival the sums concatenated along the last dim. ``release`` (``sp``
    only): free the parts' data once sent - a reduce-scatter's partial sums stay graph roots of
    the backward, which needs their shapes and autograd nodes but not their data."""
    bufs, handles, sent = [], [], []
    for c, t in enumerate(parts):
        tags = {"mb": m, "block": j, "chunk": c}
        if sp:
            buf, handle = group.reduce_scatter_seq(
                t.detach(), async_op=True, name=f"{direction} rs b{j}", tags=tags)
            if release and t.is_contiguous():  # (reduce_scatter_seq copied it otherwise)
                sent.append(t.detach())
        else:
            buf = t.detach()  # reduced in place: no autograd node saved these outputs
            handle = group.all_reduce(buf, async_op=True, name=f"{direction} b{j}", tags=tags)
        bufs.append(buf)
        handles.append(handle)

    def summed() -> torch.Tensor:
        for t in sent:
            t.untyped_storage().resize_(0)
        return bufs[0] if len(bufs) == 1 else torch.cat(bufs, dim=-1)
    return Arriving(handles, summed)


def gather_seq(group: CommGroup, t: torch.Tensor, direction: str, j: int, m: int) -> Arriving:
    """All-gather the sequence shards ``t`` [s/tp, ...] into the whole sequence."""
    buf, handle = group.all_gather_seq(t.detach(), async_op=True, name=f"{direction} ag b{j}",
                                       tags={"mb": m, "block": j, "chunk": 0})
    return Arriving([handle], lambda: buf)


@dataclass(eq=False)
class GradStep:
    """One step of a region's backward (:meth:`Exit.grad_steps`): once ``grad`` arrives,
    ``cut(grad.wait())`` gives the gradients of ``parts``."""

    grad: InFlight
    parts: list[torch.Tensor]
    cut: Callable[[torch.Tensor], list[torch.Tensor]]


class Entry(Protocol):
    """How a block's op region is entered (block ``j``, micro-batch ``m`` name the
    collectives)."""

    lookahead: bool  # is launching work worth hiding (see the module docstring)?
    # An entry that runs the start of the op's core itself (the ring entry: the Q/K/V GEMM)
    # gives the rest, with the op core's signature; None: the op's core runs whole.
    core: Callable | None

    def launch(self, x: torch.Tensor, j: int, m: int, mb: MicroBatch | None = None,
               chunks: int = 1) -> InFlight:
        """Forward: the region's input from the norm output ``x`` of the replicated stream
        (of micro-batch ``mb``, whose index is ``m``). ``chunks``: the parts the exit will
        split the region's output into (an entry that exchanges the input per part, an MoE
        dispatch per group of experts, splits alike)."""

    def launch_grad(self, grad: torch.Tensor, j: int, m: int) -> InFlight:
        """Backward: the stream's gradient from the gradient of the region's input."""


class Exit(Protocol):
    """How a block's op region is left, and what the receiving side does with the result."""

    lookahead: bool  # is launching its gradient work worth hiding?

    def parts(self, core: torch.Tensor, chunks: int, stash: WgradStash | None,
              m: int) -> Iterator[torch.Tensor]:
        """What the region sends, from the op core's output for micro-batch ``m``, lazily
        (``chunks`` parts where the op can split them) so that each part's collective launches
        before the next part is computed. With ``stash`` the weight-gradient GEMMs are deferred
        to it."""

    def launch(self, parts: Iterable[torch.Tensor], j: int, m: int,
               release: bool = False) -> InFlight:
        """Forward: send each part as it is produced (``release``: the parts' data may be freed
        once sent; their autograd nodes stay)."""

    def bias(self) -> torch.Tensor | None:
        """The replicated bias the receiving local piece adds to what :meth:`launch`
        delivered, fused with its dropout and residual (None: the delivery is the op's
        output as it is)."""

    def launch_grad(self, grad: torch.Tensor, j: int, m: int) -> InFlight:
        """Backward: from the gradient of what was delivered, what the parts' gradients are
        cut from (:meth:`grad_steps`)."""

    def grad_steps(self, grad: InFlight, parts: list[torch.Tensor]) -> list[GradStep]:
        """The parts' backward in steps, from what :meth:`launch_grad` returned: the schedule
        waits each step's result (filling the wait with deferred work) and runs the backward
        of its parts (one step, or one per part where parts arrive apart and share no graph:
        an MoE layer's groups of experts)."""

    def replicated_parameters(self) -> list[torch.Tensor]:
        """Replicated parameters the receiving side applies (:meth:`bias`; under sequence
        parallelism each rank sees only its shard, so their gradients are summed over the
        group)."""


class ColumnParallelEntry:
    """A region entered by column-parallel GEMMs: forward, the input as it is (sequence
    parallel: the shards all-gathered); backward, the input gradient summed over the group
    (all-reduce; sequence parallel: reduce-scattered back to the shards)."""

    lookahead = False
    core = None

    def __init__(self, group: CommGroup, sequence_parallel: bool) -> None:
        self.group, self.sp = group, sequence_parallel

    def launch(self, x: torch.Tensor, j: int, m: int, mb: MicroBatch | None = None,
               chunks: int = 1) -> InFlight:
        return gather_seq(self.group, x, "fwd", j, m) if self.sp else arrived(x)

    def launch_grad(self, grad: torch.Tensor, j: int, m: int) -> InFlight:
        return sum_parts(self.group, self.sp, [grad], "bwd", j, m)


class PartialSums:
    """A region whose result is a sum of per-rank partial results, left by summing them over
    the group (all-reduce; sequence parallel: reduce-scatter along the sequence); backward,
    the gradient as it is (sequence parallel: the shards all-gathered). A prologue's exit."""

    lookahead = False

    def __init__(self, group: CommGroup, sequence_parallel: bool) -> None:
        self.group, self.sp = group, sequence_parallel

    def launch(self, parts: Iterable[torch.Tensor], j: int, m: int,
               release: bool = False) -> InFlight:
        return sum_parts(self.group, self.sp, parts, "fwd", j, m, release)

    def launch_grad(self, grad: torch.Tensor, j: int, m: int) -> InFlight:
        return gather_seq(self.group, grad, "bwd", j, m) if self.sp else arrived(grad)


class RowParallelExit(PartialSums):
    """The exit of a row-parallel GEMM (``dense``): its partial sums, one per column chunk,
    summed over the TP group; the bias is added after the sum (once, not once per rank)."""

    def __init__(self, dense: RowParallelLinear, sequence_parallel: bool) -> None:
        super().__init__(dense.group, sequence_parallel)
        self.dense = dense

    def parts(self, core: torch.Tensor, chunks: int, stash: WgradStash | None,
              m: int = 0) -> Iterator[torch.Tensor]:
        # Row-parallel partial sums [s, b, h_c] of the core's output [s, b, width/tp].
        if chunks == 1:
            yield self.dense.partial(core, wgrad_stash=stash)
            return
        for cols in column_chunks(self.dense.output_size, chunks):
            yield self.dense.partial(core, cols, wgrad_stash=stash)

    def bias(self) -> torch.Tensor | None:
        return compute(self.dense.bias)

    def grad_steps(self, grad: InFlight, parts: list[torch.Tensor]) -> list[GradStep]:
        # One step: the column chunks' backwards share the core's graph.
        def cut(g: torch.Tensor) -> list[torch.Tensor]:
            if len(parts) == 1:
                return [g]
            return list(torch.split(g, [p.shape[-1] for p in parts], dim=-1))
        return [GradStep(grad, parts, cut)]

    def replicated_parameters(self) -> list[torch.Tensor]:
        return [] if self.dense.bias is None else [self.dense.bias]
