"""Pure helpers of scripts/compare_deepspeed/compare.py (no DeepSpeed, no processes started)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "compare_deepspeed",
                     "compare.py")
_spec = importlib.util.spec_from_file_location("compare_deepspeed", _PATH)
compare = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = compare  # dataclasses look their module up there
_spec.loader.exec_module(compare)


def test_parse_links_normalises_and_validates():
    assert compare.parse_links("loopback, 1GBit,500mbit,1gbit") == ["loopback", "1gbit", "500mbit"]
    with pytest.raises(ValueError, match="invalid link rate"):
        compare.parse_links("loopback,fast")
    with pytest.raises(ValueError, match="empty"):
        compare.parse_links(" , ")


def test_order_alternates_every_round():
    assert compare.order_for_round(0) == ("ours", "deepspeed")
    assert compare.order_for_round(1) == ("deepspeed", "ours")
    assert compare.order_for_round(2) == ("ours", "deepspeed")


def test_best_domino_ignores_sync_and_nocomm():
    times = {"sync": 0.1, "nocomm": 0.05, "domino:m2:cross": 0.3, "domino:m4:cross:c2": 0.2}
    assert compare.best_domino(times) == ("domino:m4:cross:c2", 0.2)
    assert compare.best_domino({"sync": 0.1}) is None


def test_ours_from_report_reads_step_time_by_mode():
    report = {"results": [{"mode": "sync", "step_time_s": 0.5, "step_times_s": [0.4, 0.6]},
                          {"mode": "domino:m2:cross", "step_time_s": 0.45}]}
    assert compare.ours_from_report(report) == {"sync": 0.5, "domino:m2:cross": 0.45}


def test_median_of_round_medians_and_ranges():
    row = compare.LinkRounds("1gbit", 2)
    rounds = [  # (our modes, deepspeed step times) per round
        ({"sync": 0.9, "nocomm": 0.5, "domino:m2:cross": 0.70, "domino:m4:cross": 0.60},
         [0.80, 0.90, 1.00]),
        ({"sync": 1.1, "nocomm": 0.6, "domino:m2:cross": 0.65, "domino:m4:cross": 0.75},
         [1.30, 1.20, 5.00]),
        ({"sync": 1.0, "nocomm": 0.4, "domino:m2:cross": 0.80, "domino:m4:cross": 0.85},
         [0.70, 0.60, 0.65]),
    ]
    for ours, ds in rounds:
        row.add_ours(ours)
        row.add_deepspeed(ds)
    s = row.summary()
    assert row.best == [0.60, 0.65, 0.80]
    assert row.best_mode == ["domino:m4:cross", "domino:m2:cross", "domino:m2:cross"]
    assert row.deepspeed == [0.90, 1.30, 0.65]  # each round's median (5.0 is an outlier)
    assert s["our_best_domino"] == {"median": 0.65, "min": 0.60, "max": 0.80, "rounds": 3}
    assert s["deepspeed_domino"]["median"] == pytest.approx(0.90)
    assert s["deepspeed_over_ours"] == pytest.approx(0.90 / 0.65)
    assert s["deepspeed_over_ours_per_round"] == pytest.approx([1.5, 2.0, 0.8125])
    assert s["best_mode_counts"] == {"domino:m4:cross": 1, "domino:m2:cross": 2}


def test_format_cells():
    assert compare.fmt_ms({"median": 0.8124, "min": 0.6702, "max": 1.0128, "rounds": 4}) == \
        "812 (670-1013)"
    assert compare.fmt_ms({"median": 0.5, "min": 0.5, "max": 0.5, "rounds": 1}) == "500"
    assert compare.fmt_ms(None) == "-"
    assert compare.fmt_ratio(1.234, [1.1, 1.4]) == "1.23x (1.10-1.40)"
    assert compare.fmt_ratio(None, []) == "-"


def test_format_table_rows_and_header():
    row = compare.LinkRounds("loopback", 2)
    row.add_ours({"sync": 0.5, "nocomm": 0.4, "domino:m2:cross": 0.45})
    row.add_deepspeed([0.9])
    tp1 = compare.LinkRounds("loopback", 1)
    tp1.add_ours({"sync": 0.8, "domino:m2:cross": 0.82})
    tp1.add_deepspeed([0.82])
    text = compare.format_table([row.summary(), tp1.summary()])
    lines = text.splitlines()
    assert lines[0] == ("| link | our sync | our nocomm | our best Domino | DeepSpeed Domino | "
                        "DeepSpeed / ours |")
    assert lines[2] == "| loopback | 500 | 400 | 450 | 900 | 2.00x |"
    assert lines[3].startswith("| TP=1, 1 process") and lines[3].endswith("| 820 | 820 | 1.00x |")
    assert "| - |" in lines[3]  # no nocomm run in that row
    assert "m2:cross x1" in compare.format_best_modes([row.summary()])


def test_gloo_row_and_transport_line():
    shm_row = compare.LinkRounds("loopback", 2)
    gloo_row = compare.LinkRounds("loopback", 2, gloo=True)
    emulated = compare.LinkRounds("1gbit", 2)
    for row, transport in ((shm_row, "shm"), (gloo_row, "gloo"), (emulated, "gloo")):
        row.add_ours({"sync": 0.5, "domino:m2:cross": 0.45})
        row.transports.append(transport)
        row.add_deepspeed([0.5])
    summaries = [shm_row.summary(), gloo_row.summary(), emulated.summary()]
    lines = compare.format_table(summaries).splitlines()
    assert lines[3].startswith("| loopback, ours over gloo (--no-shared-memory-comm) |")
    assert compare.format_transports(summaries) == (
        "our TP collectives (DeepSpeed's are always gloo's): loopback: shm; loopback, ours over "
        "gloo (--no-shared-memory-comm): gloo; 1gbit emulated: gloo")


def test_the_gloo_row_follows_loopback_and_runs_with_no_shared_memory(monkeypatch, tmp_path):
    calls = []

    def ours(args, link, tp, modes, workdir, tag, gloo=False):
        calls.append(("ours", link, gloo, tag))
        return {"sync": 0.5, "domino:m2:cross": 0.4}, "gloo" if gloo else "shm"

    def deepspeed(args, link, tp, workdir, tag):
        calls.append(("ds", link, tag))
        return [0.5]

    monkeypatch.setattr(compare, "run_ours", ours)
    monkeypatch.setattr(compare, "run_deepspeed", deepspeed)
    args = compare.parse_args(["--rounds", "1", "--tp1-rounds", "0", "--links", "loopback,1gbit"])
    rows = compare.measure(args, str(tmp_path))
    assert [(r.link, r.gloo) for r in rows] == [("loopback", False), ("loopback", True),
                                                ("1gbit", False)]
    assert ("ours", "loopback", True, "r0_loopback_gloo") in calls
    assert rows[1].transports == ["gloo"] and rows[0].transports == ["shm"]
    no_row = compare.parse_args(["--rounds", "1", "--tp1-rounds", "0", "--no-gloo-row"])
    assert all(not r.gloo for r in compare.measure(no_row, str(tmp_path)))
