"""Fully sharded data parallelism under the Domino schedule
(``--data-parallel-sharding-strategy``, Megatron-FSDP's names).

=====================  ================================================================
``no_shard``           every DP rank holds everything (plain DP)
``optim``              the optimizer state and fp32 masters sharded over DP (ZeRO-1,
                       ``--use-distributed-optimizer``; ``training.dist_optim``)
``optim_grads``        and the gradients: every micro-step reduce-scatters each bucket as soon
                       as it is final and frees it (``grad_sync``, ``accumulate``): ZeRO-2
``optim_grads_params`` and the transformer layers' parameters: each unit of layers is
                       all-gathered just ahead of its use and freed after it (ZeRO-3,
                       :class:`UnitGathers`)
=====================  ================================================================

Under ``optim_grads_params`` a unit's parameters are views into one flat buffer per bucket
(``grad_sync`` gives every unit buckets of its own) whose storage is resized to nothing when
the unit is freed and back when it is gathered: the parameters keep their shapes (gradients,
the deferred weight-gradient GEMMs and checkpoints see them as always) while holding no memory.
The gather is an all-gather of the optimizer's master chunks (in the parameters' dtype: bf16
under ``--bf16``) over the bucket's gradient group.

The schedule says where (``transformer.param_units``): the forward launches the first unit's
gather before the embedding (it runs under it), and each unit's first block waits for its own
gather and launches the next ``prefetch`` units'; a unit is freed once the forward is done with
its last block (``reshard_after_forward``; the last unit is kept for the backward that follows
at once). The backward gathers in reverse, each unit's last block waiting for its own and
launching the ``prefetch`` units before it, and frees a unit when it is done with it; its
gradients, final when the block's deferred weight-gradient GEMMs ran, are reduce-scattered and
freed by the reducer. Full recomputation reruns a block's forward inside the backward's
window, so it reuses the backward's gather. The embedding, final norm and LM head (the
parameters outside the units) stay whole, as under ``optim_grads``.

A pipeline rank's chunks each have units of their own (:class:`StageGathers`). Resharding after
the forward, every pipeline micro-batch gathers and frees them as above; kept, a unit stays
from its first gather of the step to the step's last backward through its chunk (the runner
says which: ``pipeline_backward``). Its gradients are reduce-scattered after every pipeline
micro-batch's backward (``grad_sync``: a bucket re-arms at launch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from domino.parallel_state import group_among
from domino.training.dist_optim import DistributedAdamW
from domino.training.grad_sync import make_reducer
from domino.transformer.layer import Block

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def unit_params(blocks: list[Block], unit_layers: int) -> list[list[nn.Parameter]]:
    """The trained parameters of each unit: ``unit_layers`` consecutive layers' blocks."""
    units: dict[int, list[nn.Parameter]] = {}
    layers = sorted({b.layer for b in blocks})
    for b in blocks:
        u = layers.index(b.layer) // unit_layers
        seen = units.setdefault(u, [])
        seen.extend(p for p in b.parameters() if p.requires_grad and all(p is not q for q in seen))
    return [units[u] for u in sorted(units)]


@dataclass(eq=False)
class _Flat:
    """One bucket's whole parameters: a flat buffer (storage freed while the unit is)."""

    bucket: int
    full: torch.Tensor
    handle: object = None
    send: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def present(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0


class UnitGathers:
    """``optim_grads_params``: a stack's units of layers gathered and freed where the Domino
    schedule says (a :class:`~domino.transformer.param_units.ParamUnits`; see the module
    docstring). Built after the :class:`~domino.training.dist_optim.DistributedAdamW` whose
    reducer has one bucket set per unit (``unit_params``)."""

    def __init__(self, optimizer, stack: nn.Module, unit_layers: int = 1, prefetch: int = 1,
                 reshard_after_forward: bool = True) -> None:
        if unit_layers < 1 or prefetch < 0:
            raise ValueError(f"UnitGathers(unit_layers={unit_layers}, prefetch={prefetch}): "
                             "units of at least one layer, a prefetch of zero or more")
        self.opt, self.prefetch = optimizer, prefetch
        self.reshard_after_forward = reshard_after_forward
        blocks = stack.blocks()
        layers = sorted({b.layer for b in blocks})
        self.unit_of_block = [layers.index(b.layer) // unit_layers for b in blocks]
        self.count = max(self.unit_of_block) + 1
        self.first = [self.unit_of_block.index(u) for u in range(self.count)]
        self.last = [len(blocks) - 1 - self.unit_of_block[::-1].index(u)
                     for u in range(self.count)]
        owner = {id(p): u for u, ps in enumerate(unit_params(blocks, unit_layers)) for p in ps}
        self.flats: list[list[_Flat]] = [[] for _ in range(self.count)]
        for bi, bucket in enumerate(optimizer.reducer.buckets):
            units = {owner.get(id(p)) for p in bucket.params}
            if units == {None}:
                continue
            if len(units) != 1:
                raise ValueError("UnitGathers: a gradient bucket spans units; build the reducer "
                                 "with units=unit_params(...)")
            self.flats[units.pop()].append(self._flatten(bi))
        optimizer.sharded_buckets |= {f.bucket for fs in self.flats for f in fs}
        self.graph, self.pinned = False, False
        self.final = True  # is the next backward the step's last (a pipeline's: see below)?
        for u in range(self.count):
            self.release(u)
        stack.param_units = self

    @torch.no_grad()
    def _flatten(self, bi: int) -> _Flat:
        """Bucket ``bi``'s parameters made views of one flat buffer (padded as its chunks)."""
        bucket = self.opt.reducer.buckets[bi]
        size = self.opt.group_of(bi).size  # (HSDP: its shard group)
        dtypes = {p.dtype for p in bucket.params}
        if len(dtypes) != 1:
            raise ValueError(f"UnitGathers: a bucket mixes parameter dtypes {dtypes}")
        full = torch.zeros(bucket.padded(size), dtype=dtypes.pop(),
                           device=bucket.params[0].device)
        offset = 0
        for p in bucket.params:
            view = full[offset:offset + p.numel()].view(p.shape)
            view.copy_(p.detach())
            p.data = view
            offset += p.numel()
        return _Flat(bi, full)

    # -- gathering and freeing ------------------------------------------------------------------
    def launch(self, u: int) -> None:
        """Start gathering unit ``u`` (nothing if out of range, present or in flight)."""
        if not 0 <= u < self.count:
            return
        for f in self.flats[u]:
            if f.handle is not None or f.present():
                continue
            f.full.untyped_storage().resize_(f.nbytes)
            chunk, group = self.opt.chunks[f.bucket], self.opt.group_of(f.bucket)
            f.send = chunk.to(f.full.dtype)
            f.handle = group.all_gather_into(f.full, f.send, async_op=True,
                                             name="fsdp params (all-gather)")

    def wait(self, u: int) -> None:
        """Unit ``u`` whole, gathered now if it was not launched."""
        self.launch(u)
        for f in self.flats[u]:
            if f.handle is not None:
                f.handle.wait()
                f.handle, f.send = None, None

    def release(self, u: int) -> None:
        """Free unit ``u``'s parameters (a gather in flight is finished first); not while
        :meth:`whole` holds them."""
        if self.pinned:
            return
        for f in self.flats[u]:
            if f.handle is not None:
                f.handle.wait()
                f.handle, f.send = None, None
            f.full.untyped_storage().resize_(0)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every unit gathered (a collective: every rank of the groups enters) and kept while
        inside, whatever the passes say: for what runs on some ranks only (one replica's
        sample); freed after."""
        for u in range(self.count):
            self.launch(u)
        for u in range(self.count):
            self.wait(u)
        self.pinned = True
        try:
            yield
        finally:
            self.pinned = False
            for u in range(self.count):
                self.release(u)

    def gathered_bytes(self) -> int:
        """Bytes of whole parameters present now (units gathered or in flight)."""
        return sum(f.nbytes for fs in self.flats for f in fs if f.present())

    def unit_bytes(self) -> list[int]:
        """Each unit's whole parameters, in bytes."""
        return [sum(f.nbytes for f in fs) for fs in self.flats]

    # -- the schedule's events (transformer.param_units.ParamUnits) ------------------------------
    def forward_start(self, graph: bool) -> None:
        self.graph = graph
        self.launch(0)  # under the embedding

    def forward_enter(self, j: int) -> None:
        u = self.unit_of_block[j]
        if j == self.first[u]:
            self.wait(u)
            for d in range(1, self.prefetch + 1):
                self.launch(u + d)

    def forward_leave(self, j: int) -> None:
        u = self.unit_of_block[j]
        if j != self.last[u]:
            return
        if not self.graph:
            self.release(u)  # (evaluation, generation: no backward follows)
        elif self.reshard_after_forward and u != self.count - 1:
            self.release(u)  # (the last unit's backward comes next)

    def backward_enter(self, j: int) -> None:
        u = self.unit_of_block[j]
        if j == self.last[u]:
            self.wait(u)
            for d in range(1, self.prefetch + 1):
                self.launch(u - d)

    def backward_leave(self, j: int) -> None:
        u = self.unit_of_block[j]
        if j == self.first[u] and (self.final or self.reshard_after_forward):
            self.release(u)

    # A pipeline runs a forward and a backward per pipeline micro-batch. Resharding after the
    # forward, every one gathers and frees its units as above. Kept (``reshard_after_forward``
    # off), a unit stays from its first gather of the step to the step's last backward through
    # the stack: one gather per unit and step, the stage's layers whole meanwhile.
    def pipeline_step(self) -> None:
        self.launch(0)  # (under the wait for the first activation)

    def pipeline_backward(self, final: bool) -> None:
        self.final = final


class StageGathers:
    """A pipeline rank's :class:`UnitGathers`, one per model chunk (each chunk's stack has
    units of its own layers), seen as one."""

    def __init__(self, parts: list[UnitGathers]) -> None:
        self.parts = parts

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.whole())
            yield

    def gathered_bytes(self) -> int:
        return sum(part.gathered_bytes() for part in self.parts)

    def unit_bytes(self) -> list[int]:
        return [b for part in self.parts for b in part.unit_bytes()]


def implied_state(strategy: str, model: nn.Module, params: list[nn.Parameter], optimizer,
                  gathers: UnitGathers | None, prefetch: int) -> dict[str, int]:
    """The model-state bytes per rank the strategy implies (the formula of
    docs/data-parallel.md, from this rank's tensors): ``weights`` (trained parameters whole,
    or under ``optim_grads_params`` the parts outside the units plus the largest units in
    flight; frozen ones and compute copies as held), ``grads`` (fp32 main gradients whole,
    or this rank's chunk of their sums plus what is in flight) and ``optimizer`` (AdamW's two
    moments and, where the optimizer holds them apart, the fp32 masters: whole, or this rank's
    chunks). Under ``optim_grads_params``:
    ``2 + prefetch`` units in flight, and one unit's gradients whole."""
    trained = {id(p) for p in params}
    frozen = sum(p.numel() * p.element_size() for p in model.parameters()
                 if id(p) not in trained)
    n = sum(p.numel() for p in params)
    width = max((p.element_size() for p in params), default=4)
    if optimizer is None or not hasattr(optimizer, "chunks"):  # no_shard (or nothing to shard)
        copies = sum(p.numel() * 2 for p in params if p.dtype != torch.bfloat16
                     and getattr(p, "domino_compute_dtype", p.dtype) != p.dtype)
        return {"weights": n * width + copies + frozen, "grads": 4 * n, "optimizer": 8 * n}
    chunk = sum(c.numel() for c in optimizer.chunks)  # this rank's share, padding included
    optim = 12 * chunk  # moments and fp32 masters
    if strategy == "optim":
        return {"weights": n * width + frozen, "grads": 4 * n, "optimizer": optim}
    if strategy == "optim_grads" or gathers is None:
        return {"weights": n * width + frozen, "grads": 4 * chunk, "optimizer": optim}
    units = gathers.unit_bytes()
    outside = n * width - sum(units)
    # At a unit boundary the unit before is still in use (its exit runs in the next unit's
    # first local piece) while the next ``prefetch`` are gathered.
    flight = min(2 + prefetch, len(units)) * max(units)
    if isinstance(gathers, StageGathers):  # a pipeline: each other chunk keeps its last unit
        kept = not gathers.parts[0].reshard_after_forward  # (all of them, for the step)
        flight = sum(units) if kept else min(flight + (len(gathers.parts) - 1) * max(units),
                                             sum(units))
    # One unit's fp32 gradients whole: made by the backward, or in flight to their
    # reduce-scatter (the one before is settled before the next is launched: grad_sync).
    return {"weights": outside + flight + frozen,
            "grads": 4 * chunk + max(units) // width * 4, "optimizer": optim}


def hybrid_rank_lists(sizes, shard_size: int | None) -> dict[str, tuple[list, list]]:
    """HSDP's groups as global ranks (``sizes``: a :class:`~domino.parallel_state.ParallelSizes`):
    gradient group name -> (shard groups, replicate groups); see :func:`hybrid_groups`."""
    groups = sizes.rank_groups()
    lists = groups["dp_cp"]
    size = len(lists[0])
    if shard_size is None or shard_size == size:
        return {}
    if shard_size < 1 or size % shard_size:
        raise ValueError(f"--data-parallel-shard-size {shard_size} must divide the "
                         f"data-parallel (x context-parallel) size {size}")
    shards = [ranks[i:i + shard_size] for ranks in lists for i in range(0, size, shard_size)]
    replicas = [ranks[i::shard_size] for ranks in lists for i in range(shard_size)]
    out = {"dp_cp": (shards, replicas)}
    if sizes.ep == 1:
        return out
    if shard_size % sizes.ep:
        raise ValueError(f"--data-parallel-shard-size {shard_size} with "
                         f"--expert-model-parallel-size {sizes.ep}: the shard size must be a "
                         "multiple of EP (each shard group holds whole EP groups)")
    # An expert-DP group (x TP) holds one EP rank of each EP group: cut by the K-block of
    # DP x CP its members' positions lie in, the same number of them in every block. Each
    # block sorted: a chunk's place is the member's rank in its process group (which torch
    # numbers in sorted order), so the replicas pair equal places.
    position = {r: i for ranks in lists for i, r in enumerate(ranks)}
    expert_shards, expert_replicas = [], []
    for ranks in groups["expert_dp"]:
        blocks: dict[int, list[int]] = {}
        for r in ranks:
            blocks.setdefault(position[r] // shard_size, []).append(r)
        cut = [sorted(block) for block in blocks.values()]
        expert_shards.extend(cut)
        expert_replicas.extend(list(place) for place in zip(*cut, strict=True))
    out["expert_dp"] = (expert_shards, expert_replicas)
    return out


def hybrid_groups(state, shard_size: int | None) -> dict:
    """HSDP (``--data-parallel-shard-size K``): each DP x CP group cut into shard groups of K
    consecutive ranks (what is sharded over) and replicate groups of the ranks at the same
    place in each (what the sharded chunks' gradients are summed over); with experts (EP > 1,
    K a multiple of EP) each expert-DP group likewise, its members whose DP x CP rank lies in
    one K-block making a shard group. ``{"dp_cp": (shard, replicate), "expert_dp": ...}`` for
    the reducer, empty when K is all of DP x CP (a collective: every rank creates every
    group, in one order)."""
    return {name: (group_among(shards, state.device), group_among(replicas, state.device))
            for name, (shards, replicas) in hybrid_rank_lists(state.sizes, shard_size).items()}


@dataclass(frozen=True)
class ShardingPlan:
    """How a run shards over data parallelism (``domino train``'s flags as a value)."""

    strategy: str = "no_shard"
    unit_layers: int = 1
    prefetch: int = 1
    reshard_after_forward: bool = True
    shard_size: int | None = None  # HSDP: None = all of DP x CP

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: one of {', '.join(STRATEGIES)}")


@dataclass(eq=False)
class Sharded:
    """What :func:`shard` built: the gradient reducer (None: nothing to reduce), the
    distributed optimizer (None: nothing to shard, use a plain one) and the units' gathers
    (``optim_grads_params`` only)."""

    reducer: object | None
    optimizer: object | None
    gathers: UnitGathers | StageGathers | None


def shard(model: nn.Module, params: list[nn.Parameter], state, plan: ShardingPlan, *,
          lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
          overlap: bool = True, runner=None, reduce_dtype: torch.dtype | None = None,
          overlap_param_gather: bool = True) -> Sharded:
    """The library's one call for a sharded data-parallel run (what ``domino train`` does):
    ``params`` of ``model`` (a GPT, or a pipeline rank's chunks with their ``runner``: each
    stack's blocks make its units) reduced and optimised as ``plan`` says, over ``state``'s
    groups. Every rank calls it."""
    # A pipeline's chunks (``model.chunks``) each have units of their own layers.
    stacks = [c.language_model.encoder for c in getattr(model, "chunks", [model])]
    units = ([u for stack in stacks for u in unit_params(stack.blocks(), plan.unit_layers)]
             if plan.strategy == "optim_grads_params" else [])
    reducer = make_reducer(model, params, state, distributed_optimizer=plan.strategy != "no_shard",
                           overlap=overlap, runner=runner, reduce_dtype=reduce_dtype,
                           accumulate=plan.strategy in ("optim_grads", "optim_grads_params"),
                           units=units, hybrid=hybrid_groups(state, plan.shard_size))
    if reducer is None or not reducer.shard:
        return Sharded(reducer, None, None)
    optimizer = DistributedAdamW(reducer, lr, betas, eps, weight_decay,
                                 overlap_param_gather and runner is None)
    if optimizer.overlap_param_gather:
        optimizer.attach(model)
    if not units:
        return Sharded(reducer, optimizer, None)
    parts = [UnitGathers(optimizer, stack, plan.unit_layers, plan.prefetch,
                         plan.reshard_after_forward) for stack in stacks if stack.blocks()]
    return Sharded(reducer, optimizer, parts[0] if runner is None else StageGathers(parts))
