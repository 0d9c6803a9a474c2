"""Where a schedule tells a stack's parameter owner which blocks it is about to use and which
it is done with: the events a fully sharded data-parallel run (``training.fsdp``) gathers and
frees its units of parameters on, placed by the passes themselves between Domino pieces.

Block j is in use, in a forward, from ``local(j, 0)`` (its norm) to the end of
``local(j + 1, M - 1)`` (its exit's residual add, post-norm and bias run there); in a backward
from ``local^T(j + 1, 0)`` to the end of ``local^T(j, M - 1)``. The weight-gradient GEMMs a
schedule defers past that window need no weight, only its shape.

A pipeline runs one forward and one backward through a stack per pipeline micro-batch, in the
schedule's order: it also says where a step begins and which backward is the step's last
through the stack (``pipeline_step``, ``pipeline_backward``), so an owner may keep its units
from the step's first forward to that backward.
"""

from __future__ import annotations

from typing import Protocol


class ParamUnits(Protocol):
    """The owner of a stack's parameters, told where the passes are (block indices are the
    stack's). Every call must be made on every rank of the owner's groups in the same order,
    which the passes' fixed piece order gives."""

    def forward_start(self, graph: bool) -> None:
        """A forward begins (``graph``: a training one, whose backward follows)."""

    def forward_enter(self, j: int) -> None:
        """Block j is about to be used by the forward."""

    def forward_leave(self, j: int) -> None:
        """The forward is done with block j."""

    def backward_enter(self, j: int) -> None:
        """Block j is about to be used by the backward."""

    def backward_leave(self, j: int) -> None:
        """The backward is done with block j (deferred weight gradients aside)."""

    def pipeline_step(self) -> None:
        """A pipeline step begins (its first forward through the stack is still to come)."""

    def pipeline_backward(self, final: bool) -> None:
        """A pipeline runs a backward through the stack next; ``final``: the step's last."""


class NoUnits:
    """Parameters that are always there (every run but a fully sharded one)."""

    def forward_start(self, graph: bool) -> None:
        pass

    def forward_enter(self, j: int) -> None:
        pass

    def forward_leave(self, j: int) -> None:
        pass

    def backward_enter(self, j: int) -> None:
        pass

    def backward_leave(self, j: int) -> None:
        pass

    def pipeline_step(self) -> None:
        pass

    def pipeline_backward(self, final: bool) -> None:
        pass


NO_UNITS = NoUnits()
