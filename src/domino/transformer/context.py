"""The step context: what one forward/backward of a model shares with whoever runs it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from domino.transformer.late_work import LateWork


@dataclass(eq=False)
class BackwardContext:
    """Made per step (one forward and its backward) by what runs the model - a training step,
    a pipeline runtime - and passed to the model's forward (``context=``); a forward without
    one makes its own. The model's Domino stacks and its head read it; nothing is stored on
    the model.

    ``late``: weight-gradient work the layers after a stack (the LM head) leave for that
    stack's backward to run under its last all-reduces (see :class:`LateWork`).

    ``sink``: a list, for a zero-bubble pipeline: the weight-gradient work a backward has not
    run when its input gradients are done goes there (each item's ``run()``, later, as a W
    pass) instead of running.

    ``on_final``: called with a group of parameters as soon as a backward has made their
    gradients final (a block's: its norm, its op and what its exit adds, deferred GEMMs and
    sequence-parallel sums included), in the order of
    ``model.blocks()`` reversed - what a data-parallel reducer launches its buckets on.

    ``aux_loss_scale``: the gradient the auxiliary losses of the model's MoE layers get in this
    backward (their micro-batch's share of the step's objective). Read when the backward
    reaches them, so whoever runs the step may set it after the forward (a training step does,
    once the step's loss tokens are counted).
    """

    late: LateWork = field(default_factory=LateWork)
    sink: list | None = None
    on_final: Callable[[Sequence[torch.nn.Parameter]], None] | None = None
    aux_loss_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.on_final is not None and self.sink is not None:
            raise ValueError("BackwardContext: on_final needs the weight gradients run in the "
                             "backward, not sunk; give one of on_final and sink")
