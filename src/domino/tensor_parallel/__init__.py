"""Megatron-style tensor parallelism: collectives, autograd mappings, layers, parameter
placements, loss, RNG."""

from domino.tensor_parallel.comm import CommGroup, CommHook, Handle
from domino.tensor_parallel.cross_entropy import mask_padded_logits, vocab_parallel_cross_entropy
from domino.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full,
    init_sharded,
    shard_of_full,
)
from domino.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from domino.tensor_parallel.placement import Placement, place, placement_of
from domino.tensor_parallel.random import RNGTracker, dropout

__all__ = [
    "CommGroup", "CommHook", "Handle", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "init_sharded", "shard_of_full", "gather_full", "Placement",
    "place", "placement_of", "vocab_parallel_cross_entropy", "mask_padded_logits",
    "copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
    "RNGTracker", "dropout",
]
