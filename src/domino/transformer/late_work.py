"""Late work: gradient work that is complete but need not run yet.

The LM head's weight-gradient GEMM and the embedding's weight gradient are handed to a stack's
backward, which runs them under its last input-gradient all-reduces (nothing after the stack is
left to hide those).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from domino.precision import zeros_grad


class LateWork:
    """Gradient work that is complete but need not run yet (items with ``run()``), handed to a
    stack's backward by what follows the stack (the LM head's weight-gradient GEMM) and by the
    stack's own prologue (the embedding's): the schedule runs it under its last all-reduces,
    where nothing else is left to hide them.

    Their gradients are *staged*: each parameter's parts of one backward pass (the head's row
    chunks, every micro-batch's embedding gradient: a tied word table gets both) are summed in a
    scratch tensor in a fixed order - items run oldest first - and added to ``.grad`` once, when
    the pass's late work is done (:meth:`flush`). So the result does not depend on where the
    timing put the split, and accumulating micro-steps adds one tensor per step, as data
    parallelism sums them: DP and gradient accumulation agree bit for bit.

    The first item or stage of a backward pass also queues an autograd-engine callback that
    runs and flushes whatever is left when the pass ends, so nothing is lost when no stack
    backward follows (e.g. ``torch.autograd.grad`` on the head alone).
    """

    def __init__(self) -> None:
        self._items: deque = deque()
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._armed = False

    def __len__(self) -> int:
        return len(self._items)

    def _arm(self) -> None:
        if not self._armed and torch._C._current_graph_task_id() != -1:
            # The engine's end-of-backward callback (what DDP uses to finish its buckets).
            torch.autograd.Variable._execution_engine.queue_callback(self.drain)
            self._armed = True

    def add(self, item) -> None:
        self._items.append(item)
        self._arm()

    def space(self) -> dict:
        """This backward pass's staging space (for items that stage when they run, which may
        be after :meth:`take_all` handed the pass to a pipeline's W pass)."""
        return self._staged

    def stage(self, param: torch.Tensor, space: dict | None = None) -> torch.Tensor:
        """The scratch gradient of ``param`` in ``space`` (default: this backward pass's),
        zeros at first use."""
        space = self._staged if space is None else space
        entry = space.get(id(param))
        if entry is None:
            entry = (param, zeros_grad(param))
            space[id(param)] = entry
            self._arm()
        return entry[1]

    def pop(self):
        """The oldest item, or None."""
        return self._items.popleft() if self._items else None

    def take_all(self) -> list:
        """Every item, and a last one that flushes the staged gradients (a zero-bubble
        pipeline's W pass runs them later)."""
        items, self._items = list(self._items), deque()
        # This pass's scratches go with its items: a later pass stages into fresh ones.
        staged, self._staged = self._staged, {}
        return [*items, Task(lambda: add_staged(staged))] if items or staged else items

    def flush(self) -> None:
        """Add every staged gradient to its parameter's ``.grad``."""
        staged, self._staged = self._staged, {}
        add_staged(staged)

    def drain(self) -> None:
        """Run every item (oldest first), then :meth:`flush`."""
        self._armed = False
        while self._items:
            self._items.popleft().run()
        self.flush()


def add_staged(staged: dict) -> None:
    """Add each staged (parameter, gradient) of ``staged`` to the parameter's ``.grad``."""
    for param, grad in staged.values():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


@dataclass(eq=False)
class Task:
    """A deferred piece of backward work (``run()`` once)."""

    fn: Callable[[], None]

    def run(self) -> None:
        self.fn()
