"""The edge context: which parallel dimensions a run's regions are entered and left across.

A block op (:class:`~domino.transformer.layer.BlockOp`) owns the collectives at its region's
edges (``exits.py``); which ones it launches depends on how the run splits its tokens: the
sequence sharded over the TP group (sequence parallelism), the sequences split over the CP group
(context parallelism), the tokens routed over the EP group (an MoE layer). A schedule builds one
:class:`EdgeContext` per run, from the :class:`~domino.parallel_state.ParallelState` and the
run's flags (:meth:`EdgeContext.of`), and gives it to every op's ``entry()`` and ``exit()``. A
new parallel dimension adds its group and flag here (and its own package), not a parameter to
every op.
"""

from __future__ import annotations

from dataclasses import dataclass

from domino.parallel_state import ParallelState
from domino.tensor_parallel.comm import CommGroup


@dataclass(frozen=True)
class EdgeContext:
    """One run's parallel dimensions at the regions' edges: each dimension's group and whether
    the run's tokens are split over it (a flag is only true where its group has more than one
    rank)."""

    tp: CommGroup  # the tensor-parallel group: a TP region's weights are split over it
    cp: CommGroup  # the context-parallel group
    ep: CommGroup  # the expert-parallel group: an MoE layer's experts are split over it
    sequence_parallel: bool = False  # the local pieces hold the sequence's shards over ``tp``
    context_parallel: bool = False  # every sequence is split over ``cp``

    @classmethod
    def of(cls, state: ParallelState, *, sequence_parallel: bool = False,
           kv_cache: bool = False) -> EdgeContext:
        """The context of a run on ``state``'s groups. ``sequence_parallel``: asked for (the
        runtime's); ``kv_cache``: the run feeds a KV cache (incremental decoding on whole,
        unsharded sequences: neither the sequence nor the sequences are split then)."""
        return cls(state.tp, state.cp, state.ep,
                   sequence_parallel=sequence_parallel and state.tp.size > 1 and not kv_cache,
                   context_parallel=state.cp.size > 1 and not kv_cache)
