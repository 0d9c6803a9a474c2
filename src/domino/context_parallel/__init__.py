"""Context parallelism: every sequence sharded over a CP group, attention computed across it.

* :mod:`~domino.context_parallel.sharding`: the load-balanced layout (rank r holds chunks r and
  2*CP-1-r of 2*CP), true positions, sharding and reassembling sequences;
* :func:`context_attention`: attention of a rank's shard against the whole sequence, like
  ``kernels.attention`` on the unsharded sequence (causal, sliding window, key padding,
  document masks, GQA), by one of :data:`KINDS`: ``ring`` (K/V blocks around a ring, transfer
  overlapped with compute, online-softmax merge; :mod:`~domino.context_parallel.ring`),
  ``allgather`` (gather K/V) or ``alltoall`` (Ulysses, by heads;
  :mod:`~domino.context_parallel.gathered`);
* :class:`SequenceMask`: a model's attention mask per token (documents, key padding), what a
  context-parallel model takes as its ``attention_mask``;
* :func:`check_context_parallel`: the configuration rules, as ValueErrors naming the
  settings to change (their config fields; ``domino train`` shows them as its flags).

The group is always passed in (a :class:`~domino.tensor_parallel.CommGroup`, so its transfers are
counted, traced and disabled like every other collective's); nothing here holds state.
"""

from domino.context_parallel.attention import (
    KINDS,
    check_context_parallel,
    check_dropout,
    check_heads,
    check_sinks,
    check_softcap,
    context_attention,
)
from domino.context_parallel.gathered import allgather_attention, alltoall_attention
from domino.context_parallel.masks import Masking, SequenceMask, dense_attention
from domino.context_parallel.ring import ring_attention
from domino.context_parallel.sharding import (
    check_sequence_length,
    chunk_ids,
    gather_sequence,
    local_positions,
    shard_order,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "KINDS", "Masking", "SequenceMask", "allgather_attention", "alltoall_attention",
    "check_context_parallel", "check_dropout", "check_heads", "check_sequence_length",
    "check_sinks", "check_softcap",
    "chunk_ids", "context_attention", "dense_attention", "gather_sequence", "local_positions",
    "ring_attention", "shard_order", "shard_sequence", "unshard_sequence",
]
