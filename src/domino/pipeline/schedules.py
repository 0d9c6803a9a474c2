"""Pipeline schedules: the order in which each stage runs forward (F), backward (B) and, for
zero-bubble, input-gradient (B) and weight-gradient (W) passes over *pipeline micro-batches*.

Words: a global batch is cut into ``pipeline micro-batches`` (global batch / (micro-batch size x
DP)); each one travels through the stages. Inside a stage the Domino plan may split a pipeline
micro-batch again into ``Domino micro-batches``: a different thing, invisible to the pipeline.

With ``V`` model chunks per rank (interleaved 1F1B), virtual stage ``k`` of the ``P x V`` lives on
rank ``k % P`` as its chunk ``k // P``; activations flow k -> k+1 and gradients k+1 -> k.

Every schedule is a list of :class:`Action` per rank. :func:`simulate` runs those lists against
their data dependencies with given pass costs: it proves a list is feasible (no deadlock), gives
its theoretical bubble, the activations each rank holds at most, and the order of messages on
each link (which must be the order both ends use: NCCL matches point-to-point messages in order).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


@dataclass(frozen=True, order=True)
class Action:
    """``kind`` F, B (full backward; input gradient only under zero-bubble) or W (deferred
    weight gradients), of pipeline micro-batch ``mb`` on this rank's model chunk ``chunk``."""

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def check_schedule(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> None:
    """ValueError (saying what to change) unless ``schedule`` can run this pipeline."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if stages < 1 or micro_batches < 1 or chunks < 1:
        raise ValueError(f"a pipeline needs >= 1 stage, pipeline micro-batch and chunk; got "
                         f"{stages}, {micro_batches}, {chunks}")
    if schedule == "interleaved":
        if chunks < 2:
            raise ValueError("the interleaved schedule needs virtual stages: set "
                             "--num-layers-per-virtual-pipeline-stage so each rank holds >= 2 "
                             "model chunks")
        if micro_batches % stages:
            raise ValueError(
                f"interleaved 1F1B sends pipeline micro-batches through the stages in groups of "
                f"{stages} (the stage count): {micro_batches} pipeline micro-batches per step is "
                f"not a multiple of {stages}; change --global-batch-size (pipeline micro-batches "
                "= global batch / (micro-batch size x DP))")
    elif chunks != 1:
        raise ValueError(f"virtual pipeline stages ({chunks} chunks per rank) need the "
                         "interleaved schedule (--pipeline-schedule interleaved)")


def build(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> list[list[Action]]:
    """The action list of every rank."""
    check_schedule(schedule, stages, micro_batches, chunks)
    if schedule == "gpipe":
        return [[Action("F", m) for m in range(micro_batches)]
                + [Action("B", m) for m in range(micro_batches)] for _ in range(stages)]
    if schedule == "1f1b":
        return [_one_f_one_b(stages, micro_batches, r) for r in range(stages)]
    if schedule == "interleaved":
        return [_interleaved(stages, micro_batches, chunks, r) for r in range(stages)]
    return _zero_bubble(stages, micro_batches)


def _one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """Warm up with p - rank - 1 forwards, then alternate F and B, then drain the B's: a rank
    holds at most p - rank pipeline micro-batches' activations."""
    warm = min(p - rank - 1, m)
    out = [Action("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", warm + i), Action("B", i)]
    out += [Action("B", i) for i in range(m - warm, m)]
    return out


def _interleaved(p: int, m: int, v: int, rank: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., 2021): forwards walk the chunks in groups of p
    pipeline micro-batches, backwards walk them in reverse; a deeper warm-up keeps the stages
    fed."""
    total = m * v

    def fwd(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warm = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    out = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        out += [fwd(warm + k), bwd(k)]
    out += [bwd(k) for k in range(total - warm, total)]
    return out


def _zero_bubble(p: int, m: int) -> list[list[Action]]:
    """Zero-bubble in its H1 shape (Qi et al., 2023): the backward is split into the input
    gradient B, which the previous stage waits for, and the weight gradients W, which nobody
    waits for. Listed by a unit-cost simulation: at each tick a free rank runs a ready B first
    (the critical path), else a forward, else a pending W, so W work fills what would be
    bubble. A forward waits while p - rank pipeline micro-batches await their W, which keeps
    the activation memory of 1F1B (a W frees what its micro-batch kept)."""
    finish: dict[tuple[str, int, int], int] = {}
    lists: list[list[Action]] = [[] for _ in range(p)]
    next_f, next_b, next_w = [0] * p, [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    total, t = 3 * m * p, 0
    while sum(len(x) for x in lists) < total:
        for r in range(p):
            if finish.get(("busy", r, 0), 0) > t:
                continue
            kind = None
            b, f = next_b[r], next_f[r]
            if b < f:
                dep = finish.get(("B", r + 1, b)) if r < p - 1 else finish.get(("F", r, b))
                if dep is not None and dep <= t:
                    kind, mb = "B", b
            if kind is None and f < m and f - next_w[r] < p - r:
                dep = finish.get(("F", r - 1, f)) if r > 0 else 0
                if dep is not None and dep <= t:
                    kind, mb = "F", f
            if kind is None and pending_w[r]:
                kind, mb = "W", pending_w[r][0]
            if kind is None:
                continue
            lists[r].append(Action(kind, mb))
            finish[(kind, r, mb)] = finish[("busy", r, 0)] = t + 1
            if kind == "F":
                next_f[r] += 1
            elif kind == "B":
                next_b[r] += 1
                pending_w[r].append(mb)
            else:
                pending_w[r].pop(0)
                next_w[r] += 1
        t += 1
    return lists


# ---- simulation ---------------------------------------------------------------------------------


@dataclass
class Simulation:
    """What running the lists with fixed pass costs gives."""

    makespan: float
    busy: list[float]  # per rank
    peak_activations: list[int]  # per rank: pipeline micro-batches (x chunks) held at once
    links: dict[tuple[int, int], list[tuple[str, int, int]]] = field(default_factory=dict)
    starts: dict[tuple[int, Action], float] = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        """Idle share of the ranks' time: 1 - busy / (ranks x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def simulate(lists: list[list[Action]], chunks: int = 1, cost_f: float = 1.0,
             cost_b: float = 2.0, cost_w: float = 0.0, split_backward: bool = False,
             ) -> Simulation:
    """Run every rank's list in order, each action starting when its inputs exist; ValueError
    if the lists deadlock. Under ``split_backward`` B costs ``cost_b - cost_w`` and W ``cost_w``
    (the weight gradients leave the backward); otherwise W actions must not appear."""
    p = len(lists)
    last = p * chunks - 1
    finish: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> time
    pos, clock = [0] * p, [0.0] * p
    busy = [0.0] * p
    held, peak = [0] * p, [0] * p
    links: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    starts: dict[tuple[int, Action], float] = {}
    heap = [(0.0, r) for r in range(p)]
    remaining = sum(len(x) for x in lists)
    stalled = 0
    while remaining:
        if not heap or stalled > 4 * p + 8:
            stuck = {r: str(lists[r][pos[r]]) for r in range(p) if pos[r] < len(lists[r])}
            raise ValueError(f"pipeline schedule deadlocks: ranks wait forever at {stuck}")
        t, r = heapq.heappop(heap)
        if pos[r] >= len(lists[r]):
            continue
        a = lists[r][pos[r]]
        k = a.chunk * p + r  # virtual stage
        if a.kind == "F":
            dep = 0.0 if k == 0 else finish.get(("F", k - 1, a.mb))
            cost = cost_f
        elif a.kind == "B":
            dep = finish.get(("F", k, a.mb)) if k == last else finish.get(("B", k + 1, a.mb))
            if dep is not None and ("F", k, a.mb) not in finish:
                dep = None
            cost = cost_b - (cost_w if split_backward else 0.0)
        elif a.kind == "W":
            if not split_backward:
                raise ValueError("W actions need split_backward=True")
            dep = finish.get(("B", k, a.mb))
            cost = cost_w
        else:
            raise ValueError(f"unknown action {a}")
        if dep is None:  # not ready: retry once someone else has moved on
            later = min((c for c in clock if c > t), default=t + cost_f)
            heapq.heappush(heap, (max(later, t), r))
            stalled += 1
            continue
        stalled = 0
        start = max(t, dep)
        end = start + cost
        starts[(r, a)] = start
        finish[(a.kind, k, a.mb)] = end
        busy[r] += cost
        clock[r] = end
        pos[r] += 1
        remaining -= 1
        if a.kind == "F":
            held[r] += 1
            peak[r] = max(peak[r], held[r])
            if k < last:
                links.setdefault((r, (k + 1) % p), []).append(("act", k, a.mb))
        elif a.kind == "B":
            if not split_backward:
                held[r] -= 1
            if k > 0:
                links.setdefault((r, (k - 1) % p), []).append(("grad", k, a.mb))
        else:
            held[r] -= 1
        heapq.heappush(heap, (end, r))
    return Simulation(max(clock), busy, peak, links, starts)


def consumption_order(lists: list[list[Action]], chunks: int = 1
                      ) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """Per link (src, dst), the messages in the order the receiving rank's list consumes them
    (what must equal the order the sender sends them in)."""
    p = len(lists)
    last = p * chunks - 1
    out: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for r, actions in enumerate(lists):
        for a in actions:
            k = a.chunk * p + r
            if a.kind == "F" and k > 0:
                out.setdefault(((k - 1) % p, r), []).append(("act", k - 1, a.mb))
            elif a.kind == "B" and k < last:
                out.setdefault(((k + 1) % p, r), []).append(("grad", k + 1, a.mb))
    return out


def theoretical_bubble(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The schedule's bubble with a backward costing two forwards (and, for zero-bubble, half of
    that being weight gradients) and free communication."""
    lists = build(schedule, stages, micro_batches, chunks)
    zb = schedule == "zero_bubble"
    return simulate(lists, chunks, cost_f=1.0, cost_b=2.0, cost_w=1.0 if zb else 0.0,
                    split_backward=zb).bubble
