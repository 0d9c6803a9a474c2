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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from domino.parallel_state import ParallelState
from domino.plan import SYNC, Plan
from domino.timing import time_rotated
from domino.transformer.moe.op import moe_ops
from domino.transformer.stack import set_plan, stacks_of, using_plan

__all__ = ["AUTO_MARGIN", "Regime", "autotune", "candidate_plans", "choose", "regime_of"]

# A split must beat the simpler plans by this much to be chosen: where communication is
# negligible the candidates differ by noise, and splitting only costs (launches, smaller GEMMs).
AUTO_MARGIN = 0.03
NEGLIGIBLE_COMM = 0.05  # sync's exposed comm under this share of the comm-free step
HOST_BOUND_CPU = 0.5  # an all-reduce busy on the host's CPUs this share of its time


@dataclass(frozen=True)
class Regime:
    """What limits the step: ``negligible`` (communication too small to matter: no split),
    ``host-bound`` (moving bytes costs the host CPU that compute needs - loopback, shared memory
    on a CPU host: overlap hides only the waiting, few splits win), or ``link-bound`` (the link,
    not the CPU, is slow: overlap hides it, more micro-batches and column chunks win)."""

    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.name} ({self.why})"


def regime_of(t_sync: float, t_nocomm: float | None = None, comm_cpu_share: float | None = None,
              t_best_split: float | None = None) -> Regime:
    """Classify from measured times: sync and comm-free step medians, the share of an
    all-reduce's wall time the host's CPUs are busy (the link probe's cpu_s / seconds), and the
    best split's median (what autotune knows when it has no comm-free run)."""
    if t_nocomm is not None and t_nocomm > 0:
        share = (t_sync - t_nocomm) / t_nocomm
        if share < NEGLIGIBLE_COMM:
            return Regime("negligible", f"sync exposes {share:.0%} of the comm-free step")
        exposed = f"sync exposes {share:.0%} of the comm-free step"
    elif t_best_split is not None:
        gain = t_sync / t_best_split - 1.0
        if gain < AUTO_MARGIN:
            return Regime("negligible", f"the best split gains {gain:.1%} over sync")
        exposed = f"the best split gains {gain:.0%} over sync"
    else:
        raise ValueError("regime_of needs t_nocomm or t_best_split")
    if comm_cpu_share is not None and comm_cpu_share >= HOST_BOUND_CPU:
        return Regime("host-bound", f"{exposed}; a transfer keeps the host's CPUs busy "
                      f"{comm_cpu_share:.0%} of its time")
    cpu = "" if comm_cpu_share is None else (
        f"; a transfer keeps the host's CPUs busy {comm_cpu_share:.0%} of its time")
    return Regime("link-bound", exposed + cpu)


def candidate_plans(batch_size: int, max_micro_batches: int = 4,
                    column_chunks: Sequence[int] = (1, 2), groups: Sequence[int] = ()
                    ) -> list[Plan]:
    """Sync TP, then one micro-batch in each of ``groups`` chunks (``m1:cross:cK``: an MoE
    layer with expert parallelism then pipelines its all-to-alls with its groups of experts
    without splitting the batch), then cross-layer Domino with 2..max micro-batches (at most
    ``batch_size``) times each column-chunk count."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    plans = [SYNC] + [Plan(1, "cross_layer", c) for c in groups if c > 1]
    for m in range(2, min(max_micro_batches, batch_size) + 1):
        plans += [Plan(m, "cross_layer", c) for c in column_chunks]
    return plans


def moe_groups(num_experts: int | None, ep_size: int) -> tuple[int, ...]:
    """The group counts :func:`candidate_plans` tries with one micro-batch for MoE layers of
    ``num_experts`` experts over ``ep_size`` ranks: 2 and 4 where a rank holds that many
    experts; none without expert parallelism (nothing to pipeline)."""
    if not num_experts or ep_size < 2:
        return ()
    return tuple(c for c in (2, 4) if c <= num_experts // ep_size)


def choose(times: dict[Plan, list[float]], margin: float = AUTO_MARGIN) -> Plan:
    """The first candidate (simplest first, as :func:`candidate_plans` orders them) whose median
    time is within ``margin`` of the lowest median: a split has to win clearly to be chosen, so
    where communication is negligible the result is no split."""
    if not times or any(not t for t in times.values()):
        raise ValueError("choose() needs at least one timing per candidate plan.")
    medians = {p: statistics.median(t) for p, t in times.items()}
    best = min(medians.values())
    return next(p for p, t in medians.items() if t <= best * (1.0 + margin))


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
    ops = moe_ops(model)
    for op in ops:
        op.close_run()
    saved_stats = [(op.counts.clone(), op.sums.clone()) for op in ops]

    def run(i: int) -> None:
        with using_plan(model, candidates[i]):
            step()

    try:
        rows = time_rotated(len(candidates), run, warmup, trials, state.world, device)
    finally:
        model.zero_grad(set_to_none=True)
        for op, (counts, sums) in zip(ops, saved_stats, strict=True):
            op.counts, op.sums = counts, sums  # timing runs add no router statistics
            op.run = None
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
