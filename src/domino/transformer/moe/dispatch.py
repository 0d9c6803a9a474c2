"""Expert parallelism's token exchange: the rows a rank sorted by expert
(:func:`~.experts.permute`) go to the ranks holding those experts, and the experts' outputs come
back the same way.

Experts are split over the EP group in order (rank r holds experts ``[r E/EP, (r+1) E/EP)``), so
rows sorted by global expert are already grouped by destination rank. :func:`dispatch` first
exchanges each rank's per-expert row counts (a small all-to-all of E integers), then the rows
themselves with those uneven splits; a rank receives, from each source in rank order, the rows
for its own experts sorted by expert, and re-sorts them by local expert for the grouped GEMM.
:func:`combine` undoes the re-sort and sends the outputs back. Both all-to-alls are
differentiable (their backward is the reverse exchange), and every rank launches the same
collectives in the same order whatever the routing: the splits change, the calls do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.mappings import all_to_all_rows


@dataclass
class Dispatched:
    """What a rank's experts receive: ``x`` [N, h] sorted by local expert and ``counts`` [E/EP]
    rows per local expert; the rest is how :func:`combine` returns the outputs."""

    x: torch.Tensor
    counts: torch.Tensor
    order: torch.Tensor  # x = received rows [order] (combine puts the outputs back)
    sent: list[int]  # rows this rank sent to each rank
    received: list[int]  # rows it received from each rank


def dispatch(x: torch.Tensor, counts: torch.Tensor, group: CommGroup) -> Dispatched:
    """x [N, h] sorted by global expert with ``counts`` [E] rows per expert -> the rows of the
    experts this rank holds, from every rank of ``group``."""
    local = counts.numel() // group.size
    received_counts = torch.empty_like(counts)
    group.all_to_all(received_counts, counts, name="moe dispatch counts")
    received_counts = received_counts.view(group.size, local)  # [source, local expert]
    sent = counts.view(group.size, local).sum(1).tolist()
    received = received_counts.sum(1).tolist()
    rows = all_to_all_rows(x, group, received, sent, name="moe dispatch")
    # Rows arrive per source, each sorted by local expert: sort them by local expert (stable).
    expert_of = torch.arange(local, device=x.device).repeat(group.size).repeat_interleave(
        received_counts.reshape(-1))
    order = torch.argsort(expert_of, stable=True)
    return Dispatched(rows[order], received_counts.sum(0), order, sent, received)


def combine(y: torch.Tensor, d: Dispatched, group: CommGroup) -> torch.Tensor:
    """The experts' outputs y [N, h] (in :func:`dispatch`'s order) back to the ranks and rows
    they came from."""
    back = torch.empty_like(y).index_copy(0, d.order, y)  # per source again
    return all_to_all_rows(back, group, d.sent, d.received, name="moe combine")
