"""What one micro-batch's pieces read besides their input tensor, and how a batch is split.

A schedule hands every piece a read-only :class:`MicroBatch` (with the step's
:class:`~domino.transformer.context.BackwardContext` when training); a :class:`Prologue` is the
work before a stack's first block whose result needs a TP reduction (the embedding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from domino.plan import Plan
from domino.transformer.context import BackwardContext
from domino.utils import even_splits


@dataclass
class InferenceParams:
    """KV cache for incremental decoding (Megatron's name and fields)."""

    max_batch_size: int
    max_sequence_length: int
    sequence_len_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """What the pieces of one micro-batch read besides their input tensor (read-only: the
    executor hands pieces a new one rather than writing into it)."""

    index: int = 0
    batch_start: int = 0  # first sample of this micro-batch in the full batch
    batch_size: int = 0  # samples in this micro-batch
    self_mask: torch.Tensor | None = None  # bool, True = masked, broadcastable [b, 1, sq, sk]
    causal: bool = False
    cross_mask: torch.Tensor | None = None
    rotary: torch.Tensor | None = None  # [s, b, 1, rot_dim]
    memory: torch.Tensor | None = None  # encoder output [s_enc, b, h] for cross attention
    inference_params: InferenceParams | None = None
    # The step's context when the forward records a graph: per-step values its backward reads
    # (the auxiliary losses' scale of an MoE layer).
    context: BackwardContext | None = None


def split_batch(batch: int, micro_batches: int) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch along the batch dim; sizes differ by at most one."""
    Plan(micro_batches).check_fits(batch)
    return even_splits(batch, micro_batches)


class Prologue(Protocol):
    """Work before the stack's first block whose result needs the TP all-reduce (the embedding:
    each rank looks up its vocabulary shard). The schedule sums each micro-batch's partial
    sums over the TP group asynchronously and hands the sum to :meth:`finish`."""

    shape: tuple[int, int]  # (s, b) of the stack input it produces

    def partial(self, mb: MicroBatch, seq_shard: tuple[int, int] | None = None) -> torch.Tensor:
        """This rank's partial sums for micro-batch ``mb`` (any layout :meth:`finish` reads;
        with ``seq_shard`` = (rank, size), sequence parallelism, [s, b_m, ...]: the schedule
        reduce-scatters them along the sequence)."""

    def finish(self, reduced: torch.Tensor, mb: MicroBatch,
               seq_shard: tuple[int, int] | None = None) -> torch.Tensor:
        """The stack input [s, b_m, h] of ``mb`` from the all-reduced partial sums (with
        ``seq_shard``: rank's shard [s/size, b_m, h] from its reduce-scattered shard)."""

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients its backward produces."""
