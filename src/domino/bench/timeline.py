"""Per-rank event timelines and their renderers (Chrome trace JSON, PNG).

Times are ``time.perf_counter()`` seconds. On Linux that clock is CLOCK_MONOTONIC, shared by all
processes of one machine (network namespaces included), so timelines recorded by different ranks
on the same host line up without any clock exchange. Renderers shift everything so the earliest
span of all timelines starts at 0.

Categories: ``compute`` (kernel work), ``comm`` (a collective from launch until its completion
was observed at wait, so it overlaps compute when communication is hidden) and ``wait`` (time the
rank was blocked waiting on a collective). Other categories are allowed and get their own lanes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CATEGORIES",
    "Span",
    "Timeline",
    "render_png",
    "to_chrome_trace",
]

CATEGORIES: tuple[str, ...] = ("compute", "comm", "wait")


@dataclass
class Span:
    """One recorded interval; ``args`` holds extras such as ``mb`` (micro-batch index)."""

    name: str
    category: str
    start_s: float
    end_s: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "category": self.category,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "args": dict(self.args),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Span:
        return cls(d["name"], d["category"], float(d["start_s"]), float(d["end_s"]), d["args"])


class Timeline:
    """Spans recorded by one rank."""

    def __init__(self, rank: int, spans: Sequence[Span] = ()) -> None:
        self.rank = rank
        self.spans: list[Span] = list(spans)

    def __len__(self) -> int:
        return len(self.spans)

    def __repr__(self) -> str:
        return f"Timeline(rank={self.rank}, spans={len(self.spans)})"

    @staticmethod
    def now() -> float:
        """The clock spans use; take it at a collective's launch to record the comm span later."""
        return time.perf_counter()

    def record(self, name: str, category: str, start_s: float, end_s: float, **args: Any) -> Span:
        """Add a span that has already happened."""
        if end_s < start_s:
            raise ValueError(f"span {name!r} ends before it starts ({start_s} > {end_s})")
        span = Span(name, category, float(start_s), float(end_s), args)
        self.spans.append(span)
        return span

    @contextmanager
    def span(self, name: str, category: str, **args: Any) -> Iterator[None]:
        """Record the enclosed block as a span (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, category, start, time.perf_counter(), **args)

    def by_category(self, category: str) -> list[Span]:
        return [s for s in self.spans if s.category == category]

    def covered_s(self, category: str, minus: str | None = None) -> float:
        """Seconds covered by at least one span of ``category`` (overlaps counted once), less
        those also covered by a span of ``minus`` (e.g. compute not spent waiting)."""
        covered = _union([(s.start_s, s.end_s) for s in self.by_category(category)])
        total = sum(b - a for a, b in covered)
        if minus is not None:
            other = _union([(s.start_s, s.end_s) for s in self.by_category(minus)])
            total -= sum(max(0.0, min(b, d) - max(a, c)) for a, b in covered for c, d in other)
        return total

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form, for sending to the parent process."""
        return {"rank": self.rank, "spans": [s.to_dict() for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Timeline:
        return cls(int(d["rank"]), [Span.from_dict(s) for s in d["spans"]])


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same points as ``intervals``."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _lanes(timelines: Sequence[Timeline]) -> list[str]:
    """Standard categories first (always shown), then any others in order of appearance."""
    lanes = list(CATEGORIES)
    for tl in timelines:
        for s in tl.spans:
            if s.category not in lanes:
                lanes.append(s.category)
    return lanes


def _origin(timelines: Sequence[Timeline]) -> float:
    starts = [s.start_s for tl in timelines for s in tl.spans]
    return min(starts) if starts else 0.0


def to_chrome_trace(timelines: Sequence[Timeline], path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write a Chrome trace (chrome://tracing, Perfetto) and return it.

    One process per rank (pid = rank), one thread per category lane, complete ("X") events in
    microseconds from the earliest span.
    """
    lanes = _lanes(timelines)
    t0 = _origin(timelines)
    events: list[dict[str, Any]] = []
    for tl in sorted(timelines, key=lambda t: t.rank):
        events.append(
            {"ph": "M", "name": "process_name", "pid": tl.rank, "args": {"name": f"rank {tl.rank}"}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": tl.rank,
                "args": {"sort_index": tl.rank},
            }
        )
        for tid, lane in enumerate(lanes):
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": tl.rank,
                    "tid": tid,
                    "args": {"name": lane},
                }
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": tl.rank,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        for s in tl.spans:
            events.append(
                {
                    "name": s.name,
                    "cat": s.category,
                    "ph": "X",
                    "pid": tl.rank,
                    "tid": lanes.index(s.category),
                    "ts": (s.start_s - t0) * 1e6,
                    "dur": s.duration_s * 1e6,
                    "args": s.args,
                }
            )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    with open(path, "w") as f:
        # default=str: args are free-form, and a trace with a stringified arg beats no trace.
        json.dump(trace, f, default=str)
    return trace


_NO_MB_COLOUR = "#9e9e9e"
_LANE_HATCH = {"comm": "//", "wait": "xx"}


def render_png(
    timelines: Sequence[Timeline],
    path: str | os.PathLike[str],
    title: str = "",
    width_in: float = 14.0,
    dpi: int = 120,
    row_label: str = "rank",
) -> None:
    """Draw the timelines as a Gantt chart: one row group per rank, one lane per category.

    Bars are coloured by micro-batch (the ``mb`` arg; grey without one), comm and wait bars are
    hatched, and names are written on bars wide enough to hold them. Rows are named
    ``row_label`` and the timeline's rank (e.g. "stage 1" for a pipeline's timelines).
    """
    # Figure + Agg canvas directly, not pyplot: no global backend switch, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lanes = _lanes(timelines)
    tls = sorted(timelines, key=lambda t: t.rank)
    t0 = _origin(tls)
    end_ms = max(((s.end_s - t0) * 1e3 for tl in tls for s in tl.spans), default=1.0) or 1.0

    n_rows = len(tls) * len(lanes)
    fig = Figure(figsize=(width_in, 1.2 + 0.32 * n_rows + 0.25 * len(tls)), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.11, 0.12 + 0.3 / (1 + n_rows), 0.74, 0.78 - 0.3 / (1 + n_rows)))
    # Approximate text fitting: axes width in pixels over the time range, ~6 px per character.
    gantt = _Gantt(ax, t0, px_per_ms=width_in * dpi * 0.74 / end_ms)
    yticks: list[float] = []
    ylabels: list[str] = []
    y = 0.0
    for tl in tls:
        for lane in lanes:
            yticks.append(y + _ROW_H / 2)
            ylabels.append(f"{row_label} {tl.rank} {lane}")
            gantt.draw_lane(lane, [s for s in tl.spans if s.category == lane], y)
            y += _ROW_H
        ax.axhline(y + _GROUP_GAP / 2, color="#cccccc", linewidth=0.8)
        y += _GROUP_GAP

    ax.set_ylim(y, 0)  # rank 0 on top
    ax.set_xlim(0, end_ms * 1.01)
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.6)
    if title:
        ax.set_title(title)
    ax.legend(handles=gantt.legend(), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.savefig(path, format="png")


_ROW_H, _GROUP_GAP = 1.0, 0.6  # a lane's height and the gap between two ranks' row groups


class _Gantt:
    """The bars of one chart: where a span's bar goes, its colour, its label, and the legend
    of the micro-batches and lanes drawn."""

    def __init__(self, ax: Any, t0: float, px_per_ms: float) -> None:
        from matplotlib.colors import to_hex

        self.ax, self.t0, self.px_per_ms = ax, t0, px_per_ms
        self.palette = [to_hex(c) for c in _palette()]
        self.mbs: set[int] = set()
        self.has_plain = False

    def colour(self, span: Span) -> str:
        """The span's micro-batch colour (grey without one); notes it for the legend."""
        mb = span.args.get("mb")
        if isinstance(mb, int):
            self.mbs.add(mb)
            return self.palette[mb % len(self.palette)]
        self.has_plain = True
        return _NO_MB_COLOUR

    def draw_lane(self, lane: str, spans: list[Span], y: float) -> None:
        """One lane's spans from height ``y``, overlapping ones stacked in sub-rows."""
        lane_spans = sorted(spans, key=_start)
        slots = _slots(lane_spans)
        n_slots = max(slots, default=0) + 1
        bar_h = (_ROW_H - 0.2) / n_slots
        # One broken_barh per sub-row and colour: the same rectangles as one call per span
        # (the spans of a sub-row never overlap), drawn many times faster.
        bars: dict[tuple[float, str], list[tuple[float, float]]] = {}
        for s, slot in zip(lane_spans, slots, strict=True):
            colour = self.colour(s)
            x0 = (s.start_s - self.t0) * 1e3
            w = s.duration_s * 1e3
            yb = y + 0.1 + slot * bar_h
            bars.setdefault((yb, colour), []).append((x0, w))
            if w * self.px_per_ms > 6 * len(s.name) + 4:
                self.label(s.name, x0 + w / 2, yb + bar_h / 2, 7 if n_slots == 1 else 6)
        for (yb, colour), xranges in bars.items():
            self.ax.broken_barh(
                xranges,
                (yb, bar_h),
                facecolors=colour,
                edgecolor="black",
                linewidth=0.4,
                hatch=_LANE_HATCH.get(lane),
                alpha=0.9,
            )

    def label(self, name: str, x: float, y: float, fontsize: int) -> None:
        self.ax.text(
            x,
            y,
            name,
            ha="center",
            va="center",
            fontsize=fontsize,
            clip_on=True,
            # A light box keeps the name readable on hatched bars.
            bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7},
        )

    def legend(self) -> list[Any]:
        """Patches for the micro-batches drawn, grey if a span had none, and the hatches."""
        from matplotlib.patches import Patch

        handles = [Patch(facecolor=self.palette[m % len(self.palette)], label=f"mb {m}")
                   for m in sorted(self.mbs)]
        if self.has_plain:
            handles.append(Patch(facecolor=_NO_MB_COLOUR, label="no micro-batch"))
        for lane, hatch in _LANE_HATCH.items():
            handles.append(Patch(facecolor="white", edgecolor="black", hatch=hatch, label=lane))
        return handles


def _start(s: Span) -> float:
    return s.start_s


def _slots(spans: Sequence[Span]) -> list[int]:
    """Stack overlapping spans of one lane (e.g. collectives in flight together) into sub-rows.

    ``spans`` must be sorted by start; each gets the lowest sub-row that is free at its start.
    """
    ends: list[float] = []
    out = []
    for s in spans:
        slot = next((i for i, e in enumerate(ends) if e <= s.start_s), len(ends))
        if slot == len(ends):
            ends.append(s.end_s)
        else:
            ends[slot] = s.end_s
        out.append(slot)
    return out


def _palette() -> list[Any]:
    from matplotlib import colormaps

    return list(colormaps["tab10"].colors)
