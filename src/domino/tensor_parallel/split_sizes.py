"""Split sizes of an all-to-all (``CommGroup.all_to_all`` and the shared-memory transport's),
checked on the caller's thread before any rank waits on a malformed call."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch


def all_to_all_splits(output: torch.Tensor, input: torch.Tensor, size: int,
                      output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """An all-to-all's split sizes (rows of dim 0 per rank: None = even) as lists, checked:
    ``size`` non-negative integers summing to each tensor's dim 0, one dtype, equal rows."""
    if (input.dim() == 0 or output.dim() == 0 or output.dtype != input.dtype
            or output.shape[1:] != input.shape[1:]):
        raise ValueError(f"all_to_all: output {tuple(output.shape)} {output.dtype} does not fit "
                         f"input {tuple(input.shape)} {input.dtype} (one dtype, at least one "
                         "dimension, the same shape past dim 0)")
    lists = []
    for what, t, sizes in (("output", output, output_split_sizes),
                           ("input", input, input_split_sizes)):
        rows = t.shape[0]
        if sizes is None:
            if rows % size:
                raise ValueError(f"all_to_all: the {what}'s {rows} rows do not split evenly "
                                 f"over {size} ranks; pass {what}_split_sizes")
            sizes = [rows // size] * size
        try:
            counts = [operator.index(n) for n in sizes]
        except TypeError:  # e.g. floats
            counts = []
        if len(counts) != size or min(counts) < 0 or sum(counts) != rows:
            raise ValueError(f"all_to_all: {what}_split_sizes={sizes} must be {size} "
                             f"non-negative integers (one per rank) summing to the {what}'s "
                             f"dim 0, {rows}")
        lists.append(counts)
    return lists[0], lists[1]
