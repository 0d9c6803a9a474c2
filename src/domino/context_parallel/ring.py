"""Ring attention: K/V blocks travel around the context-parallel group while each rank
attends its local queries to the block in hand (the per-block arithmetic: ``blocks``).

Forward, step t of CP: rank r holds the K/V of rank r - t. It first launches the exchange that
brings the next block (send the block in hand to r + 1, receive from r - 1), then attends to the
block in hand, so the transfer runs under the compute, and merges the partial result into
running softmax statistics (row max ``m``, sum ``z``, unnormalised output) in fp32. Backward
recomputes each block's probabilities from the rows' saved log-sum-exp: dQ accumulates locally;
each block's dK/dV accumulator travels with its K/V (one step behind it) and a last exchange
brings it home to its owner, or, where forward kept the visiting blocks (at CP = 2 by
default), each block's dK/dV goes straight to its owner under the next block's compute. Every
rank launches the same exchanges in the same order whatever the masks; only the compute of a
block is skipped.

A schedule may launch the first exchange itself, ahead of the attention (:func:`launch_first`,
from the Q/K/V GEMM's output), and hand it in with a ``poll``: other pieces' work (the next
micro-batch's Q/K/V GEMM, which launches that micro-batch's first exchange) run after this
rank's own block and before the wait, so a micro-batch's transfer also runs under other
micro-batches' compute (``transformer/ring_entry.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from domino.context_parallel.blocks import (
    BLOCK_ELEMENTS,
    BlockAttention,
    BlockGrads,
    kv_blocks,
    kv_seq,
)
from domino.context_parallel.masks import Masking
from domino.context_parallel.sharding import chunk_ids
from domino.tensor_parallel.comm import DONE, CommGroup
from domino.tensor_parallel.handles import Arriving, InFlight


def _neighbours(group: CommGroup) -> tuple[int, int]:
    """The group ranks this rank sends to (next) and receives from (previous)."""
    return (group.rank + 1) % group.size, (group.rank - 1) % group.size


def arrived_sum(parts: list[InFlight]) -> torch.Tensor | None:
    """What the ring's backward left in flight with ``defer`` (exchanges bringing parts of this
    rank's own dK/dV from the other ranks), waited for in order and summed, in block layout
    [2, b, g, 2, c, d] (None: nothing was deferred): the caller adds :func:`kv_seq` of it to
    the gradients the backward returned (dK, dV [s/cp, b, g, d])."""
    total = None
    for part in parts:
        buf = part.wait()
        total = buf if total is None else total.add_(buf)
    return total


def launch_first(k: torch.Tensor, v: torch.Tensor, group: CommGroup,
                 tags: dict | None = None) -> tuple[torch.Tensor, Arriving]:
    """Launch the ring's first exchange of this rank's K/V (k, v [s/cp, b, g, d], as the
    attention will be given them) now -> (the block sent, the previous rank's arriving); hand
    it to :func:`ring_attention` as ``first``. Every rank of ``group`` must launch it at the
    same place of its schedule."""
    block = kv_blocks(k.detach(), v.detach())
    return block, _hop(group, block, 0, tags or {})


def _hop(group: CommGroup, block: torch.Tensor, step: int, tags: dict) -> Arriving:
    """Send ``block`` to the next rank; the previous rank's arriving (step ``step``)."""
    nxt, prev = _neighbours(group)
    incoming = torch.empty_like(block)
    handle = group.exchange([(nxt, block)], [(prev, incoming)], "cp fwd kv",
                            {"step": step, **tags})
    return Arriving([handle], lambda: incoming)


# ---- the Function ---------------------------------------------------------------------------

class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup,
                masking: Masking, scale: float, overlap: bool, limit: int,
                keep: bool, fused: bool, first: tuple[torch.Tensor, Arriving] | None,
                poll: Callable[[], None] | None, tags: dict,
                defer: list[InFlight] | None) -> torch.Tensor:
        attention = BlockAttention(q, k.shape[2], chunk_ids(group.rank, group.size), masking,
                                   scale, limit, fused)
        block = kv_blocks(k, v) if first is None else first[0]
        visitors = []  # with ``keep``: the other ranks' blocks, for backward
        for step in range(group.size):
            src = (group.rank - step) % group.size
            hop = None
            if step == 0 and first is not None:  # launched ahead by the caller
                hop = first[1]
            elif step + 1 < group.size:  # launched before this block's compute: it overlaps
                hop = _hop(group, block, step, tags)
            if hop is not None and not overlap:  # the un-overlapped baseline: waited first
                hop.wait()
            attention.add(block, chunk_ids(src, group.size))
            if step == 0 and poll is not None:  # other pieces' work before the first wait
                poll()
            if hop is not None:
                block = hop.wait()
                if keep:
                    visitors.append(block)
        out, lse = attention.finish()
        # q, k, v, the output, the rows' log-sum-exp (and the visiting blocks)
        ctx.save_for_backward(q, k, v, out, lse, *visitors)
        ctx.group, ctx.masking, ctx.scale, ctx.overlap = group, masking, scale, overlap
        ctx.limit, ctx.fused, ctx.tags, ctx.defer = limit, fused, tags, defer
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, *visitors = ctx.saved_tensors
        group = ctx.group
        back = BlockGrads(q, grad, out, lse, k.shape[2], chunk_ids(group.rank, group.size),
                          ctx.masking, ctx.scale, ctx.limit, ctx.fused)

        def pairs(kv_block: torch.Tensor, src: int) -> torch.Tensor:
            return back.add(kv_block, chunk_ids(src, group.size))

        if visitors:
            carried = _backward_kept(group, [kv_blocks(k, v), *visitors], pairs, ctx.overlap,
                                     ctx.tags, ctx.defer)
        else:
            carried = _backward_ring(group, kv_blocks(k, v), pairs, ctx.overlap, ctx.tags,
                                     ctx.defer)
        return (back.dq_seq(), kv_seq(carried[0]).to(k.dtype), kv_seq(carried[1]).to(v.dtype),
                *[None] * 11)


def _backward_ring(group: CommGroup, block: torch.Tensor, pairs, overlap: bool,
                   tags: dict, defer: list[InFlight] | None) -> torch.Tensor:
    """K/V blocks around the ring again, each block's dK/dV accumulator one step behind it and
    sent home at the end; returns this rank's block's dK/dV (summed over every rank)."""
    nxt, prev = _neighbours(group)
    carried = None  # dK/dV of the block in hand, summed over the ranks it has visited
    for step in range(group.size):
        src = (group.rank - step) % group.size
        sends, recvs, incoming, arriving = [], [], None, None
        if step + 1 < group.size:
            incoming = torch.empty_like(block)
            sends.append((nxt, block))
            recvs.append((prev, incoming))
        if step > 0:  # the previous block's dK/dV goes on, this block's arrives
            arriving = torch.empty_like(carried)
            sends.append((nxt, carried))
            recvs.append((prev, arriving))
        pending = (group.exchange(sends, recvs, "cp bwd kv", {"step": step, **tags})
                   if sends else DONE)
        if not overlap:
            pending.wait()
        grads = pairs(block, src)
        pending.wait()
        carried = grads if arriving is None else grads.add_(arriving)
        if incoming is not None:
            block = incoming
    if group.size > 1:  # the last holder sends each accumulator home
        home = torch.empty_like(carried)
        handle = group.exchange([(nxt, carried)], [(prev, home)], "cp bwd dkv home", tags)
        if defer is not None:  # all of this rank's dK/dV arrives later
            defer.append(Arriving([handle], lambda: home))
            return torch.zeros_like(carried)
        handle.wait()
        carried = home
    return carried


def _backward_kept(group: CommGroup, blocks: list[torch.Tensor], pairs,
                   overlap: bool, tags: dict, defer: list[InFlight] | None) -> torch.Tensor:
    """With every block kept from forward (``blocks[t]`` came from rank - t): the other
    ranks' blocks first, each one's dK/dV sent straight to its owner while the next is
    computed, this rank's own block last; returns its dK/dV (summed over every rank)."""
    rank, size = group.rank, group.size
    arriving = []
    for t in range(size - 1, 0, -1):
        grads = pairs(blocks[t], (rank - t) % size)
        incoming = torch.empty_like(grads)  # from the rank that holds this rank's block as t
        handle = group.exchange([((rank - t) % size, grads)], [((rank + t) % size, incoming)],
                                "cp bwd dkv", {"step": t, **tags})
        if not overlap:
            handle.wait()
        arriving.append((handle, incoming))
    own = pairs(blocks[0], rank)
    if defer is not None:  # the other ranks' parts arrive later
        defer.extend(Arriving([handle], lambda buf=buf: buf) for handle, buf in arriving)
        return own
    for handle, incoming in arriving:
        handle.wait()
        own.add_(incoming)
    return own


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: CommGroup,
                   masking: Masking, scale: float, overlap: bool = True,
                   block_elements: int = BLOCK_ELEMENTS,
                   keep_blocks: bool | None = None, fused: bool | None = None,
                   first: tuple[torch.Tensor, Arriving] | None = None,
                   poll: Callable[[], None] | None = None, tags: dict | None = None,
                   defer: list[InFlight] | None = None) -> torch.Tensor:
    """Ring attention of this rank's queries q [s/cp, b, n, d] over the whole sequence, whose
    K/V [s/cp, b, g, d] are sharded over ``group`` (load-balanced, see ``sharding``) ->
    [s/cp, b, n*d]. ``masking`` holds the whole sequence's padding and document ids.
    ``overlap`` False waits for each exchange before computing (the baseline the benchmark
    compares against); a disabled group computes the same without exchanging. A pair of chunks
    is computed in pieces of at most ``block_elements`` scores, so a long sequence's
    transients stay bounded (one chunk's scores would grow as (S / 2CP)^2).

    ``keep_blocks`` (default: at CP = 2, where it costs one block, as much as the rank's own
    K/V) keeps the visiting K/V blocks from forward, so backward sends only the dK/dV, each
    straight to its owner under the next block's compute (half the bytes at CP = 2, none of
    them exposed behind the last block); otherwise backward passes the K/V around the ring
    again with the dK/dV one step behind and a last transfer home (memory: one block).

    ``fused`` (default: on a CPU, the only device its kernel is for) runs every pair through
    PyTorch's fused attention kernel; False takes the explicit path everywhere.

    ``first``: the first exchange, already launched by :func:`launch_first` from these k, v.
    ``poll`` runs once, after this rank's own block and before the first exchange is waited
    for (it runs in the grad mode of the call). ``tags`` label the exchanges for a hook.
    ``defer``: a list the backward appends the exchanges bringing this rank's dK/dV to, instead
    of waiting for them (:func:`arrived_sum`), so they run under the caller's later work."""
    if first is not None:
        s, b, g, d = k.shape
        if first[0].shape != (2, b, g, 2, s // 2, d):
            raise ValueError(f"the first exchange carries a block of shape "
                             f"{tuple(first[0].shape)}, not this k/v's "
                             f"{(2, b, g, 2, s // 2, d)}")
    keep = group.size == 2 if keep_blocks is None else keep_blocks
    if fused is None:
        fused = q.device.type == "cpu"
    elif fused and q.device.type != "cpu":
        raise ValueError(f"fused ring attention runs PyTorch's CPU kernel; q is on "
                         f"{q.device.type}: use fused=None or False")
    if poll is not None:  # (a Function's forward runs without grad: give poll the caller's)
        poll = _in_grad_mode(poll, torch.is_grad_enabled())
    return _RingAttention.apply(q, k, v, group, masking, scale, overlap, block_elements, keep,
                                fused, first, poll, dict(tags or {}), defer)


def _in_grad_mode(fn: Callable[[], None], enabled: bool) -> Callable[[], None]:
    def run() -> None:
        with torch.set_grad_enabled(enabled):
            fn()
    return run
