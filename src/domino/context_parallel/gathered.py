"""The two gathering variants of context-parallel attention: all-gather K/V (a simple
baseline) and all-to-all over heads (Ulysses). Neither overlaps its communication.

* all-gather: every rank gathers the whole sequence's K and V (in shard order) and attends its
  own queries to every rank's block as the ring does (pairs of chunks: those the masks hide
  are skipped, the rest through the same kernels, merged by log-sum-exp); backward
  reduce-scatters dK/dV to their owners.
* all-to-all: one all-to-all turns sequence-sharded q/k/v into head-sharded, full-sequence
  q/k/v (each rank gets whole heads; needs heads and KV groups divisible by CP); the sequence is
  put in true order, attended as one dense block, put back in shard order and sent back by a
  second all-to-all.
"""

from __future__ import annotations

import torch

from domino.context_parallel.blocks import (
    BLOCK_ELEMENTS,
    BlockAttention,
    BlockGrads,
    kv_blocks,
    kv_seq,
)
from domino.context_parallel.masks import Masking, dense_attention
from domino.context_parallel.sharding import chunk_ids, shard_order
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.mappings import all_to_all_rows


class _GatherShards(torch.autograd.Function):
    """x (this rank's shard) -> [cp, *x.shape], every rank's; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((group.size, *x.shape))
        group.all_gather_into(out.view(-1), x.view(-1), name="cp all-gather kv")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape[1:])
        ctx.group.reduce_scatter(out.view(-1), grad.contiguous().view(-1),
                                 name="cp reduce-scatter dkv")
        return out, None


class _AttendGathered(torch.autograd.Function):
    """This rank's queries q [s, b, n, d] against every rank's K/V block kv [cp, 2, s, b, g, d]
    (rank order), pair by pair as the ring attends them, without exchanging anything."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, kv: torch.Tensor, rank: int, masking: Masking,
                scale: float, fused: bool) -> torch.Tensor:
        cp = kv.shape[0]
        attention = BlockAttention(q, kv.shape[4], chunk_ids(rank, cp), masking, scale,
                                   BLOCK_ELEMENTS, fused)
        for src in range(cp):
            attention.add(kv_blocks(kv[src, 0], kv[src, 1]), chunk_ids(src, cp))
        out, lse = attention.finish()
        ctx.save_for_backward(q, kv, out, lse)
        ctx.rank, ctx.masking, ctx.scale, ctx.fused = rank, masking, scale, fused
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, kv, out, lse = ctx.saved_tensors
        cp, g = kv.shape[0], kv.shape[4]
        back = BlockGrads(q, grad, out, lse, g, chunk_ids(ctx.rank, cp), ctx.masking,
                          ctx.scale, BLOCK_ELEMENTS, ctx.fused)
        dkv = torch.empty_like(kv)
        for src in range(cp):
            block = kv_blocks(kv[src, 0], kv[src, 1])
            grads = back.add(block, chunk_ids(src, cp))
            dkv[src, 0], dkv[src, 1] = kv_seq(grads[0]), kv_seq(grads[1])
        return back.dq_seq(), dkv, None, None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        group: CommGroup, masking: Masking, scale: float) -> torch.Tensor:
    """Attention of this rank's queries q [s/cp, b, n, d] to every rank's K/V [s/cp, b, g, d],
    all-gathered over ``group`` -> [s/cp, b, n*d]. Pair by pair (as the ring, on a CPU through
    the fused kernel): the pairs the masks hide are skipped."""
    kv = _GatherShards.apply(torch.stack([k, v]), group)  # [cp, 2, s, b, g, d]
    return _AttendGathered.apply(q, kv, group.rank, masking, scale, q.device.type == "cpu")


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       group: CommGroup, masking: Masking, scale: float) -> torch.Tensor:
    """Attention by head: all-to-all over ``group`` gives each rank n/cp query heads (and
    g/cp K/V heads) of the whole sequence, attended in true order -> [s/cp, b, n*d]."""
    cp = group.size
    s, b, n, d = q.shape
    g, seq = k.shape[2], s * cp
    order = shard_order(seq, cp, q.device)  # true position of each gathered token
    inverse = torch.argsort(order)
    # One exchange for q, k and v: rank i's heads of each, side by side.
    x = torch.cat([t.reshape(s, b, cp, t.shape[2] // cp, d) for t in (q, k, v)], dim=3)
    even = [1] * cp  # slice i to rank i, slice i of the result from rank i
    x = all_to_all_rows(x.permute(2, 0, 1, 3, 4), group, even, even,
                        name="cp all-to-all")  # [cp (source rank), s, b, h, d]
    x = x.reshape(seq, b, -1, d).index_select(0, inverse)  # the whole sequence, true order
    qh, kh, vh = x.split([n // cp, g // cp, g // cp], dim=2)
    pos = torch.arange(seq, device=q.device)
    mask = None if masking.only_causal else masking.mask(pos, pos)
    out = dense_attention(qh, kh, vh, mask, is_causal=masking.only_causal, scale=scale,
                          q_per_group=n // g)  # [seq, b, n/cp * d]
    out = out.index_select(0, order).reshape(cp, s, b, n // cp, d)  # shard order, by owner
    out = all_to_all_rows(out, group, even, even,
                          name="cp all-to-all")  # [cp (head group), s, b, n/cp, d]
    return out.permute(1, 2, 0, 3, 4).reshape(s, b, n * d)
