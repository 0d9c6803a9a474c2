"""The shared-memory transport's algorithms (see the package's docstring), run by the worker
thread over one rank's :class:`~domino.tensor_parallel.shm.channel.Channel`.

Every function takes flat (1-D, contiguous) views and moves a tensor larger than a slot in
pieces; every rank runs the same number of pieces (barriers), whatever its own share.
"""

from __future__ import annotations

import torch

from domino.tensor_parallel.shm.channel import Channel

# What the slots carry; the order numbers a dtype in the all-to-all's agreement.
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8, torch.int8)


def all_reduce(ch: Channel, flat: torch.Tensor, reduce) -> None:
    per = ch.slot_bytes // flat.element_size()
    for start in range(0, flat.numel(), per):
        piece = flat[start:start + per]
        n = piece.numel()
        slots = [s[:n] for s in ch.slots(flat.dtype)]
        slots[ch.rank].copy_(piece)
        ch.barrier()
        if ch.size == 2:  # both sum the whole piece: one barrier, less copying
            first, second = (slots[0], piece) if ch.rank else (piece, slots[1])
            reduce(first, second, out=piece)
            continue
        bounds = [n * q // ch.size for q in range(ch.size + 1)]
        a, b = bounds[ch.rank], bounds[ch.rank + 1]
        # Summed into this rank's own tensor (its own slot holds an input still to read),
        # then published in its slot for the others.
        mine = piece[a:b]
        _combine([s[a:b] for s in slots], mine, reduce)
        slots[ch.rank][a:b].copy_(mine)
        ch.barrier()
        for q in range(ch.size):
            if q != ch.rank:
                piece[bounds[q]:bounds[q + 1]].copy_(slots[q][bounds[q]:bounds[q + 1]])


def reduce_scatter(ch: Channel, out: torch.Tensor, flat: torch.Tensor) -> None:
    m = out.numel()
    per = ch.slot_bytes // flat.element_size() // ch.size
    # This rank's own chunk is read where it is, not copied in, unless the output overlaps
    # the input (then the sum could overwrite it before it is read).
    apart = _apart(out, flat)
    for start in range(0, m, per):
        n = min(per, m - start)
        slots = ch.slots(flat.dtype)
        mine = slots[ch.rank][:ch.size * n].view(ch.size, n)
        src = flat.view(ch.size, m)[:, start:start + n]
        for q in range(ch.size):
            if q != ch.rank or not apart:
                mine[q].copy_(src[q])
        ch.barrier()
        parts = [s[ch.rank * n:(ch.rank + 1) * n] for s in slots]
        if apart:
            parts[ch.rank] = src[ch.rank]
        _combine(parts, out[start:start + n], torch.add)


def all_gather(ch: Channel, out: torch.Tensor, flat: torch.Tensor) -> None:
    m = flat.numel()
    per = ch.slot_bytes // flat.element_size()
    whole = out.view(ch.size, m)
    for start in range(0, m, per):
        n = min(per, m - start)
        slots = ch.slots(flat.dtype)
        slots[ch.rank][:n].copy_(flat[start:start + n])
        ch.barrier()
        for q in range(ch.size):
            whole[q, start:start + n].copy_(slots[q][:n])


def all_to_all(ch: Channel, out: torch.Tensor, flat: torch.Tensor, out_splits: list[int],
               in_splits: list[int], row: int) -> None:
    """``flat`` holds ``in_splits[q]`` rows of ``row`` elements for each rank q, in rank
    order; ``out`` gets each rank q's rows for this one at the ``out_splits`` offsets.

    A rank's *sent* elements are its input without its own chunk; piece k moves elements
    [k x slot, (k+1) x slot) of every rank's sent elements, so the pieces are as many as the
    largest sender needs.
    """
    me, size = ch.rank, ch.size
    sends = _agree(ch, flat.dtype, row, in_splits, out_splits)  # sends[q][d]: rows q -> d
    if not _apart(out, flat):  # the output would overwrite input still to be sent
        flat = flat.clone()
    first = [[row * sum(s[:d]) for d in range(size)] for s in sends]  # of chunk q -> d

    def sent_at(q: int, d: int) -> int:  # chunk q -> d among q's sent elements
        return first[q][d] - (row * sends[q][q] if d > q else 0)

    at = [row * sum(sends[p][me] for p in range(q)) for q in range(size)]  # in ``out``
    own = row * sends[me][me]
    out[at[me]:at[me] + own].copy_(flat[first[me][me]:first[me][me] + own])
    per = ch.slot_bytes // flat.element_size()
    most = max(row * (sum(s) - s[q]) for q, s in enumerate(sends))
    for w0 in range(0, most, per):
        w1 = w0 + per
        slots = ch.slots(flat.dtype)
        for d in range(size):
            s, n = sent_at(me, d), row * sends[me][d]
            lo, hi = max(s, w0), min(s + n, w1)
            if d != me and lo < hi:
                slots[me][lo - w0:hi - w0].copy_(flat[first[me][d] + lo - s:
                                                      first[me][d] + hi - s])
        ch.barrier()
        for q in range(size):
            s, n = sent_at(q, me), row * sends[q][me]
            lo, hi = max(s, w0), min(s + n, w1)
            if q != me and lo < hi:
                out[at[q] + lo - s:at[q] + hi - s].copy_(slots[q][lo - w0:hi - w0])


def _agree(ch: Channel, dtype: torch.dtype, row: int, in_splits: list[int],
           out_splits: list[int]) -> list[list[int]]:
    """Every rank's input split sizes, all-gathered over the channel. Every rank reads the
    same table, so a mismatch (a rank expecting other sizes than its peer sends, another dtype
    or row length) fails every rank alike with the same message."""
    size = ch.size
    mine = torch.tensor([DTYPES.index(dtype), row, *in_splits, *out_splits],
                        dtype=torch.int64)
    table = torch.empty(size, mine.numel(), dtype=torch.int64)
    all_gather(ch, table.view(-1), mine)
    ranks = table.tolist()
    if len({(r[0], r[1]) for r in ranks}) != 1:
        seen = ", ".join(f"rank {q}: {DTYPES[r[0]]} rows of {r[1]} elements"
                         for q, r in enumerate(ranks))
        raise ValueError(f"all_to_all: the ranks' tensors do not match ({seen})")
    sends = [r[2:2 + size] for r in ranks]
    for q in range(size):
        for d in range(size):
            expected = ranks[d][2 + size + q]
            if sends[q][d] != expected:
                raise ValueError(
                    f"all_to_all: rank {q} sends rank {d} {sends[q][d]} rows (its "
                    f"input_split_sizes[{d}]) but rank {d} expects {expected} (its "
                    f"output_split_sizes[{q}])")
    return sends


def _apart(out: torch.Tensor, flat: torch.Tensor) -> bool:
    """Do two contiguous tensors' byte ranges not overlap (two storages over one memory
    included)?"""
    o, f = out.data_ptr(), flat.data_ptr()
    return o + out.nbytes <= f or f + flat.nbytes <= o


def _combine(parts: list[torch.Tensor], out: torch.Tensor, reduce) -> None:
    """``out`` = ``parts`` reduced in rank order (``out`` may be ``parts[0]`` or ``parts[1]``,
    never a later one: it is written before those are read)."""
    reduce(parts[0], parts[1], out=out)
    for part in parts[2:]:
        reduce(out, part, out=out)
