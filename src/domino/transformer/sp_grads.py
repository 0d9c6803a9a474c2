"""Summing the partial gradients of replicated parameters over TP.

Under sequence parallelism the replicated parameters applied to the sequence shards (norms, the
biases the blocks' exits add, the final norm, the prologue's position tables) see only this
rank's shard, so each rank holds a partial gradient. So do LoRA's replicated factors at any TP
size (``Placement.tp_partial_grad``: see ``tensor_parallel.lora``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.placement import placement_of
from domino.transformer.exits import Exit
from domino.transformer.layer import Block


def partial_grads(block: Block) -> list[torch.Tensor]:
    """The block's parameters whose gradient each TP rank holds only a share of at any TP
    size (LoRA's replicated factors)."""
    return [p for p in block.op.parameters() if placement_of(p).tp_partial_grad]


def needed(group: CommGroup, blocks: list[Block], sequence_parallel: bool) -> bool:
    """Does a backward over ``blocks`` have partial gradients to sum over ``group``?"""
    return sequence_parallel or (group.size > 1 and any(partial_grads(b) for b in blocks))


class ShardGrads:
    """The replicated parameters that get partial gradients: under sequence parallelism
    (``sequence_parallel``) those that see only this rank's sequence shard (the blocks' norms
    and what their exits add, e.g. row-parallel biases; the final norm; the prologue's position
    and token-type tables), and LoRA's replicated factors (:func:`partial_grads`). One backward
    pass's
    parts are summed over the TP group - a block's, asynchronously, as soon as its local
    backwards are done, the rest when the pass ends - and only then added to what ``.grad``
    held before the pass, so accumulating micro-steps adds each pass's sum once. ``on_final``
    hears of a block's parameters once they are final (deferred GEMMs included) and summed, in
    the order blocks became final."""

    def __init__(self, group: CommGroup, blocks: list[Block], exits: list[Exit], final_norm,
                 prologue, on_final: Callable[[list[torch.Tensor]], None] | None,
                 micro_batches: int, sequence_parallel: bool = True) -> None:
        self.group, self.blocks, self.on_final = group, blocks, on_final
        sp = sequence_parallel
        self.per_block = [[*(b.norm_parameters() if sp else []),
                           *(e.replicated_parameters() if sp else []), *partial_grads(b)]
                          for b, e in zip(blocks, exits, strict=True)]
        self.tail = [*(final_norm.parameters() if final_norm is not None and sp else []),
                     *(p for p in (prologue.parameters() if prologue is not None and sp else [])
                       if placement_of(p).shard != "tp")]
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for p in [*(p for ps in self.per_block for p in ps), *self.tail]:
            if p.requires_grad and id(p) not in self.before:
                self.before[id(p)] = (p, p.grad)
                p.grad = None
        self.locals_left = [micro_batches] * len(blocks)
        self.inflight: deque = deque()  # (block index or None, params, flat sum, handle)
        self.summed: set[int] = set()
        self.final: deque[int] = deque()  # final blocks not reported yet, in order

    def _launch(self, j: int | None, params: list[torch.Tensor]) -> None:
        params = [p for p in params if p.grad is not None and id(p) in self.before]
        flat = torch.cat([p.grad.reshape(-1) for p in params]) if params else None
        handle = (self.group.all_reduce(flat, async_op=True, name="sp param grads")
                  if params else None)
        self.inflight.append((j, params, flat, handle))

    def _settle(self, wait: bool) -> None:
        while self.inflight and (wait or self.inflight[0][3] is None
                                 or self.inflight[0][3].ready()):
            j, params, flat, handle = self.inflight.popleft()
            if handle is not None:
                handle.wait()
            offset = 0
            for p in params:
                summed = flat[offset:offset + p.numel()].view_as(p.grad)
                offset += p.numel()
                _, old = self.before.pop(id(p))
                if old is None:
                    p.grad.copy_(summed)
                else:  # keep the tensor .grad held before (a reducer may hold it)
                    p.grad = old.add_(summed)
            if j is not None:
                self.summed.add(j)
        while self.final and self.final[0] in self.summed:
            j = self.final.popleft()
            if self.on_final is not None:
                self.on_final(self.blocks[j].parameters())

    def local_done(self, j: int) -> None:
        """One of block j's local backwards (its norm's) is done: the last launches its sum
        (its exit's bias was done before, by the next piece's local backward)."""
        self.locals_left[j] -= 1
        if self.locals_left[j] == 0:
            self._launch(j, self.per_block[j])
        self._settle(wait=False)

    def block_final(self, j: int) -> None:
        self.final.append(j)
        self._settle(wait=False)

    def finish(self) -> None:
        """The input gradients are done: sum what is left and wait for every sum. (A zero-bubble
        W pass may still run deferred GEMMs later; they touch none of these parameters.)"""
        self._launch(None, self.tail)
        self._settle(wait=True)
        for p, old in self.before.values():  # no gradient this pass: .grad is as before
            p.grad = old
        self.before.clear()
