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
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from domino.parallel_state import ParallelState
from domino.transformer.schedule import Plan
from domino.transformer.stack import DominoTransformer

__all__ = ["autotune", "candidate_plans", "choose", "plan_name"]

_SHORT = {"none": "none", "intra_layer": "intra", "cross_layer": "cross"}


def plan_name(plan: Plan) -> str:
    """``m<micro-batches>:<none|intra|cross>:c<column chunks>``, e.g. ``m2:cross:c1``."""
    return f"m{plan.micro_batches}:{_SHORT[plan.overlap]}:c{plan.column_chunks}"


def candidate_plans(batch_size: int, max_micro_batches: int = 4,
                    column_chunks: Sequence[int] = (1, 2)) -> list[Plan]:
    """Sync TP, then cross-layer Domino with 2..max micro-batches (at most ``batch_size``) times
    each column-chunk count."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    plans = [Plan(1, "none", 1)]
    for m in range(2, min(max_micro_batches, batch_size) + 1):
        plans += [Plan(m, "cross_layer", c) for c in column_chunks]
    return plans


def choose(times: dict[Plan, list[float]]) -> Plan:
    """The plan with the lowest median time; ties go to the earlier (simpler) candidate."""
    if not times or any(not t for t in times.values()):
        raise ValueError("choose() needs at least one timing per candidate plan.")
    return min(times, key=lambda p: statistics.median(times[p]))


def _stacks(model: nn.Module) -> list[DominoTransformer]:
    stacks = [m for m in model.modules() if isinstance(m, DominoTransformer)]
    if not stacks:
        raise ValueError("autotune: the model has no DominoTransformer to schedule.")
    return stacks


def autotune(model: nn.Module, step: Callable[[], object], state: ParallelState,
             candidates: Sequence[Plan], warmup: int = 1, trials: int = 3,
             ) -> tuple[Plan, dict[Plan, list[float]]]:
    """Time ``step()`` (one forward + backward of ``model``) under each candidate plan and set
    the fastest on every DominoTransformer in ``model``.

    Returns the chosen plan and, per candidate, the measured round times (max over all ranks).
    Every rank of the default process group must call this with the same candidates.
    """
    if not candidates:
        raise ValueError("autotune needs at least one candidate plan.")
    if warmup < 0 or trials < 1:
        raise ValueError(f"warmup={warmup} must be >= 0 and trials={trials} >= 1.")
    stacks = _stacks(model)
    device = state.device
    distributed = dist.is_available() and dist.is_initialized()
    saved_rng = (torch.get_rng_state(), state.rng.state_dict(),
                 torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    saved_plans = [s.plan for s in stacks]
    rows: list[list[float]] = [[] for _ in candidates]
    try:
        for r in range(warmup + trials):
            k = r % len(candidates)  # rotate the order: no plan always runs first
            for i in [*range(k, len(candidates)), *range(k)]:
                for s in stacks:
                    s.plan = candidates[i]
                if distributed:
                    dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if r >= warmup:
                    rows[i].append(time.perf_counter() - t0)
    except BaseException:
        for s, p in zip(stacks, saved_plans, strict=True):
            s.plan = p
        raise
    finally:
        model.zero_grad(set_to_none=True)
        torch.set_rng_state(saved_rng[0])
        state.rng.load_state_dict(saved_rng[1])
        if saved_rng[2] is not None:
            torch.cuda.set_rng_state(saved_rng[2], device)
    table = torch.tensor(rows, dtype=torch.float64)
    if distributed:
        table = table.to(device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)  # identical table -> identical choice
    times = {plan: table[i].tolist() for i, plan in enumerate(candidates)}
    best = choose(times)
    for s in stacks:
        s.plan = best
    return best, times
