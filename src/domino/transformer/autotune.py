"""Pick the fastest Domino plan for this model, batch, link and machine by timing the candidates.

Which split hides the most communication depends on what no config can know: the link's speed,
the compute speed, the CPU that moving bytes costs. ``autotune`` times fwd+bwd steps of every
candidate plan, interleaved round by round, takes for each round the slowest rank's time (the
group moves at that pace), and picks the lowest median. Every rank reduces the same table, so all
ranks choose the same plan (different plans would issue different collectives and hang). Random
number generator states and gradients are restored, so the run that follows is exactly the run
that would have used the chosen plan from the start.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from domino.parallel_state import ParallelState
from domino.plan import SYNC, Plan
from domino.timing import time_rotated
from domino.transformer.stack import set_plan, stacks_of, using_plan

__all__ = ["autotune", "candidate_plans", "choose"]


def candidate_plans(batch_size: int, max_micro_batches: int = 4,
                    column_chunks: Sequence[int] = (1, 2)) -> list[Plan]:
    """Sync TP, then cross-layer Domino with 2..max micro-batches (at most ``batch_size``) times
    each column-chunk count."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    plans = [SYNC]
    for m in range(2, min(max_micro_batches, batch_size) + 1):
        plans += [Plan(m, "cross_layer", c) for c in column_chunks]
    return plans


def choose(times: dict[Plan, list[float]]) -> Plan:
    """The plan with the lowest median time; ties go to the earlier (simpler) candidate."""
    if not times or any(not t for t in times.values()):
        raise ValueError("choose() needs at least one timing per candidate plan.")
    return min(times, key=lambda p: statistics.median(times[p]))


def autotune(model: nn.Module, step: Callable[[], object], state: ParallelState,
             candidates: Sequence[Plan], warmup: int = 1, trials: int = 3,
             ) -> tuple[Plan, dict[Plan, list[float]]]:
    """Time ``step()`` (one forward + backward of ``model``) under each candidate plan, then put
    every DominoTransformer in ``model`` on the fastest (:func:`set_plan`: the one change this
    makes to the model; on an error the plans are left as they were).

    Returns the chosen plan and, per candidate, the measured round times (max over all ranks).
    Every rank of ``state.world`` must call this with the same candidates.
    """
    if not candidates:
        raise ValueError("autotune needs at least one candidate plan.")
    if warmup < 0 or trials < 1:
        raise ValueError(f"warmup={warmup} must be >= 0 and trials={trials} >= 1.")
    stacks_of(model)  # fail before timing anything
    device = state.device
    saved_rng = (torch.get_rng_state(), state.rng.state_dict(),
                 torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    def run(i: int) -> None:
        with using_plan(model, candidates[i]):
            step()

    try:
        rows = time_rotated(len(candidates), run, warmup, trials, state.world, device)
    finally:
        model.zero_grad(set_to_none=True)
        torch.set_rng_state(saved_rng[0])
        state.rng.load_state_dict(saved_rng[1])
        if saved_rng[2] is not None:
            torch.cuda.set_rng_state(saved_rng[2], device)
    table = torch.tensor(rows, dtype=torch.float64, device=device)
    state.world.all_reduce(table, op=dist.ReduceOp.MAX, name="autotune")  # same table, same pick
    times = {plan: table[i].tolist() for i, plan in enumerate(candidates)}
    best = choose(times)
    set_plan(model, best)
    return best, times
