"""Where a micro-batch's tokens are when several ranks route parts of its sequences.

Context parallelism splits every sequence over the CP group (rank r holds chunks r and
2CP-1-r of 2 x CP, :mod:`domino.context_parallel.sharding`); sequence parallelism splits each
CP rank's share again over the TP group, contiguously. The router's statistics of a piece are
then summed over both, and a capacity is decided on the whole sequences' routing in true token
order, so that the same tokens are kept as on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from domino.context_parallel.sharding import gather_sequence, shard_sequence
from domino.tensor_parallel.comm import CommGroup


@dataclass(frozen=True)
class TokenShards:
    """``tp``: the sequence-parallel group (None: each rank holds its CP share whole); ``cp``:
    the context-parallel group (None: whole sequences)."""

    tp: CommGroup | None = None
    cp: CommGroup | None = None

    @classmethod
    def of(cls, tp: CommGroup | None, cp: CommGroup | None) -> TokenShards | None:
        """The shards over the groups of more than one rank; None when nothing is split."""
        tp = tp if tp is not None and tp.size > 1 else None
        cp = cp if cp is not None and cp.size > 1 else None
        return None if tp is None and cp is None else cls(tp, cp)

    @property
    def size(self) -> int:
        """Ranks each sequence is spread over."""
        return (self.tp.size if self.tp else 1) * (self.cp.size if self.cp else 1)

    def all_reduce(self, flat: torch.Tensor, name: str) -> None:
        """Sum ``flat`` over every rank holding a part of the sequences (in place)."""
        for group in (self.tp, self.cp):
            if group is not None:
                group.all_reduce(flat, name=name)

    def gather(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's part [s_local, ...] -> the whole sequences [s, ...] in true order."""
        if self.tp is not None:
            every = x.new_empty(x.shape[0] * self.tp.size, *x.shape[1:])
            self.tp.all_gather_into(every, x.contiguous(), name=name)
            x = every
        return gather_sequence(x, self.cp, dim=0, name=name)

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        """Whole sequences [s, ...] -> this rank's part [s_local, ...] (:meth:`gather`'s
        inverse)."""
        if self.cp is not None:
            whole = shard_sequence(whole, self.cp.rank, self.cp.size, dim=0)
        if self.tp is not None:
            whole = whole.chunk(self.tp.size, dim=0)[self.tp.rank]
        return whole
