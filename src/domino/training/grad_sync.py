"""Data-parallel gradient reduction overlapped with the backward schedule.

Gradients are summed over the DP group in buckets (a few MiB each, parameters in backward order:
last layers first). A bucket is launched, asynchronously, as soon as every parameter in it has its
final gradient - which the Domino schedule reports block by block (the ``on_final`` of the
step's :class:`~domino.transformer.BackwardContext`: a block's norm, op and exit bias are done,
including its deferred weight-gradient GEMMs) - so its all-reduce runs under the backward of the
layers before it. The model says which blocks there are (``model.blocks()``). Parameters outside
the transformer blocks (embedding, final norm, LM head) are launched when the backward ends. A
pipeline (``PipelineRunner.step(reducer=...)``) gives :meth:`GradReducer.context` to the forward
of each model chunk's last backward, except under zero-bubble, whose W passes finish the weight
gradients later: there everything is launched at :meth:`GradReducer.finish`, which waits for
every bucket before the optimizer step.

Only the last micro-step of gradient accumulation reduces (:meth:`GradReducer.armed`, whose
context goes to that micro-step's forward): earlier ones only add into ``.grad``. Every DP rank
launches the same buckets in the same order (blocks finish last-first whatever the timing),
which collectives on one group require.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from domino.tensor_parallel import CommGroup
from domino.tensor_parallel.comm import Handle
from domino.training.optim import BUCKET_NUMEL
from domino.transformer.context import BackwardContext

MIN_BUCKET_NUMEL = 1 << 16


@dataclass(eq=False)
class _Bucket:
    params: list[nn.Parameter]
    waiting: int = 0  # parameters whose gradient is not final yet
    flat: torch.Tensor | None = None
    handle: Handle | None = None
    grads: list[torch.Tensor] = field(default_factory=list)
    shard: torch.Tensor | None = None  # sharded: this rank's chunk of the summed gradients

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
    """Buckets of ``model``'s ``params`` reduced over ``dp`` as they become final."""

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter], dp: CommGroup,
                 bucket_numel: int | None = None, shard: bool = False) -> None:
        """``shard`` (a distributed optimizer): reduce-scatter each bucket instead, every DP rank
        keeping its chunk of the sums (:attr:`_Bucket.shard`); ``.grad`` is left unreduced."""
        self.dp, self.shard = dp, shard
        if bucket_numel is None:
            # At least ~4 buckets, or the last one would wait for the whole backward; few enough
            # that launches stay cheap.
            total = sum(p.numel() for p in params)
            bucket_numel = max(MIN_BUCKET_NUMEL, min(BUCKET_NUMEL, total // 4))
        self.buckets: list[_Bucket] = []
        size = 0
        for p in backward_order(model, params):
            last = self.buckets[-1] if self.buckets else None
            if last is None or size + p.numel() > bucket_numel or p.dtype != last.params[0].dtype:
                self.buckets.append(_Bucket([]))
                size = 0
            self.buckets[-1].params.append(p)
            size += p.numel()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._ready: set[int] = set()
        self._armed = False
        self.launched_early = 0

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

    def begin(self) -> None:
        """Start a step's reduction (:meth:`armed` does; call it directly to reduce everything
        at :meth:`finish`, without overlap)."""
        self._ready.clear()
        for b in self.buckets:
            b.waiting, b.flat, b.handle, b.grads, b.shard = len(b.params), None, None, [], None
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

    def _launch(self, bucket: _Bucket) -> None:
        grads = []
        for p in bucket.params:
            if p.grad is None:  # unused this step: every rank must still send the same buffer
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        bucket.grads = grads
        if not self.shard:
            bucket.flat = torch.cat([g.reshape(-1) for g in grads])
            bucket.handle = self.dp.all_reduce(bucket.flat, async_op=True, name="dp grads")
            return
        size = self.dp.size
        pad = bucket.padded(size) - bucket.numel
        parts = [g.reshape(-1) for g in grads]
        if pad:
            parts.append(grads[0].new_zeros(pad))
        bucket.flat = torch.cat(parts)
        bucket.shard = bucket.flat.new_empty(bucket.flat.numel() // size)
        bucket.handle = self.dp.reduce_scatter(bucket.shard, bucket.flat, async_op=True,
                                               name="dp grads (reduce-scatter)")

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
        for bucket in self.buckets:
            bucket.handle.wait()
            offset = 0
            if not self.shard:
                for g in bucket.grads:
                    g.copy_(bucket.flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
            bucket.flat, bucket.grads = None, []
