"""Self attention's entry under ring context parallelism: the ring's transfers scheduled under
other micro-batches' compute, not only under the micro-batch's own attention.

Forward. The entry (:meth:`RingEntry.launch`, at the end of the local piece, after the norm)
runs the column-parallel Q/K/V GEMM and the split (Q/K norms, RoPE), and launches the first
exchange of this rank's K/V block (``ring.launch_first``); the region's input is q, k, v packed
into one tensor, and the rest of the core (:meth:`RingEntry.core`) is the ring, which takes the
exchange in flight. ``lookahead``: the schedule runs the local piece that launches it inside
the piece before, and the ring's ``poll`` runs the next micro-batch's local piece after this
rank's own block, before the first wait. With micro-batches m and m + 1:

    ... MLP(m') | norm(m), QKV(m), send K/V(m) | own block(m) | norm(m+1), QKV(m+1),
    send K/V(m+1) | wait(m), other blocks(m), dense(m) | own block(m+1) | ...

so micro-batch m's transfer runs under the next micro-batch's Q/K/V GEMM as well as its own
block, and micro-batch m + 1's under the rest of micro-batch m's attention and its dense GEMM.

Backward. The ring's backward returns without waiting for the other ranks' parts of this rank's
dK/dV (``ring.arrived_sum``); they are added where the schedule takes the entry's input gradient:
at one TP rank in the local^T piece (:meth:`RingEntry.launch_grad` returns them unwaited), so
the transfer runs under the backward of the other micro-batches (the next one's attention, or
the layer below's MLP); at TP > 1 in the par^T piece, because the input gradient's all-reduce
over TP must be launched there, at its place in the schedule, as a column-parallel entry's is.
Then the gradient flows through the split and the GEMM (the graph kept from forward). The
GEMM's weight gradient goes to the par piece's stash at TP > 1 (the schedule runs it under a
collective) and is computed in place at one TP rank (the stash may have run by then).

Every CP rank launches in one order: the places are fixed by the schedule. Not under sequence
parallelism: there the entry is the all-gather of the sequence shards, which the GEMM would
have to wait for at once.
"""

from __future__ import annotations

import torch

from domino.context_parallel.blocks import kv_seq
from domino.context_parallel.ring import arrived_sum, launch_first
from domino.tensor_parallel.handles import Arriving, InFlight, arrived
from domino.tensor_parallel.layers import WgradStash
from domino.transformer.exits import sum_parts
from domino.transformer.microbatch import MicroBatch


class RingEntry:
    """The entry of a :class:`~.attention.SelfAttention` ``attn`` in one run (see the module
    docstring); its per-micro-batch state lives here, with the schedule that owns the run."""

    lookahead = True  # launching is work (the GEMM, the exchange): run it in the piece before

    def __init__(self, attn) -> None:
        self.attn = attn
        self.late = attn.dense.group.size == 1  # the input gradient finished in local^T
        # First exchanges in flight, by micro-batch: (the block sent, the one arriving).
        self.hops: dict[int, tuple[torch.Tensor, Arriving]] = {}
        self.stashes: dict[int, WgradStash] = {}  # the GEMM's deferred weight gradient
        self.graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (input, output)
        self.deferred: dict[int, list[InFlight]] = {}  # the backward's dK/dV parts in flight

    def launch(self, x: torch.Tensor, j: int, m: int, mb: MicroBatch | None = None,
               chunks: int = 1) -> InFlight:
        if mb is None:
            raise ValueError("the ring entry needs the micro-batch (its RoPE angles)")
        # A graph exactly when the schedule records one (its leaf ``x`` requires grad), also
        # where this runs inside a piece recomputation runs without one.
        graph = x.requires_grad
        stash = WgradStash() if graph and not self.late else None
        with torch.set_grad_enabled(graph):
            q, k, v = self.attn.split(self.attn.project(x, stash), mb)
            packed = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1)
        self.hops[m] = launch_first(k, v, self.attn.cp, {"mb": m, "block": j})
        if graph:
            if stash is not None:
                self.stashes[m] = stash
            self.graphs[m] = (x, packed)
            packed = packed.detach()
        return arrived(packed)

    def _unpacked(self, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s, b, _ = packed.shape
        n, g, d = self.attn.heads, self.attn.groups, self.attn.head_dim
        q, k, v = packed.split([n * d, g * d, g * d], dim=-1)
        return q.view(s, b, n, d), k.view(s, b, g, d), v.view(s, b, g, d)

    def core(self, packed: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll=None) -> torch.Tensor:
        """The op's core from the packed q, k, v on: the ring. The first exchange launched
        for this micro-batch is taken if there is one (a recomputation in backward finds none
        and runs the whole ring); ``stash`` gets the GEMM's deferred weight gradient, to run
        with the piece's own."""
        m = mb.index
        if stash is not None and m in self.stashes:
            stash.append(self.stashes.pop(m).run)
        defer = None
        if torch.is_grad_enabled() and packed.requires_grad:  # its backward will run
            defer = self.deferred[m] = []
        return self.attn.context_attend(*self._unpacked(packed), mb,
                                        first=self.hops.pop(m, None), poll=poll, defer=defer)

    def launch_grad(self, grad: torch.Tensor, j: int, m: int) -> InFlight:
        """The gradient of the GEMM's input, summed over TP, from the packed q, k, v's
        ``grad`` and the other ranks' dK/dV parts once they arrive (see the module
        docstring for where)."""
        x, packed = self.graphs.pop(m)
        defer = self.deferred.pop(m, None)

        def finish() -> Arriving:
            dkv = None if defer is None else arrived_sum(defer)
            if dkv is not None:
                _, k, v = self._unpacked(grad)
                k.add_(kv_seq(dkv[0]).to(k.dtype))
                v.add_(kv_seq(dkv[1]).to(v.dtype))
            torch.autograd.backward([packed], [grad])
            return sum_parts(self.attn.dense.group, False, [x.grad], "bwd", j, m)

        if not self.late:
            return finish()
        # Finished when first waited for, once the dK/dV parts are in (at one TP rank the
        # all-reduce is the group of one's no-op).
        return Arriving(list(defer) if defer is not None else [],
                        lambda: finish().wait())
