"""Self attention's entry under ring context parallelism: the ring's first K/V exchange
launched where the schedule enters the region, so that it travels under other micro-batches'
compute and not only under this micro-batch's own attention.

The entry (:meth:`RingEntry.launch`, at the end of the local piece, after the norm) runs the
column-parallel Q/K/V GEMM, derives K and V as the attention will (RoPE, Q/K norms; without a
graph), and launches the first exchange of this rank's K/V block (``ring.launch_first``). The
region's input is then the GEMM's output, and the rest of the core (:meth:`RingEntry.core`:
the split and the ring) takes the exchange in flight. ``lookahead``: the schedule runs the
local piece that launches it inside the piece before, and the ring's ``poll`` runs the next
micro-batch's local piece after this rank's own block, before the first wait. Forward, with
micro-batches m and m + 1:

    ... MLP(m') | norm(m), QKV(m), send K/V(m) | own block(m) | norm(m+1), QKV(m+1),
    send K/V(m+1) | wait(m), other blocks(m), dense(m) | own block(m+1) | ...

so micro-batch m's transfer runs under the next micro-batch's Q/K/V GEMM as well as its own
block, and micro-batch m + 1's under the rest of micro-batch m's attention and its dense GEMM.
The places are fixed (every CP rank launches in one order), as are the TP collectives'.

Backward: the region's input gradient flows through the GEMM's graph kept from forward
(:meth:`RingEntry.launch_grad`), then is summed over TP like a column-parallel entry's; the
GEMM's weight gradient is deferred to the par piece's stash (the schedule runs it under a
collective, as before). Not under sequence parallelism: there the entry is the all-gather of
the sequence shards, which the GEMM would have to wait for at once.
"""

from __future__ import annotations

import torch

from domino.context_parallel.ring import FirstHop, launch_first
from domino.tensor_parallel.layers import WgradStash
from domino.transformer.exits import InFlight, Ready, sum_parts
from domino.transformer.microbatch import MicroBatch


class RingEntry:
    """The entry of a :class:`~.attention.SelfAttention` ``attn`` in one run (see the module
    docstring); its per-micro-batch state lives here, with the schedule that owns the run."""

    lookahead = True  # launching is work (the GEMM, the exchange): run it in the piece before

    def __init__(self, attn) -> None:
        self.attn = attn
        self.hops: dict[int, FirstHop] = {}  # first exchanges in flight, by micro-batch
        self.stashes: dict[int, WgradStash] = {}  # the GEMM's deferred weight gradient
        self.graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (input, output)

    def launch(self, x: torch.Tensor, j: int, m: int, mb: MicroBatch | None = None
               ) -> InFlight:
        if mb is None:
            raise ValueError("the ring entry needs the micro-batch (its RoPE angles)")
        # A graph exactly when the schedule records one (its leaf ``x`` requires grad), also
        # where this runs inside a piece recomputation runs without one.
        graph = x.requires_grad
        stash = WgradStash() if graph else None
        with torch.set_grad_enabled(graph):
            qkv = self.attn.project(x, stash)
        with torch.no_grad():
            _, k, v = self.attn.split(qkv, mb)
        self.hops[m] = launch_first(k, v, self.attn.cp, {"mb": m, "block": j})
        if graph:
            self.stashes[m], self.graphs[m] = stash, (x, qkv)
            qkv = qkv.detach()
        return Ready(qkv)

    def core(self, qkv: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll=None) -> torch.Tensor:
        """The op's core from the GEMM's output ``qkv`` on (the split, the ring). The first
        exchange launched for this micro-batch is taken if there is one (a recomputation in
        backward finds none and runs the whole ring); ``stash`` gets the GEMM's deferred
        weight gradient, to run with the piece's own."""
        if stash is not None and mb.index in self.stashes:
            stash.append(self.stashes.pop(mb.index).run)
        q, k, v = self.attn.split(qkv, mb)
        return self.attn.context_attend(q, k, v, mb, first=self.hops.pop(mb.index, None),
                                        poll=poll)

    def launch_grad(self, grad: torch.Tensor, j: int, m: int) -> InFlight:
        """The gradient of the GEMM's input (through the graph kept from forward), summed
        over TP."""
        x, qkv = self.graphs.pop(m)
        torch.autograd.backward([qkv], [grad])
        return sum_parts(self.attn.dense.group, False, [x.grad], "bwd", j, m)
