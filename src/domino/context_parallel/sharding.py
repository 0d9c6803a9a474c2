"""Load-balanced sequence sharding for context parallelism.

A sequence of length S is cut into 2 x CP equal chunks; CP rank r holds chunk r (its head)
and chunk 2*CP-1-r (its tail), in that order. Under a causal mask the work of a query chunk
grows with its position, so pairing an early chunk with a late one gives every rank the same
number of unmasked (query, key) pairs. Everything here is a pure function of its arguments
except :func:`gather_sequence`, which all-gathers over the group it is given.
"""

from __future__ import annotations

import torch

from domino.tensor_parallel.comm import CommGroup


def check_sequence_length(seq_length: int, cp: int) -> None:
    """Raise ValueError unless ``seq_length`` splits into 2 x ``cp`` equal chunks."""
    if cp < 1:
        raise ValueError(f"context_parallel_size={cp} must be a positive integer.")
    parts = 2 * cp
    if seq_length < parts or seq_length % parts:
        up = max(parts, -(-seq_length // parts) * parts)
        raise ValueError(
            f"seq_length={seq_length} is not divisible by 2 x context_parallel_size = "
            f"{parts}: context parallelism cuts every sequence into 2 x CP equal chunks (rank r "
            f"holds chunks r and {parts - 1}-r, so that every rank does the same causal work). "
            f"Use a seq_length that is a multiple of {parts} (e.g. {up}) or another "
            f"context_parallel_size.")


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 x ``cp``) that CP rank ``rank`` holds: its head and its tail."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in a context-parallel group of {cp}")
    return rank, 2 * cp - 1 - rank


def local_positions(seq_length: int, rank: int, cp: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The true (global) positions [S / cp] of the tokens rank ``rank`` holds, in its order:
    what RoPE or learned position embeddings must use instead of ``arange``."""
    check_sequence_length(seq_length, cp)
    c = seq_length // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in chunk_ids(rank, cp)])


def shard_order(seq_length: int, cp: int,
                device: torch.device | str | None = None) -> torch.Tensor:
    """[S]: the true position of each token of the ranks' shards laid end to end in rank
    order (what an all-gather of the shards holds)."""
    return torch.cat([local_positions(seq_length, r, cp, device) for r in range(cp)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` along its sequence dimension ``dim`` (0 for [s, b, ...],
    1 for [b, s]): chunks r and 2*cp-1-r, concatenated."""
    check_sequence_length(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor] | tuple[torch.Tensor, ...],
                     dim: int = 0) -> torch.Tensor:
    """The full sequence, in true order, from every rank's shard (rank order) along ``dim``."""
    cp = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        if shard.shape[dim] % 2:
            raise ValueError(f"rank {rank}'s shard has an odd length {shard.shape[dim]} along "
                             f"dim {dim}: it is not a head and a tail chunk")
        head, tail = shard.chunk(2, dim=dim)
        first, second = chunk_ids(rank, cp)
        chunks[first], chunks[second] = head, tail
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def gather_sequence(x: torch.Tensor, group: CommGroup | None, dim: int = 0,
                    name: str = "cp all-gather mask") -> torch.Tensor:
    """Every rank's shard of ``x`` (sharded along ``dim``) all-gathered over ``group`` and put
    in true order, on every rank. No gradient flows through it (masks, ids, test checks).
    Bool tensors travel as uint8 (not every backend reduces or gathers bool)."""
    cp = 1 if group is None else group.size
    if cp == 1:
        return x
    wire = x.to(torch.uint8) if x.dtype == torch.bool else x
    wire = wire.movedim(dim, 0).contiguous()
    out = wire.new_empty((cp, *wire.shape))
    group.all_gather_into(out.view(-1), wire.view(-1), name=name)
    full = unshard_sequence(list(out.unbind(0)), dim=0).movedim(0, dim)
    return full.to(torch.bool) if x.dtype == torch.bool else full
