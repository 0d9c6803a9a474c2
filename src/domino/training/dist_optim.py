"""ZeRO-1: AdamW whose state is sharded over the data-parallel group
(``--use-distributed-optimizer``).

The gradient buckets of :class:`~domino.training.grad_sync.GradReducer` (sharded mode) are
reduce-scattered over their gradient group (DP x CP for dense weights: the placement's
``grad_group``), so each rank of it receives the summed gradients of its own 1/DP chunk of every
bucket - during the backward, as the buckets' layers finish. Each rank runs AdamW on its chunks
only (its moments are the only ones it holds: optimizer memory per rank / DP), then the updated
chunks are all-gathered back into every rank's parameters: with ``overlap_param_gather``
asynchronously, first layers first, each bucket waited for only where the next forward first
uses one of its parameters (:meth:`DistributedAdamW.attach`). The global gradient norm is summed
from the chunks (each element counted once over its gradient group, then each parameter where
its placement counts it, e.g. TP-replicated ones once over TP), so clipping is the unsharded
optimizer's.

The fp32 chunk buffers are the master weights, sharded like the moments. Under ``--bf16`` the
parameters themselves become bf16 when the optimizer is built
(:func:`~domino.precision.to_compute_dtype`: no compute copies), their ``.grad`` staying the fp32
main gradient; so a rank holds bf16
weights, fp32 gradients and 1/DP of the fp32 masters and moments, and the updated chunks are
all-gathered in bf16 (half the bytes). A parameter written from outside (a test copying weights
in) is taken back into its chunk at the next step, as its version counter shows; checkpoints
read and write the masters (:meth:`DistributedAdamW.stream_full`,
:meth:`~DistributedAdamW.load_master`).

Checkpoints hold the full masters and moments per parameter, exactly as the unsharded optimizer
writes them, so a checkpoint loads at any DP size, with or without the distributed optimizer:
:meth:`DistributedAdamW.stream_full` gathers them over DP one bucket at a time (the writer
streams each tensor to its file as it arrives), and loading keeps each parameter's chunks as it
is read (:meth:`~DistributedAdamW.load_param_state`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from domino.precision import to_compute_dtype
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.placement import (
    WITHIN,
    NamedGroups,
    counts_in_norm,
    placement_of,
    sum_over_norm_groups,
)
from domino.training.adamw import AdamW
from domino.training.grad_sync import GradReducer

SLOTS = ("exp_avg", "exp_avg_sq")


@dataclass(eq=False)
class _Segment:
    """The part of one parameter inside this rank's chunk of a bucket."""

    bucket: int
    param: nn.Parameter
    lo: int  # in the flattened parameter
    hi: int
    local: int  # offset in the rank's chunk
    view: torch.Tensor  # the chunk buffer's elements for it (what AdamW updates)


class DistributedAdamW:
    """AdamW on this DP rank's chunks of ``reducer``'s buckets (see the module docstring)."""

    def __init__(self, reducer: GradReducer, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, overlap_param_gather: bool = False) -> None:
        """``overlap_param_gather``: :meth:`step` leaves the parameters' all-gathers in flight;
        :meth:`wait_params` (or the hooks :meth:`attach` installs) finishes them."""
        if not reducer.shard:
            raise ValueError("DistributedAdamW needs a GradReducer built with shard=True")
        self.reducer = reducer
        self.overlap_param_gather = overlap_param_gather
        # bucket -> (gathered, handle, the chunk sent): in flight until wait_params
        self._gathers: dict[int, tuple[torch.Tensor, object, torch.Tensor]] = {}
        self.chunks: list[torch.Tensor] = []
        self.segments: list[_Segment] = []
        decay, no_decay = [], []
        for bi, bucket in enumerate(reducer.buckets):
            group = self._group(bi)
            size, rank = group.size, group.rank
            n = bucket.padded(size) // size
            first = bucket.params[0]
            chunk = torch.zeros(n, dtype=torch.float32, device=first.device)
            self.chunks.append(chunk)
            lo, hi, offset = rank * n, (rank + 1) * n, 0
            for p in bucket.params:
                a, z = offset, offset + p.numel()
                s, e = max(a, lo), min(z, hi)
                if s < e:
                    view = chunk[s - lo:e - lo]
                    self.segments.append(_Segment(bi, p, s - a, e - a, s - lo, view))
                    (decay if p.ndim >= 2 else no_decay).append(view)  # Megatron's rule
                offset = z
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        # A rank whose chunks hold nothing (tiny models, many ranks) still takes part.
        self.inner = AdamW(groups or [{"params": [torch.zeros(1)]}], lr=lr, betas=betas,
                           eps=eps)
        self.params = [p for b in reducer.buckets for p in b.params]
        self._bucket_index = {id(p): bi for bi, b in enumerate(reducer.buckets)
                              for p in b.params}
        self._segments_of: dict[int, list[_Segment]] = {}
        for seg in self.segments:
            self._segments_of.setdefault(id(seg.param), []).append(seg)
        with torch.no_grad():  # the masters: the parameters' values, before any cast
            for seg in self.segments:
                seg.view.copy_(seg.param.detach().reshape(-1)[seg.lo:seg.hi])
        self.turned = to_compute_dtype(self.params)  # --bf16: the parameters become bf16
        # Buckets whose parameters live as these chunks only (optim_grads_params: gathered
        # by training.fsdp.UnitGathers where the schedule uses them, never by the step).
        self.sharded_buckets: set[int] = set()
        self._versions: dict[int, int] = {}
        self._mark_written(self.params)

    def _mark_written(self, params) -> None:
        """These parameters hold what the masters say (each one's version counter now)."""
        for p in params:
            self._versions[id(p)] = p._version

    @torch.no_grad()
    def _take_written(self) -> None:
        """Parameters written from outside since the optimizer last wrote them: their values
        become the masters (in their own precision). (Sharded ones are written through
        :meth:`load_master` only.)"""
        for p in self.params:
            if p._version != self._versions[id(p)] and not self._sharded(p):
                for seg in self._segments_of.get(id(p), []):
                    seg.view.copy_(p.detach().reshape(-1)[seg.lo:seg.hi])
                self._versions[id(p)] = p._version

    def group_of(self, bucket: int) -> CommGroup:
        """The group bucket ``bucket`` is sharded over (its gradient group)."""
        return self.reducer.shard_group(self.reducer.buckets[bucket].group)

    _group = group_of

    def _sharded(self, p: nn.Parameter) -> bool:
        """Does ``p`` live as the chunks only (see ``sharded_buckets``)?"""
        segments = self._segments_of.get(id(p))
        bucket = segments[0].bucket if segments else self._bucket_index.get(id(p))
        return bucket in self.sharded_buckets

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # -- the step -----------------------------------------------------------------------------
    def _shard_grad(self, seg: _Segment) -> torch.Tensor:
        shard = self.reducer.buckets[seg.bucket].shard
        return shard[seg.local:seg.local + seg.hi - seg.lo]

    def scale_grads(self, factor: float) -> None:
        for bucket in self.reducer.buckets:
            bucket.shard.mul_(factor)

    def grad_norm(self, state: NamedGroups) -> float:
        """The full model's gradient L2 norm from the reduced chunks (equal on every rank).

        Chunks are disjoint over their gradient group: each group's squares are summed over it
        first (norm groups inside it, such as EP inside DP x CP, are then spanned: only their
        rank 0 keeps the sum), then over the norm groups as the unsharded norm is."""
        device = self.chunks[0].device if self.chunks else torch.device("cpu")
        names = list(dict.fromkeys(b.group for b in self.reducer.buckets))  # same on every rank
        parts = {name: torch.zeros((), dtype=torch.float64, device=device) for name in names}
        for seg in self.segments:
            name = self.reducer.buckets[seg.bucket].group
            if not counts_in_norm(placement_of(seg.param), state, skip=WITHIN[name]):
                continue
            parts[name] += torch.linalg.vector_norm(self._shard_grad(seg),
                                                    dtype=torch.float32).double() ** 2
        total = None
        for name, part in parts.items():
            # (HSDP: the replicas hold equal chunks: summed over the shard group only)
            self.reducer.shard_group(name).all_reduce(part, name="grad norm")
            if all(state.group(inner).rank == 0 for inner in WITHIN[name]):
                total = part if total is None else total + part
        if total is None:
            total = torch.zeros((), dtype=torch.float64, device=device)
        sum_over_norm_groups(total, state)
        return float(total.sqrt())

    def step(self, clip_coeff: float = 1.0) -> None:
        """Update this rank's chunks (gradients scaled by ``clip_coeff``), then all-gather every
        bucket's chunks into the parameters (left in flight with ``overlap_param_gather``)."""
        self.wait_params()  # a parameter the last forward did not use
        self._take_written()
        with torch.no_grad():
            for seg in self.segments:
                grad = self._shard_grad(seg)
                seg.view.grad = grad if clip_coeff == 1.0 else grad * clip_coeff
            self.inner.step()
            for seg in self.segments:
                seg.view.grad = None
            # Buckets are in backward order: launch the first layers' (the last buckets) first.
            for bi in reversed(range(len(self.chunks))):
                if bi in self.sharded_buckets:
                    continue  # gathered where the next forward uses them
                chunk, group = self.chunks[bi], self._group(bi)
                send = chunk.to(self._param_dtype(bi))  # bf16 parameters: half the bytes
                full = send.new_empty(send.numel() * group.size)
                self._gathers[bi] = (full, group.all_gather_into(
                    full, send, async_op=True, name="dp params (all-gather)"), send)
        if not self.overlap_param_gather:
            self.wait_params()

    def wait_params(self, params=None) -> None:
        """Finish the all-gathers of the buckets holding ``params`` (default: all) and copy the
        updated values into the parameters."""
        if not self._gathers:
            return
        wanted = None if params is None else {id(p) for p in params}
        for bi in sorted(self._gathers, reverse=True):
            bucket = self.reducer.buckets[bi]
            if wanted is not None and not any(id(p) in wanted for p in bucket.params):
                continue
            full, handle, _sent = self._gathers.pop(bi)
            handle.wait()
            offset = 0
            with torch.no_grad():
                for p in bucket.params:
                    p.copy_(full[offset:offset + p.numel()].view(p.shape))
                    offset += p.numel()
            self._mark_written(bucket.params)

    def _param_dtype(self, bucket: int) -> torch.dtype:
        """The dtype bucket ``bucket``'s parameters are gathered in: theirs, when they share it."""
        dtypes = {p.dtype for p in self.reducer.buckets[bucket].params}
        return dtypes.pop() if len(dtypes) == 1 else torch.float32

    def attach(self, model: nn.Module) -> list:
        """Forward pre-hooks that wait for the parameters just before their first use: the
        model's own (embedding, final norm, head: everything outside the transformer blocks)
        and each block's first module (``Block.first_module``, its norm: it runs first in
        every piece of the block), found through ``model.blocks()``.
        Returns the hook handles."""
        blocks = model.blocks()
        inside = {id(p) for b in blocks for p in b.parameters()}
        outside = [p for p in self.params if id(p) not in inside]
        def waiter(params: list[nn.Parameter]):
            return lambda module, args: self.wait_params(params)

        return [model.register_forward_pre_hook(waiter(outside)),
                *(b.first_module.register_forward_pre_hook(waiter(b.parameters()))
                  for b in blocks)]

    # -- checkpoints --------------------------------------------------------------------------
    def step_count(self) -> float | None:
        """AdamW's step count (the same on every rank), None before the first step (a
        collective over the gradient groups)."""
        local = [self.inner.state.get(seg.view, {}) for seg in self.segments]
        groups = self.reducer.groups()
        stepped = [any(g.all_gather_json(bool(any(local)))) for g in groups]  # every group
        if not any(stepped):
            return None
        step = next((float(st["step"]) for st in local if st), None)
        return [s for g in groups for s in g.all_gather_json(step) if s is not None][0]

    def stream_full(self, step: float | None) -> Iterator[tuple[nn.Parameter, str, torch.Tensor]]:
        """``(parameter, key, full tensor)``: each parameter's full fp32 master (key
        ``"master"``) and, when ``step`` (:meth:`step_count`) is not None, its AdamW state
        (``"step"``, then :data:`SLOTS`) as the unsharded optimizer holds it; bucket by bucket
        and one kind at a time, each gathered over its bucket's group (a collective: every rank
        of the groups iterates it to the end). The tensors are views of one gathered bucket,
        freed once the caller drops them: a caller that drops each before the next holds one
        bucket of gathered state at a time, never the model's."""
        self.wait_params()
        self._take_written()
        for bi in range(len(self.chunks)):
            params = self.reducer.buckets[bi].params
            for key in ("master", *(SLOTS if step is not None else ())):
                mine = self.chunks[bi] if key == "master" else self._slot_chunk(bi, key)
                full = self._gather(bi, mine, "master weights (all-gather)" if key == "master"
                                    else "optimizer state (all-gather)")
                del mine
                offset = 0
                for p in params:
                    yield p, key, full[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
                del full
                if key == "master" and step is not None:
                    for p in params:
                        yield p, "step", torch.tensor(step)

    def _slot_chunk(self, bucket: int, slot: str) -> torch.Tensor:
        """This rank's chunk of AdamW state ``slot`` of bucket ``bucket`` (zeros where a
        segment has none yet)."""
        mine = torch.zeros_like(self.chunks[bucket])
        for seg in self.segments:
            st = self.inner.state.get(seg.view)
            if seg.bucket == bucket and st:
                mine[seg.local:seg.local + seg.hi - seg.lo] = st[slot]
        return mine

    def _gather(self, bucket: int, mine: torch.Tensor, name: str) -> torch.Tensor:
        """Bucket ``bucket``'s flat tensor from every rank's chunk ``mine`` of it (a collective
        over the bucket's group)."""
        group = self._group(bucket)
        full = mine.new_empty(mine.numel() * group.size)
        group.all_gather_into(full, mine, name=name)
        return full

    def full_masters(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter's full fp32 master weight (a collective: every rank calls it), all
        at once: for small models and tests; checkpoints stream them (:meth:`stream_full`)."""
        return {p: t for p, _key, t in self.stream_full(None)}

    def full_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Every parameter's full AdamW state, as :class:`~domino.training.adamw.AdamW` holds
        it, on every rank of the gradient groups (a collective: every rank calls it), all at
        once: for small models and tests (checkpoints stream it: :meth:`stream_full`). Empty
        before the first step."""
        step = self.step_count()
        if step is None:
            return {}
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for p, key, t in self.stream_full(step):
            if key != "master":
                out.setdefault(p, {})[key] = t
        return out

    @torch.no_grad()
    def load_master(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set parameter ``p`` (this rank's full tensor of it) from ``value`` (a checkpoint's,
        at full precision): its master chunks exactly, ``p`` itself cast."""
        self.wait_params([p])
        flat = value.reshape(-1).to(p.device, torch.float32)
        for seg in self._segments_of.get(id(p), []):
            seg.view.copy_(flat[seg.lo:seg.hi])
        if not self._sharded(p):  # (a sharded one is gathered from the chunks when used)
            p.copy_(value.to(p.device, p.dtype).view(p.shape))
        self._mark_written([p])

    def load_param_state(self, p: nn.Parameter, entry: dict[str, torch.Tensor]) -> None:
        """Keep this rank's chunks of parameter ``p``'s full AdamW state ``entry`` (a
        checkpoint's: ``step`` and :data:`SLOTS`); a checkpoint is loaded one parameter at a
        time, never the model's state at once."""
        for seg in self._segments_of.get(id(p), []):
            state = {"step": torch.tensor(float(entry["step"]))}
            for slot in SLOTS:
                flat = entry[slot].reshape(-1).to(seg.view.device, torch.float32)
                state[slot] = flat[seg.lo:seg.hi].clone()
            self.inner.state[seg.view] = state

    def load_full_state(self, entries: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Keep this rank's chunks of full per-parameter AdamW states (:meth:`load_param_state`
        of each)."""
        for p, entry in entries.items():
            if entry:
                self.load_param_state(p, entry)
