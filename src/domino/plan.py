"""The Domino schedule as one value: how many micro-batches, which overlap, how many column chunks.

A :class:`Plan` is what every part of the library that chooses or runs a schedule shares: the
model's run-time config (:class:`~domino.runtime.RuntimeConfig`, or the constructors' ``plan=``
shortcut), ``domino train``'s flags, the benchmark's modes and the autotuner. It has one text
form, ``m<N>:<none|intra|cross>[:c<K>]`` (``c1`` is left out), read by :meth:`Plan.parse`
and written by ``str(plan)``, and one set of rules (:func:`check_fields`,
:meth:`Plan.check_fits`, :meth:`Plan.check_width`) whose messages name whatever the caller
calls the values (a config field, a flag, a benchmark mode).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OVERLAPS = ("none", "intra_layer", "cross_layer")
_SHORT = {"none": "none", "intra_layer": "intra", "cross_layer": "cross"}
_ALIASES = {**{o: o for o in OVERLAPS}, **{s: o for o, s in _SHORT.items()}}
GRAMMAR = "m<N>:<none|intra|cross>[:c<K>]"
_TEXT_RE = re.compile(r"^m(\d+):([a-z_]+)(?::c(\d+))?$")


def check_fields(micro_batches: Any, overlap: Any, column_chunks: Any,
                 name: Callable[[str], str]) -> None:
    """Raise ValueError unless the three values make a plan; ``name(field)`` is how the message
    names a field (``Plan.overlap``, ``domino_overlap``, ``--domino-overlap``, ...)."""
    for field, value in (("micro_batches", micro_batches), ("column_chunks", column_chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name(field)}={value!r} must be a positive integer.")
    if overlap not in OVERLAPS:
        raise ValueError(f"{name('overlap')}={overlap!r} is not one of {', '.join(OVERLAPS)}.")


@dataclass(frozen=True)
class Plan:
    """A Domino schedule (see ``domino.transformer.executor`` for what each part does)."""

    micro_batches: int = 1
    overlap: str = "none"
    column_chunks: int = 1

    def __post_init__(self) -> None:
        check_fields(self.micro_batches, self.overlap, self.column_chunks, "Plan.{}".format)

    @classmethod
    def parse(cls, text: str) -> Plan:
        """Read ``m<N>:<none|intra|cross>[:c<K>]`` (case-insensitive; ``intra_layer`` and
        ``cross_layer`` are accepted too)."""
        norm = text.strip().lower()
        m = _TEXT_RE.match(norm)
        if m is None or m.group(2) not in _ALIASES:
            raise ValueError(f"invalid Domino plan {text!r}; expected {GRAMMAR}, e.g. m2:cross "
                             "or m4:cross:c2")
        chunks = int(m.group(3)) if m.group(3) is not None else 1
        try:
            return cls(int(m.group(1)), _ALIASES[m.group(2)], chunks)
        except ValueError as err:
            raise ValueError(f"invalid Domino plan {text!r}: {err}") from None

    def __str__(self) -> str:
        text = f"m{self.micro_batches}:{_SHORT[self.overlap]}"
        return text if self.column_chunks == 1 else f"{text}:c{self.column_chunks}"

    @property
    def splits(self) -> bool:
        """True when the plan cuts the batch or the GEMM outputs at all."""
        return self.micro_batches > 1 or self.column_chunks > 1

    def check_fits(self, batch: int, *, what: str = "domino_micro_batches",
                   batch_name: str = "batch_size") -> None:
        """Every micro-batch needs at least one sample of a batch of ``batch``."""
        if self.micro_batches > batch:
            raise ValueError(
                f"{what}={self.micro_batches} is larger than {batch_name}={batch}: every Domino "
                f"micro-batch needs at least one sample; lower {what} or raise {batch_name}.")

    def check_width(self, width: int, *, what: str = "domino_column_chunks",
                    width_name: str = "hidden_size") -> None:
        """Every column chunk of a row-parallel output of ``width`` columns needs one column."""
        if self.column_chunks > width:
            raise ValueError(
                f"{what}={self.column_chunks} is larger than {width_name}={width}: every column "
                f"chunk needs at least one output column; lower {what}.")


SYNC = Plan()  # one micro-batch, no overlap, one chunk: plain (blocking) tensor parallelism
