"""Benchmark modes: a schedule (:class:`~domino.transformer.Plan`) plus whether TP comm runs.

Grammar (case-insensitive, comma-separated in ``--modes``)::

    sync                                  sync TP: Plan(1, none, 1), blocking all-reduces
    nocomm                                sync TP compute, every TP collective a no-op
    domino:m<N>:<none|intra|cross>[:c<K>] Domino: N micro-batches, overlap kind, K column chunks
    nocomm:m<N>:<none|intra|cross>[:c<K>] the same split with comm disabled (splitting cost)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from domino.transformer import Plan

__all__ = ["DEFAULT_MODES", "GRAMMAR", "Mode", "parse_mode", "parse_modes"]

GRAMMAR = (
    "sync | nocomm | domino:m<N>:<none|intra|cross>[:c<K>] | nocomm:m<N>:<none|intra|cross>[:c<K>]"
    " (N micro-batches >= 1, K column chunks >= 1; e.g. domino:m4:cross:c2)"
)

DEFAULT_MODES = (
    "sync,nocomm,domino:m2:intra,domino:m2:cross,domino:m4:cross,domino:m2:cross:c2,"
    "domino:m4:cross:c2,nocomm:m2:cross,nocomm:m4:cross,nocomm:m2:cross:c2,nocomm:m4:cross:c2"
)

_OVERLAPS = {
    "none": "none",
    "intra": "intra_layer",
    "intra_layer": "intra_layer",
    "cross": "cross_layer",
    "cross_layer": "cross_layer",
}
_SHORT = {"none": "none", "intra_layer": "intra", "cross_layer": "cross"}
_SPLIT_RE = re.compile(r"^(domino|nocomm):m(\d+):([a-z_]+)(?::c(\d+))?$")


@dataclass(frozen=True)
class Mode:
    """One benchmarked configuration; ``name`` is canonical (``c1`` omitted, short overlap)."""

    name: str
    plan: Plan
    comm: bool

    @property
    def is_domino(self) -> bool:
        """A Domino schedule with communication on (``domino:...``)."""
        return self.comm and self.name.startswith("domino:")

    @property
    def split(self) -> tuple[int, int]:
        """(micro-batches, column chunks): what a comm-free run must share to be comparable."""
        return self.plan.micro_batches, self.plan.column_chunks

    @property
    def slug(self) -> str:
        """File-name friendly form of the name."""
        return self.name.replace(":", "_")


def parse_mode(text: str) -> Mode:
    """Parse one mode; raise ValueError naming the grammar when it does not match."""
    norm = text.strip().lower()
    if norm == "sync":
        return Mode("sync", Plan(1, "none", 1), True)
    if norm == "nocomm":
        return Mode("nocomm", Plan(1, "none", 1), False)
    m = _SPLIT_RE.match(norm)
    if m is None or m.group(3) not in _OVERLAPS:
        raise ValueError(f"unknown benchmark mode {text!r}; expected {GRAMMAR}")
    kind, n, overlap = m.group(1), int(m.group(2)), _OVERLAPS[m.group(3)]
    chunks = int(m.group(4)) if m.group(4) is not None else 1
    if n < 1 or chunks < 1:
        raise ValueError(f"benchmark mode {text!r}: micro-batches and column chunks must be >= 1; "
                         f"expected {GRAMMAR}")
    name = f"{kind}:m{n}:{_SHORT[overlap]}" + (f":c{chunks}" if chunks > 1 else "")
    return Mode(name, Plan(n, overlap, chunks), kind == "domino")


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
