"""An MoE layer's edges as the Domino schedule drives them: the dispatch all-to-all is the
block's entry, the combine all-to-all its exit (the protocol: ``transformer/exits.py``).

Forward, per micro-batch m of the block:

* ``entry.launch`` (at the end of the local piece, after the norm): the router, the sort of the
  (token, expert) assignments by expert (:func:`.experts.permute`), the exchange of per-expert
  row counts (a small blocking all-to-all), then the rows' all-to-alls, launched
  asynchronously, one per group of the receiving rank's experts (the exit's groups below:
  the dispatch's token chunks); the shared expert runs while they are in flight. The schedule
  runs this local piece inside the piece before it (``lookahead``): micro-batch m + 1's
  dispatch goes out before micro-batch m's experts run, micro-batch 0's during the attention
  before.
* ``core`` (the par piece): the received rows, sorted by local expert. Only the first group's
  rows are waited for before it starts; each later group's land when the exit reaches it, so
  a group's experts compute while the next groups' rows travel.
* ``exit.parts`` / ``exit.launch``: the rank's experts in ``chunks`` groups of consecutive local
  experts (a group of experts is the analogue of a column chunk); each group's weighted outputs
  go back to their ranks in their own all-to-all as soon as they are computed, so the combine
  of one group runs under the next group's GEMMs and the combine of micro-batch m under
  micro-batch m + 1's work.
* the exit's delivery (waited for in the next local piece): the rows added back into their
  tokens, plus the shared expert's output.

The routing weight travels with its row (one extra column, in the rows' dtype, as the
single-process layer applies it) and multiplies the expert's output on the expert's rank, so
the token's rank only adds rows up and the weight's gradient comes back with the row's. The
backward mirrors the forward: the delivered gradient's rows go to the expert ranks
(``exit.launch_grad``, launched in the local^T piece, which the schedule runs inside the
previous expert backward); the experts' backward defers its weight-gradient GEMMs to the
schedule's stash, which runs them while it would otherwise wait; the rows' gradients go back
(``entry.launch_grad``) while the shared expert's backward runs, and the backward of the sort
and the router finish on arrival.

Every rank launches the same collectives in the same order: the splits depend on the routing,
the calls do not (a group of experts that got no rows still exchanges, empty).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate

import torch

from domino.tensor_parallel.comm import DONE
from domino.tensor_parallel.handles import Arriving
from domino.tensor_parallel.layers import WgradStash, column_chunks
from domino.transformer.exits import GradStep
from domino.transformer.moe.dispatch import launch_counts, layout


@dataclass(eq=False)
class _Piece:
    """One micro-batch's routing, from the entry's launch to the entry's backward."""

    ln: torch.Tensor  # what the entry read [s, b, h]
    payload: torch.Tensor  # [N, h + 1 (+ pad)] the rows sent, each with its weight (graph)
    tokens: torch.Tensor  # [N] each sent row's token
    counts: torch.Tensor  # [E] rows sent per global expert
    shared: torch.Tensor | None  # the shared expert's output [T, h] (graph)
    # Once the counts are exchanged (the rows' launch):
    received_counts: torch.Tensor | None = None  # [EP, E / EP] per (source, local expert)
    order: torch.Tensor | None = None  # received rows (per source) -> by local expert (EP > 1)
    source: torch.Tensor | None = None  # each received row's source, by local expert (EP > 1)
    sent: list[int] = field(default_factory=list)  # rows sent to each rank
    received: list[int] = field(default_factory=list)  # rows received from each rank
    groups: list[tuple[slice, slice]] = field(default_factory=list)  # (experts, rows) per part
    grad_out: torch.Tensor | None = None  # the delivered output's gradient [T, h]
    then: Callable[[], None] | None = None  # the next micro-batch's rows, sent from parts()
    chunks: int = 1  # the exit's groups of experts, which the dispatch sends apart
    # The dispatch's groups not yet in the core: (their first local expert, land them).
    landing: list[tuple[int, Callable[[], None]]] = field(default_factory=list)
    starts: list[int] | None = None  # (spans) where each global expert's sent rows begin

    def land_through(self, stop: int) -> None:
        """Wait for the dispatched rows of every local expert before ``stop`` and put them in
        the core."""
        while self.landing and self.landing[0][0] < stop:
            self.landing.pop(0)[1]()

    def spans(self, experts: slice, ep: int) -> list[tuple[int, int]]:
        """Where the rows for the local experts ``experts`` of each rank sit among the rows
        sent (sorted by global expert): a [start, end) per rank (one host copy per piece)."""
        if self.starts is None:
            self.starts = list(accumulate(self.counts.tolist(), initial=0))
        local = self.counts.numel() // ep
        return [(self.starts[d * local + experts.start], self.starts[d * local + experts.stop])
                for d in range(ep)]

    def sent_positions(self, experts: slice, ep: int) -> torch.Tensor:
        """The rows of :meth:`spans`, as indices."""
        return torch.cat([torch.arange(a, b, device=self.counts.device)
                          for a, b in self.spans(experts, ep)])


class _CoreGrad:
    """The received rows' gradient, gathered where the experts read them: each group of
    experts reads its rows and their weights as leaves of their own (:meth:`leaf`), whose
    gradients are copied into one buffer as they land, which is the core's ``.grad`` from the
    first on. (Reading slices of the core itself would have autograd make a zero-filled
    gradient of the whole core per slice and add those up: passes over every row, per group.)
    The groups' rows cover the core's and each is read once, so only the columns past
    ``read`` (padding no group reads) are zeroed."""

    def __init__(self, core: torch.Tensor, read: int) -> None:
        self.core, self.read = core, read

    def leaf(self, rows: slice, cols: slice) -> torch.Tensor:
        """``core[rows, cols]`` (the same memory) as a leaf of its own."""
        leaf = self.core.detach()[rows, cols].requires_grad_()
        leaf.register_post_accumulate_grad_hook(lambda t: self._land(t, rows, cols))
        return leaf

    def _land(self, leaf: torch.Tensor, rows: slice, cols: slice) -> None:
        if self.core.grad is None:
            self.core.grad = torch.empty_like(self.core)
            self.core.grad[:, self.read:].zero_()
        self.core.grad[rows, cols].copy_(leaf.grad)
        leaf.grad = None


def _landed(handle, land: Callable[[], object] | None) -> None:
    """A group of the dispatch: wait for its rows, then put them in the core."""
    handle.wait()
    if land is not None:
        land()


def _by_expert(counts: torch.Tensor) -> torch.Tensor:
    """Rows received per source, each sorted by expert (``counts`` [source, expert]) ->
    the order that sorts them by expert (stable: by source within an expert)."""
    expert = torch.arange(counts.shape[1], device=counts.device).repeat(
        counts.shape[0]).repeat_interleave(counts.reshape(-1))
    return torch.argsort(expert, stable=True)


class MoEEntry:
    """The dispatch (see the module docstring); ``op`` is the layer's
    :class:`~domino.transformer.moe.op.MoEOp`, ``pieces`` the state shared with its exit."""

    lookahead = True  # launching is work: the schedule runs it inside the piece before
    core = None  # the op's core runs whole

    def __init__(self, op, pieces: dict[int, _Piece]) -> None:
        self.op, self.pieces = op, pieces

    def launch(self, x: torch.Tensor, j: int, m: int, mb=None, chunks: int = 1) -> Arriving:
        # A graph exactly when the schedule records one (its leaf ``x`` requires grad), also
        # where this runs inside a piece recomputation runs without one.
        with torch.set_grad_enabled(x.requires_grad):
            return self._launch(x, j, m, chunks, mb)

    def _launch(self, x: torch.Tensor, j: int, m: int, chunks: int, mb=None) -> Arriving:
        moe, ep = self.op.moe, self.op.moe.ep
        flat, rows, stats = moe.route(x, self.op.shards)
        # [x | weight | 0...]: rows padded so the experts' GEMMs can read the x columns in place
        # (grouped_mm needs 16-byte row strides).
        h, step = rows.x.shape[1], max(1, 16 // rows.x.element_size())
        pad = rows.x.new_zeros(rows.x.shape[0], -(h + 1) % step)
        payload = torch.cat([rows.x, rows.weights.to(rows.x.dtype).unsqueeze(-1), pad], dim=-1)
        payload = self.op.record(payload, stats, rows.dropped, mb)
        tags = {"mb": m, "block": j, "chunk": 0}
        if ep.size > 1:
            arrived, counted = launch_counts(rows.counts, ep, f"fwd dispatch counts b{j}", tags)
        shared = moe.shared(flat) if moe.shared is not None else None  # under the dispatch
        piece = self.pieces[m] = _Piece(x, payload, rows.tokens, rows.counts, shared,
                                        chunks=chunks)
        if ep.size == 1:
            piece.received_counts = rows.counts.view(1, -1)
            piece.sent = piece.received = [payload.shape[0]]
            return Arriving([DONE], lambda: payload.detach())
        arriving, counts = Arriving(None, None), rows.counts  # (not rows: its x copy is freed)
        del rows, flat

        def send() -> None:
            """The rows' all-to-alls, once the counts are in (once)."""
            if arriving.handles is not None:
                return
            counted.wait()
            plan = layout(counts, arrived, ep.size)
            piece.received_counts, piece.sent, piece.received = (
                plan.received_counts, plan.sent, plan.received)
            # Rows arrive per source, each sorted by local expert: by local expert on arrival.
            piece.order = plan.order
            piece.source = torch.arange(ep.size, device=x.device).repeat_interleave(
                torch.tensor(plan.received, device=x.device))[plan.order]
            arriving.handles, arriving.finish = self._send(piece, plan, j, tags)

        # The counts travel while the micro-batch before computes its first group of experts
        # (its exit starts the rows then), or - with none pending - the rows go now. Where is
        # fixed by the schedule, not by timing: every rank launches in one order.
        before = self.pieces.get(m - 1)
        if before is not None and before.then is None and not before.groups:
            before.then = send
        else:
            send()
        arriving.start = send
        return arriving

    def _send(self, piece: _Piece, plan, j: int, tags: dict
              ) -> tuple[list, Callable[[], torch.Tensor]]:
        """The rows' all-to-all, one per group of local experts (the exit's groups, the
        token chunks of the dispatch): the first group's experts start once their own rows
        are in, while the next groups' rows travel (:meth:`_Piece.land_through`, from the
        exit's parts). -> the first group's handles and what makes the core (the received
        rows by local expert) of them."""
        ep, payload = self.op.moe.ep, piece.payload.detach()
        local = piece.counts.numel() // ep.size
        groups = column_chunks(local, piece.chunks)
        if len(groups) == 1:
            buf = payload.new_empty(sum(plan.received), payload.shape[1])
            handle = ep.all_to_all(buf, payload, plan.received, plan.sent, async_op=True,
                                   name=f"fwd dispatch b{j}", tags=tags)
            return [handle], lambda: buf[plan.order]
        received = plan.received_counts.tolist()  # [source, local expert]
        core = payload.new_empty(sum(plan.received), payload.shape[1])
        # Writes into the core go through ``.data``: the autograd version counter of the core
        # (a leaf of the schedule's graph) and of its groups' views (leaves the experts' GEMMs
        # save) must not see a later group land, which touches rows none of them read.
        into = core.data
        handles, start = [], 0
        for c, experts in enumerate(groups):
            spans = piece.spans(experts, ep.size)  # these experts' rows, per destination
            to = [b - a for a, b in spans]
            back = [sum(row[experts]) for row in received]
            send = torch.cat([payload[a:b] for a, b in spans])
            rows = slice(start, start + sum(back))
            start = rows.stop
            if experts.stop - experts.start == 1:  # per source is by expert: land in place
                buf, land = into[rows], None
            else:
                buf = payload.new_empty(rows.stop - rows.start, payload.shape[1])
                order = _by_expert(plan.received_counts[:, experts])
                land = partial(torch.index_select, buf, 0, order, out=into[rows])
            handle = ep.all_to_all(buf, send, back, to, async_op=True,
                                   name=f"fwd dispatch b{j}", tags={**tags, "chunk": c})
            handles.append((experts.start, handle, land))

        piece.landing = [(e, partial(_landed, h, land)) for e, h, land in handles[1:]]
        _, handle, land = handles[0]

        def first() -> torch.Tensor:
            if land is not None:
                land()
            return core
        return [handle], first

    def launch_grad(self, grad: torch.Tensor, j: int, m: int) -> Arriving:
        """The received rows' gradient back to their ranks; on arrival, the backward of the
        sort and the router (and, while the rows travel, the shared expert's) -> the gradient
        of what the entry read."""
        piece, ep = self.pieces.pop(m), self.op.moe.ep
        if ep.size > 1:
            back = torch.empty_like(grad).index_copy_(0, piece.order, grad)
            buf = grad.new_empty(piece.payload.shape)
            handle = ep.all_to_all(buf, back, piece.sent, piece.received, async_op=True,
                                   name=f"bwd dispatch b{j}", tags={"mb": m, "block": j,
                                                                     "chunk": 0})
        else:
            buf, handle = grad, DONE
        if piece.shared is not None and piece.shared.requires_grad:
            torch.autograd.backward([piece.shared], [piece.grad_out])

        def finish() -> torch.Tensor:
            torch.autograd.backward([piece.payload], [buf])
            return piece.ln.grad
        return Arriving([handle], finish)


class MoEExit:
    """The combine (see the module docstring); ``pieces`` is shared with the entry."""

    lookahead = True  # its gradient's launch is work: the schedule runs it in the piece before

    def __init__(self, op, pieces: dict[int, _Piece]) -> None:
        self.op, self.pieces = op, pieces

    def parts(self, core: torch.Tensor, chunks: int, stash: WgradStash | None,
              m: int) -> Iterator[torch.Tensor]:
        """The weighted expert outputs [rows, h] of each group of local experts, in order."""
        piece, moe = self.pieces[m], self.op.moe
        per_expert = piece.received_counts.sum(0)
        h = piece.ln.shape[-1]
        piece.groups = []
        start = 0
        groups = column_chunks(per_expert.numel(), chunks)
        read = _CoreGrad(core, h + 1).leaf if core.requires_grad and torch.is_grad_enabled() else (
            lambda rows, cols: core[rows, cols])
        for c, experts in enumerate(groups):
            if c == min(1, len(groups) - 1) and piece.then is not None:
                # The next micro-batch's rows go out after this one's first group's combine
                # (with one group, before it): its counts arrived meanwhile.
                send, piece.then = piece.then, None
                send()
            piece.land_through(experts.stop)  # (the dispatch's groups: this one's rows in)
            n = int(per_expert[experts].sum())
            rows = slice(start, start + n)
            piece.groups.append((experts, rows))
            start += n
            y = moe.experts(read(rows, slice(0, h)), per_expert[experts], stash, experts)
            yield y * read(rows, slice(h, h + 1))

    def launch(self, parts: Iterable[torch.Tensor], j: int, m: int,
               release: bool = False) -> Arriving:
        piece, ep = self.pieces[m], self.op.moe.ep
        bufs, places, handles = [], [], []
        for c, y in enumerate(parts):
            experts, rows = piece.groups[c]
            places.append(piece.sent_positions(experts, ep.size))
            if ep.size > 1:
                send = y.detach()[torch.argsort(piece.source[rows], stable=True)]
                to = piece.received_counts[:, experts].sum(1).tolist()
                back = piece.counts.view(ep.size, -1)[:, experts].sum(1).tolist()
                buf = y.new_empty(sum(back), y.shape[1])
                handles.append(ep.all_to_all(buf, send, back, to, async_op=True,
                                             name=f"fwd combine b{j}",
                                             tags={"mb": m, "block": j, "chunk": c}))
            else:
                buf = y.detach()
            bufs.append(buf)
        return Arriving(handles, lambda: self._deliver(m, bufs, places))

    def _deliver(self, m: int, bufs: list[torch.Tensor], places: list[torch.Tensor]):
        """The returned rows added into their tokens (+ the shared expert) -> [s, b, h]."""
        piece = self.pieces[m]  # (kept for the backward; the run's executor owns the dict)
        h = piece.ln.shape[-1]
        out = bufs[0].new_zeros(piece.ln.numel() // h, h)
        for buf, place in zip(bufs, places, strict=True):
            out.index_add_(0, piece.tokens[place], buf)
        if piece.shared is not None:
            out = out + piece.shared.detach()
        return out.view(piece.ln.shape)

    def bias(self) -> None:
        return None

    def launch_grad(self, grad: torch.Tensor, j: int, m: int) -> Arriving:
        """The delivered gradient's rows to the expert ranks, one all-to-all per group of
        experts (the forward's groups), in order, so that a group's backward starts once its
        own rows are in; by local expert on arrival."""
        piece, ep = self.pieces[m], self.op.moe.ep
        piece.grad_out = grad.reshape(-1, grad.shape[-1])
        groups = []
        for c, (experts, rows) in enumerate(piece.groups):
            if ep.size == 1:  # the rows stay: sent order is the experts' order
                groups.append(Arriving([], lambda rows=rows: piece.grad_out[
                    piece.tokens[rows]]))
                continue
            send = piece.grad_out[piece.tokens[piece.sent_positions(experts, ep.size)]]
            to = piece.counts.view(ep.size, -1)[:, experts].sum(1).tolist()
            back = piece.received_counts[:, experts]
            buf = send.new_empty(int(back.sum()), send.shape[1])
            handle = ep.all_to_all(buf, send, back.sum(1).tolist(), to, async_op=True,
                                   name=f"bwd combine b{j}",
                                   tags={"mb": m, "block": j, "chunk": c})
            groups.append(Arriving([handle], lambda buf=buf, back=back: buf[_by_expert(back)]))
        # One per group of experts (waited for all at once where a schedule overlaps nothing).
        return Arriving(groups, lambda: None)

    def grad_steps(self, grad: Arriving, parts: list[torch.Tensor]) -> list[GradStep]:
        """One step per group of experts: their rows arrive apart, and the groups' graphs
        share nothing but the received rows (a leaf)."""
        return [GradStep(g, [p], lambda t: [t])
                for g, p in zip(grad.handles, parts, strict=True)]

    def replicated_parameters(self) -> list[torch.Tensor]:
        return self.op.replicated_parameters()


def run_edges(op) -> tuple[MoEEntry, MoEExit]:
    """A run's entry and exit of ``op``, sharing their per-micro-batch state."""
    pieces: dict[int, _Piece] = {}
    return MoEEntry(op, pieces), MoEExit(op, pieces)

