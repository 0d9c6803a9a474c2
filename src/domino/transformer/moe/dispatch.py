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

from domino.tensor_parallel.comm import CommGroup, Handle
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


@dataclass
class DispatchLayout:
    """Who sends whom how many rows, from each rank's per-expert counts: ``received_counts``
    [EP, E / EP] rows this rank receives per (source, local expert), ``sent`` / ``received``
    rows per rank, ``order`` the received rows (per source) -> sorted by local expert, stable
    (so by source within an expert)."""

    received_counts: torch.Tensor
    sent: list[int]
    received: list[int]
    order: torch.Tensor


def launch_counts(counts: torch.Tensor, group: CommGroup, name: str = "moe dispatch counts",
                  tags: dict | None = None) -> tuple[torch.Tensor, Handle]:
    """Start exchanging ``counts`` [E] (rows this rank sends per global expert) over ``group``
    (a small all-to-all) -> (what arrives: rows each rank sends here per local expert, the
    handle); :func:`layout` once it is there. It runs even where ``group`` is disabled (the
    benchmark's ``nocomm``): the counts decide how many rows each rank's experts compute, and
    with real routing the ranks' loads differ, which is compute, not communication."""
    received = torch.empty_like(counts)
    with group.shaping():
        return received, group.all_to_all(received, counts, async_op=True, name=name,
                                          tags=tags)


def layout(counts: torch.Tensor, received: torch.Tensor, size: int) -> DispatchLayout:
    """The exchange's :class:`DispatchLayout` from this rank's ``counts`` [E] and the
    ``received`` counts of :func:`launch_counts` (over a group of ``size`` ranks)."""
    local = counts.numel() // size
    received_counts = received.view(size, local)  # [source, local expert]
    expert_of = torch.arange(local, device=counts.device).repeat(size).repeat_interleave(
        received_counts.reshape(-1))
    return DispatchLayout(received_counts, counts.view(size, local).sum(1).tolist(),
                  received_counts.sum(1).tolist(), torch.argsort(expert_of, stable=True))


def exchange_counts(counts: torch.Tensor, group: CommGroup, name: str = "moe dispatch counts",
                    tags: dict | None = None) -> DispatchLayout:
    """Exchange ``counts`` [E] over ``group`` and wait -> the exchange's
    :class:`DispatchLayout`."""
    received, handle = launch_counts(counts, group, name, tags)
    handle.wait()
    return layout(counts, received, group.size)


def dispatch(x: torch.Tensor, counts: torch.Tensor, group: CommGroup) -> Dispatched:
    """x [N, h] sorted by global expert with ``counts`` [E] rows per expert -> the rows of the
    experts this rank holds, from every rank of ``group``."""
    layout = exchange_counts(counts, group)
    rows = all_to_all_rows(x, group, layout.received, layout.sent, name="moe dispatch")
    # Rows arrive per source, each sorted by local expert: sort them by local expert.
    return Dispatched(rows[layout.order], layout.received_counts.sum(0), layout.order,
                      layout.sent, layout.received)


def combine(y: torch.Tensor, d: Dispatched, group: CommGroup) -> torch.Tensor:
    """The experts' outputs y [N, h] (in :func:`dispatch`'s order) back to the ranks and rows
    they came from."""
    back = torch.empty_like(y).index_copy(0, d.order, y)  # per source again
    return all_to_all_rows(back, group, d.sent, d.received, name="moe combine")
