"""Benchmark modes: a schedule (:class:`~domino.plan.Plan`) plus whether TP comm runs.

Grammar (case-insensitive, comma-separated in ``--modes``), the plan part being the Plan's own
text form (``Plan.parse`` / ``str(plan)``)::

    sync                  sync TP: Plan(1, none, 1), blocking all-reduces
    nocomm                sync TP compute, every TP collective a no-op
    domino:<plan>         a Domino schedule, e.g. domino:m2:cross, domino:m4:cross:c2
    nocomm:<plan>         the same split with comm disabled (what splitting costs)

Any mode may end in ``:sp``: the same with sequence parallelism (each all-reduce becomes a
reduce-scatter and an all-gather; e.g. sync:sp, nocomm:sp, domino:m2:cross:sp). Its exposed
and hidden figures are taken against sync:sp and nocomm:sp when they run. Any mode may end in
``:compiled`` (after ``:sp``): the same on a twin of the model with compiled pieces
(``RuntimeConfig.compile``), measured against sync:compiled and nocomm:compiled, so eager and
compiled run side by side, interleaved, in one run.
"""

from __future__ import annotations

from dataclasses import dataclass

from domino.plan import GRAMMAR as PLAN_GRAMMAR
from domino.plan import SYNC, Plan

__all__ = ["DEFAULT_MODES", "GRAMMAR", "Mode", "parse_mode", "parse_modes"]

GRAMMAR = (
    f"sync | nocomm | domino:{PLAN_GRAMMAR} | nocomm:{PLAN_GRAMMAR}, each optionally ending in"
    " :sp (sequence parallel) and then :compiled (compiled pieces) (N micro-batches >= 1, K"
    " column chunks >= 1; e.g. domino:m4:cross:c2, domino:m2:cross:sp, sync:compiled)"
)

DEFAULT_MODES = (
    "sync,nocomm,domino:m2:intra,domino:m2:cross,domino:m4:cross,domino:m2:cross:c2,"
    "domino:m4:cross:c2,nocomm:m2:cross,nocomm:m4:cross,nocomm:m2:cross:c2,nocomm:m4:cross:c2"
)


@dataclass(frozen=True)
class Mode:
    """One benchmarked configuration; ``name`` is canonical (``kind:str(plan)``)."""

    name: str
    plan: Plan
    comm: bool
    sequence_parallel: bool = False
    compiled: bool = False

    @property
    def is_domino(self) -> bool:
        """A Domino schedule with communication on (``domino:...``)."""
        return self.comm and self.name.startswith("domino:")

    @property
    def split(self) -> tuple[int, int]:
        """(micro-batches, column chunks): what a comm-free run must share to be comparable
        (and :attr:`sequence_parallel`)."""
        return self.plan.micro_batches, self.plan.column_chunks

    @property
    def family(self) -> str:
        """The name suffix of its baselines: '', ':sp', ':compiled' or ':sp:compiled' (e.g.
        sync:sp and nocomm:sp)."""
        return (":sp" if self.sequence_parallel else "") + (":compiled" if self.compiled else "")

    def with_compiled(self) -> Mode:
        """The same mode on the compiled model."""
        return self if self.compiled else Mode(self.name + ":compiled", self.plan, self.comm,
                                               self.sequence_parallel, True)


def parse_mode(text: str) -> Mode:
    """Parse one mode; raise ValueError naming the grammar when it does not match."""
    norm = text.strip().lower()
    if norm.endswith(":compiled"):
        try:
            base = parse_mode(norm.removesuffix(":compiled"))
        except ValueError:
            raise ValueError(f"unknown benchmark mode {text!r}; expected {GRAMMAR}") from None
        if base.compiled:
            raise ValueError(f"unknown benchmark mode {text!r} (':compiled' twice); expected "
                             f"{GRAMMAR}")
        return base.with_compiled()
    if norm.endswith(":sp"):
        try:
            base = parse_mode(norm.removesuffix(":sp"))
        except ValueError:
            raise ValueError(f"unknown benchmark mode {text!r}; expected {GRAMMAR}") from None
        if base.sequence_parallel or base.compiled:
            raise ValueError(f"unknown benchmark mode {text!r} (':sp' twice, or after "
                             f"':compiled'); expected {GRAMMAR}")
        return Mode(base.name + ":sp", base.plan, base.comm, True)
    if norm in ("sync", "nocomm"):
        return Mode(norm, SYNC, norm == "sync")
    kind, _, plan_text = norm.partition(":")
    if kind not in ("domino", "nocomm") or not plan_text:
        raise ValueError(f"unknown benchmark mode {text!r}; expected {GRAMMAR}")
    try:
        plan = Plan.parse(plan_text)
    except ValueError:
        raise ValueError(f"unknown benchmark mode {text!r}; expected {GRAMMAR}") from None
    return Mode(f"{kind}:{plan}", plan, kind == "domino")


def parse_modes(text: str) -> list[Mode]:
    """Parse a comma-separated list, dropping repeats (by canonical name) and keeping order."""
    modes: list[Mode] = []
    for part in text.split(","):
        if not part.strip():
            continue
        mode = parse_mode(part)
        if mode.name not in {x.name for x in modes}:
            modes.append(mode)
    if not modes:
        raise ValueError(f"--modes is empty; give at least one of {GRAMMAR}")
    return modes
