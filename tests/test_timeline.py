"""Tests for domino.bench.timeline: recording, Chrome trace export, PNG rendering, round trips."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest

from domino.bench.timeline import CATEGORIES, Span, Timeline, render_png, to_chrome_trace


def _sample(rank: int, base: float = 10.0) -> Timeline:
    tl = Timeline(rank)
    t = base
    for mb in range(2):
        tl.record(f"attn{mb}", "compute", t, t + 0.004, mb=mb, layer=0)
        tl.record(f"ar{mb}", "comm", t + 0.004, t + 0.010, mb=mb)
        t += 0.004
    tl.record("wait ar1", "wait", t, t + 0.002, mb=1)
    tl.record("optimizer", "compute", t + 0.002, t + 0.003)
    tl.record("h2d", "copy", t + 0.003, t + 0.0035)  # a non-standard category gets its own lane
    return tl


def test_record_and_span() -> None:
    tl = Timeline(3)
    tl.record("x", "compute", 1.0, 1.5, mb=0)
    with tl.span("y", "comm", mb=1):
        time.sleep(0.001)
    assert len(tl) == 2
    x, y = tl.spans
    assert (x.name, x.category, x.duration_s, x.args) == ("x", "compute", 0.5, {"mb": 0})
    assert y.category == "comm" and y.args == {"mb": 1} and y.end_s > y.start_s
    assert tl.by_category("comm") == [y]
    assert set(CATEGORIES) >= {"compute", "comm", "wait"}


def test_covered_time() -> None:
    """Overlapping spans count once; ``minus`` takes out what another category covers (a piece
    that waits inside its compute span is not working then)."""
    tl = Timeline(0)
    tl.record("par", "compute", 0.0, 4.0)
    tl.record("local", "compute", 3.0, 5.0)  # overlaps par by 1
    tl.record("wgrad", "compute", 7.0, 8.0)
    tl.record("wait a", "wait", 1.0, 2.0)  # inside par
    tl.record("wait b", "wait", 4.5, 6.0)  # half inside local
    assert tl.covered_s("compute") == pytest.approx(6.0)
    assert tl.covered_s("wait") == pytest.approx(2.5)
    assert tl.covered_s("compute", minus="wait") == pytest.approx(6.0 - 1.0 - 0.5)
    assert Timeline(1).covered_s("compute", minus="wait") == 0.0


def test_span_records_on_exception() -> None:
    tl = Timeline(0)
    with pytest.raises(RuntimeError), tl.span("boom", "compute"):
        raise RuntimeError("x")
    assert [s.name for s in tl.spans] == ["boom"]


def test_record_rejects_negative_duration() -> None:
    with pytest.raises(ValueError):
        Timeline(0).record("bad", "compute", 2.0, 1.0)


def test_dict_and_pickle_round_trip() -> None:
    tl = _sample(1)
    d = json.loads(json.dumps(tl.to_dict()))
    back = Timeline.from_dict(d)
    assert back.rank == 1 and back.spans == tl.spans
    again = pickle.loads(pickle.dumps(tl))
    assert again.rank == tl.rank and again.spans == tl.spans
    assert Span.from_dict(tl.spans[0].to_dict()) == tl.spans[0]


def test_chrome_trace(tmp_path: Path) -> None:
    tls = [_sample(0), _sample(1, base=10.001)]
    path = tmp_path / "trace.json"
    to_chrome_trace(tls, path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == sum(len(t) for t in tls)
    assert {e["pid"] for e in xs} == {0, 1}
    assert min(e["ts"] for e in xs) == pytest.approx(0.0)
    for e in xs:
        assert e["dur"] >= 0 and isinstance(e["tid"], int) and "args" in e
    ar0 = next(e for e in xs if e["pid"] == 0 and e["name"] == "ar0")
    assert ar0["dur"] == pytest.approx(6000.0)  # 6 ms in microseconds
    assert ar0["cat"] == "comm" and ar0["args"]["mb"] == 0
    # Same category -> same lane on every rank, and every lane is named.
    lane_names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    for e in xs:
        assert lane_names[(e["pid"], e["tid"])] == e["cat"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}


def test_render_png(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    render_png([_sample(0), _sample(1, base=10.0005)], path, title="overlap")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_render_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    render_png([Timeline(0)], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    to_chrome_trace([Timeline(0)], tmp_path / "empty.json")
    assert json.loads((tmp_path / "empty.json").read_text())["traceEvents"]
