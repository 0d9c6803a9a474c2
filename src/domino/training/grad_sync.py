"""Data-parallel gradient reduction: the one bucketing implementation, overlapped with the
backward schedule or not (:func:`make_reducer` decides which, once per run).

Each gradient is summed over the group its parameter's placement names (``grad_group``: DP x CP
for dense weights, later expert-DP for experts), in buckets (a few MiB each, one gradient group
per bucket, parameters in backward order: last layers first). Overlapped, a bucket is launched,
asynchronously, as soon as every parameter in it has its final gradient - which the Domino
schedule reports block by block (the ``on_final`` of the step's
:class:`~domino.transformer.BackwardContext`: a block's norm, op and exit bias are done,
including its deferred weight-gradient GEMMs) - so its all-reduce runs under the backward of the
layers before it. The model says which blocks there are (``model.blocks()``). Parameters outside
the transformer blocks (embedding, final norm, LM head) are launched when the backward ends. A
pipeline (``PipelineRunner.step(reducer=...)``) gives :meth:`GradReducer.context` to the forward
of each model chunk's last backward (sharding the gradients, to every backward: a bucket re-arms
when it is launched, and a relaunch first takes the sums of the one before). Not overlapped
(``--no-overlap-grad-reduce``, or zero-bubble, whose W passes finish the weight gradients
later), everything is launched at :meth:`GradReducer.finish`, which waits for every bucket
before the optimizer step.

Only the last micro-step of gradient accumulation reduces (:meth:`GradReducer.armed`, whose
context goes to that micro-step's forward): earlier ones only add into ``.grad``. Sharding the
gradients too (``accumulate``: ``optim_grads`` and ``optim_grads_params``, see
``training.fsdp``), every micro-step reduce-scatters its buckets as they are final and frees
their gradients at once; this rank's chunks of the sums add up over the step in fp32, so no
full-size gradient outlives its bucket. Every rank
launches the same buckets in the same order (blocks finish last-first whatever the timing),
which collectives on one group require.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from domino.precision import grad_dtype, zeros_grad
from domino.tensor_parallel.comm import CommGroup, Handle
from domino.tensor_parallel.placement import GRAD_GROUPS, NamedGroups, placement_of
from domino.transformer.context import BackwardContext

BUCKET_NUMEL = 1 << 22  # 16 MiB of fp32 per collective: few launches, bounded extra memory
MIN_BUCKET_NUMEL = 1 << 16


@dataclass(eq=False)
class _Bucket:
    params: list[nn.Parameter]
    group: str  # the gradient group (a name of ``state.group``) its sums run over
    waiting: int = 0  # parameters whose gradient is not final yet
    flat: torch.Tensor | None = None
    handle: Handle | None = None
    grads: list[torch.Tensor] = field(default_factory=list)
    shard: torch.Tensor | None = None  # sharded: this rank's chunk of the summed gradients
    total: torch.Tensor | None = None  # accumulating: the step's sum of the micro-steps' shards
    pending: bool = False  # launched, its sums not taken yet (:meth:`GradReducer._absorb`)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def padded(self, parts: int) -> int:
        """The flat length, padded so ``parts`` ranks get equal chunks."""
        return -(-self.numel // parts) * parts


def backward_order(model: nn.Module, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """``params`` in the order the backward finishes them: the model's blocks
    (``model.blocks()``) last first, then everything else (embedding, final norm, head: final
    when the backward ends)."""
    wanted = {id(p) for p in params}
    ordered, seen = [], set()
    for block in reversed(model.blocks()):
        for p in block.parameters():
            if id(p) in wanted and id(p) not in seen:
                ordered.append(p)
                seen.add(id(p))
    return ordered + [p for p in params if id(p) not in seen]


class GradReducer:
    """Buckets of ``model``'s ``params``, each reduced over its parameters' gradient group."""

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter], state: NamedGroups,
                 bucket_numel: int | None = None, shard: bool = False,
                 overlap: bool = True, reduce_dtype: torch.dtype | None = None,
                 accumulate: bool = False,
                 units: Sequence[Sequence[nn.Parameter]] = (),
                 hybrid: dict[str, tuple[CommGroup, CommGroup]] | None = None) -> None:
        """``state``: the parallel state (its groups by name). ``shard`` (a distributed
        optimizer): reduce-scatter each bucket instead, every rank of its group keeping its
        chunk of the sums (:attr:`_Bucket.shard`); ``.grad`` is left unreduced. ``overlap``:
        the caller gives :meth:`context` to the backward (the training step reads it).
        ``reduce_dtype``: the dtype the sums run in (``--grad-reduce-in-bf16``); default the
        gradients' own (fp32 main gradients). The sums come back in the gradients' dtype.
        ``accumulate`` (with ``shard``): every micro-step reduces, the gradients freed as
        their bucket is launched (see the module docstring). ``units``: groups of parameters
        that never share a bucket with others (a fully sharded run's units of layers, each
        gathered and freed whole; their buckets hold one unit each, whatever its size).
        ``hybrid`` (HSDP, with ``shard``): gradient group name -> (shard group, replicate
        group): its buckets are reduce-scattered over the shard group, then this rank's chunk
        all-reduced over the replicate group (``training.fsdp.hybrid_groups``)."""
        if accumulate and not shard:
            raise ValueError("GradReducer(accumulate=True) sums this rank's chunks of the "
                             "gradients: it needs shard=True")
        self.state, self.shard, self.overlap = state, shard, overlap
        self.reduce_dtype, self.accumulate = reduce_dtype, accumulate
        self.hybrid = dict(hybrid or {})
        if self.hybrid and not shard:
            raise ValueError("GradReducer(hybrid=...) shards within groups: it needs shard=True")
        if bucket_numel is None:
            # Overlapped: at least ~4 buckets, or the last one would wait for the whole
            # backward; few enough that launches stay cheap. Blocking: the largest.
            total = sum(p.numel() for p in params)
            bucket_numel = (max(MIN_BUCKET_NUMEL, min(BUCKET_NUMEL, total // 4))
                            if overlap or shard else BUCKET_NUMEL)
        self.buckets: list[_Bucket] = []
        unit_of = {id(p): u for u, ps in enumerate(units) for p in ps}
        filling: dict[tuple, tuple[_Bucket, int]] = {}  # per gradient group: open bucket, size
        for p in backward_order(model, params):
            unit = unit_of.get(id(p))
            key = (placement_of(p).grad_group, unit)
            bucket, size = filling.get(key, (None, 0))
            if bucket is None or (unit is None and size + p.numel() > bucket_numel) \
                    or grad_dtype(p) != grad_dtype(bucket.params[0]):
                bucket, size = _Bucket([], key[0]), 0
                self.buckets.append(bucket)
            bucket.params.append(p)
            filling[key] = (bucket, size + p.numel())
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._ready: set[int] = set()
        self._armed = False
        self.launched_early = 0

    def groups(self) -> list[CommGroup]:
        """The distinct groups the buckets are reduced over (for their timing)."""
        out: list[CommGroup] = []
        for name in dict.fromkeys(b.group for b in self.buckets):
            for g in self.hybrid.get(name, (self.state.group(name),)):
                if all(g is not seen for seen in out):
                    out.append(g)
        return out

    def shard_group(self, name: str) -> CommGroup:
        """The group gradient group ``name``'s buckets are reduced (sharded: reduce-scattered)
        over: the group itself, or under HSDP its shard group."""
        return self.hybrid[name][0] if name in self.hybrid else self.state.group(name)

    @contextlib.contextmanager
    def armed(self) -> Iterator[BackwardContext]:
        """Begin a step's reduction and yield the backward context to pass to the forward of
        its last micro-step (``model(..., context=ctx)``): that backward launches each bucket
        once its blocks are final. Then :meth:`finish`."""
        self.begin()
        yield self.context()

    def context(self) -> BackwardContext:
        """A backward context whose final blocks launch their buckets (after :meth:`begin`; a
        pipeline gives one to the forward of each model chunk's last backward)."""
        return BackwardContext(on_final=self.ready)

    def begin_step(self) -> None:
        """A new optimizer step: accumulating, its sums start from zero."""
        for b in self.buckets:
            b.total = None

    def begin(self) -> None:
        """Start a step's reduction (:meth:`armed` does; call it directly to reduce everything
        at :meth:`finish`, without overlap, or before a pipeline's step); accumulating, a
        micro-step's."""
        self._ready.clear()
        for b in self.buckets:
            b.waiting, b.flat, b.handle, b.grads, b.shard = len(b.params), None, None, [], None
            b.pending = False
        self._armed = True

    def ready(self, params: Sequence[nn.Parameter]) -> None:
        """These parameters' gradients are final: launch every bucket that is now complete."""
        for p in params:
            bucket = self._bucket_of.get(id(p))
            if bucket is None or id(p) in self._ready:
                continue  # frozen, or already reported
            self._ready.add(id(p))
            bucket.waiting -= 1
            if bucket.waiting == 0:
                self._launch(bucket)
                if self.accumulate:  # re-armed: a pipeline's next micro-batch reports again
                    bucket.waiting = len(bucket.params)
                    self._ready.difference_update(id(q) for q in bucket.params)

    def _launch(self, bucket: _Bucket) -> None:
        grads = []
        for p in bucket.params:
            if p.grad is None:  # unused this step: every rank must still send the same buffer
                p.grad = zeros_grad(p)
            grads.append(p.grad)
        bucket.grads = grads
        group = self.shard_group(bucket.group)
        if not self.shard:
            bucket.flat = self._wire(torch.cat([g.reshape(-1) for g in grads]))
            bucket.handle = group.all_reduce(bucket.flat, async_op=True, name="dp grads")
            bucket.pending = True
            return
        size = group.size
        pad = bucket.padded(size) - bucket.numel
        parts = [g.reshape(-1) for g in grads]
        if pad:
            parts.append(grads[0].new_zeros(pad))
        if self.accumulate:
            if bucket.pending:  # (a pipeline's earlier micro-batch's sums)
                self._absorb(bucket)
            self._settle_flats()
        bucket.flat = self._wire(torch.cat(parts))
        if self.accumulate:  # the copy in flight is all that is left of them
            for p in bucket.params:
                p.grad = None
            bucket.grads = []
        bucket.shard = bucket.flat.new_empty(bucket.flat.numel() // size)
        bucket.handle = group.reduce_scatter(bucket.shard, bucket.flat, async_op=True,
                                             name="dp grads (reduce-scatter)")
        bucket.pending = True

    def _settle_flats(self) -> None:
        """Accumulating: before another bucket's copy is made, the earlier buckets' copies
        are dropped once their reduce-scatter is done (waited for: it ran under a whole
        block's backward), so one bucket's gradients at most are in flight."""
        for b in self.buckets:
            if b.flat is not None and b.handle is not None:
                b.handle.wait()
                b.flat = None

    def _wire(self, flat: torch.Tensor) -> torch.Tensor:
        dtype = self.reduce_dtype
        return flat if dtype is None or dtype == flat.dtype else flat.to(dtype)

    def finish(self) -> None:
        """Launch what is left (in bucket order), wait for every bucket and write the sums back
        into ``.grad``."""
        if not self._armed:
            raise RuntimeError("GradReducer.finish() without an armed backward")
        self._armed = False
        # How many buckets the backward launched itself (the overlap; the rest launch now).
        self.launched_early = sum(b.handle is not None for b in self.buckets)
        for bucket in self.buckets:
            if bucket.handle is None:
                self.ready(bucket.params)
            elif self.accumulate and any(p.grad is not None for p in bucket.params):
                self._launch(bucket)  # gradients made since its launch (a pipeline's chunk)
        for bucket in self.buckets:
            if bucket.pending:
                self._absorb(bucket)

    def _absorb(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s reduction and take its sums: into ``.grad``, or this rank's
        chunk (accumulating: added to the step's total)."""
        bucket.handle.wait()
        bucket.pending = False
        wanted = grad_dtype(bucket.params[0])  # the sums in the gradients' dtype again
        if bucket.group in self.hybrid:  # the replicas' sums of this rank's chunk
            self.hybrid[bucket.group][1].all_reduce(bucket.shard, name="hsdp grads")
        if self.shard and bucket.shard.dtype != wanted:
            bucket.shard = bucket.shard.to(wanted)
        if self.accumulate:
            bucket.total = (bucket.shard if bucket.total is None
                            else bucket.total.add_(bucket.shard))
            bucket.shard = bucket.total
        if not self.shard:
            offset = 0
            for g in bucket.grads:
                g.copy_(bucket.flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        bucket.flat, bucket.grads = None, []


def make_reducer(model: nn.Module, params: Sequence[nn.Parameter], state: NamedGroups, *,
                 distributed_optimizer: bool = False, overlap: bool = True, runner=None,
                 bucket_numel: int | None = None,
                 reduce_dtype: torch.dtype | None = None, accumulate: bool = False,
                 units: Sequence[Sequence[nn.Parameter]] = (),
                 hybrid: dict[str, tuple[CommGroup, CommGroup]] | None = None
                 ) -> GradReducer | None:
    """The run's gradient reduction, decided here once: None when every gradient group has one
    rank (nothing to reduce); sharded for the distributed optimizer (ZeRO-1); overlapped with
    the backward when ``overlap`` (``--overlap-grad-reduce``) or ZeRO-1 asks for it and the
    schedule allows it (``runner``, a pipeline's: not under zero-bubble); ``reduce_dtype``:
    the dtype the sums run in (default the gradients'); ``accumulate``, ``units`` and
    ``hybrid``: a run that shards the gradients (and parameters) too, or within groups
    (:class:`GradReducer`)."""
    if all(state.group(name).size == 1 for name in GRAD_GROUPS):
        return None
    overlapped = (overlap or distributed_optimizer) and (runner is None or runner.overlaps_dp)
    return GradReducer(model, params, state, bucket_numel, shard=distributed_optimizer,
                       overlap=overlapped, reduce_dtype=reduce_dtype, accumulate=accumulate,
                       units=units, hybrid=hybrid)
