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
                             "num_layers_per_virtual_pipeline_stage so each rank holds >= 2 "
                             "model chunks")
        if micro_batches % stages:
            raise ValueError(
                f"interleaved 1F1B sends pipeline micro-batches through the stages in groups of "
                f"{stages} (the stage count): {micro_batches} pipeline micro-batches per step is "
                f"not a multiple of {stages}; change global_batch_size (pipeline micro-batches "
                "= global batch / (micro-batch size x DP))")
    elif chunks != 1:
        raise ValueError(f"virtual pipeline stages ({chunks} chunks per rank) need the "
                         "interleaved schedule (pipeline_schedule='interleaved')")


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
    return _Simulator(lists, chunks, cost_f, cost_b, cost_w, split_backward).run()


class _Simulator:
    """One run of :func:`simulate`: each rank's clock and place in its list, when each pass
    finished, what each rank holds and each link carried."""

    def __init__(self, lists: list[list[Action]], chunks: int, cost_f: float, cost_b: float,
                 cost_w: float, split_backward: bool) -> None:
        self.lists, self.p = lists, len(lists)
        self.last = self.p * chunks - 1
        self.cost_f, self.cost_w, self.split = cost_f, cost_w, split_backward
        self.cost_b = cost_b - (cost_w if split_backward else 0.0)
        self.finish: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> t
        self.pos, self.clock, self.busy = [0] * self.p, [0.0] * self.p, [0.0] * self.p
        self.held, self.peak = [0] * self.p, [0] * self.p
        self.links: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        self.starts: dict[tuple[int, Action], float] = {}

    def run(self) -> Simulation:
        """Ranks take turns by their clocks; one whose next action's input does not exist yet
        retries once another rank has moved on."""
        heap = [(0.0, r) for r in range(self.p)]
        remaining = sum(len(x) for x in self.lists)
        stalled = 0
        while remaining:
            if not heap or stalled > 4 * self.p + 8:
                stuck = {r: str(self.lists[r][self.pos[r]]) for r in range(self.p)
                         if self.pos[r] < len(self.lists[r])}
                raise ValueError(f"pipeline schedule deadlocks: ranks wait forever at {stuck}")
            t, r = heapq.heappop(heap)
            if self.pos[r] >= len(self.lists[r]):
                continue
            a = self.lists[r][self.pos[r]]
            dep, cost = self.needs(r, a)
            if dep is None:  # not ready: retry once someone else has moved on
                later = min((c for c in self.clock if c > t), default=t + self.cost_f)
                heapq.heappush(heap, (max(later, t), r))
                stalled += 1
                continue
            stalled = 0
            remaining -= 1
            heapq.heappush(heap, (self.execute(r, a, max(t, dep), cost), r))
        return Simulation(max(self.clock), self.busy, self.peak, self.links, self.starts)

    def needs(self, r: int, a: Action) -> tuple[float | None, float]:
        """(when the input of rank r's action ``a`` exists, None if not yet; its cost)."""
        k = a.chunk * self.p + r  # virtual stage
        if a.kind == "F":
            return (0.0 if k == 0 else self.finish.get(("F", k - 1, a.mb))), self.cost_f
        if a.kind == "B":
            dep = (self.finish.get(("F", k, a.mb)) if k == self.last
                   else self.finish.get(("B", k + 1, a.mb)))
            if dep is not None and ("F", k, a.mb) not in self.finish:
                dep = None
            return dep, self.cost_b
        if a.kind == "W":
            if not self.split:
                raise ValueError("W actions need split_backward=True")
            return self.finish.get(("B", k, a.mb)), self.cost_w
        raise ValueError(f"unknown action {a}")

    def execute(self, r: int, a: Action, start: float, cost: float) -> float:
        """Run rank r's action ``a`` from ``start``: its finish, what the rank holds, what its
        links carry -> when it ends."""
        k = a.chunk * self.p + r
        end = start + cost
        self.starts[(r, a)] = start
        self.finish[(a.kind, k, a.mb)] = end
        self.busy[r] += cost
        self.clock[r] = end
        self.pos[r] += 1
        if a.kind == "F":
            self.held[r] += 1
            self.peak[r] = max(self.peak[r], self.held[r])
            if k < self.last:
                self.links.setdefault((r, (k + 1) % self.p), []).append(("act", k, a.mb))
        elif a.kind == "B":
            if not self.split:
                self.held[r] -= 1
            if k > 0:
                self.links.setdefault((r, (k - 1) % self.p), []).append(("grad", k, a.mb))
        else:
            self.held[r] -= 1
        return end


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
