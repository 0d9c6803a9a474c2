"""Pure helpers of scripts/compare_megatron_moe/compare.py (no Megatron, no processes started)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "compare_megatron_moe",
                     "compare.py")
_spec = importlib.util.spec_from_file_location("compare_megatron_moe", _PATH)
compare = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = compare  # dataclasses look their module up there
_spec.loader.exec_module(compare)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_defaults_are_the_documented_sizes():
    args = compare.parse_args([])
    assert args.link_list == ["loopback", "1gbit"]
    assert (args.rounds, args.hidden_size, args.moe_ffn_hidden_size, args.num_experts,
            args.moe_router_topk, args.seq_length, args.micro_batch_size,
            args.expert_model_parallel_size) == (4, 512, 1024, 8, 2, 256, 4, 2)
    assert args.modes == ("sync,nocomm,domino:m2:cross,domino:m2:cross:c2,domino:m1:cross:c2,"
                          "domino:m1:cross:c4")
    assert not args.swiglu and not args.force_load_balancing and not args.write_latest


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--warmup", "-1"], "--warmup"),
    (["--expert-model-parallel-size", "1"], "must be >= 2"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], "must divide"),
    (["--moe-router-topk", "9"], "--moe-router-topk must be <= --num-experts"),
    (["--modes", "sync,nocomm"], "domino:"),
    (["--links", "loopback,fast"], "invalid link rate"),
    (["--links", " , "], "empty"),
    (["--ours-extra-args", "'unclosed"], "--ours-extra-args"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(argv)
    assert message in capsys.readouterr().err


def test_parse_links_normalises_and_validates():
    assert compare.parse_links("loopback, 1GBit,500mbit,1gbit") == ["loopback", "1gbit", "500mbit"]


def test_order_alternates_every_round():
    assert compare.order_for_round(0) == ("ours", "megatron")
    assert compare.order_for_round(1) == ("megatron", "ours")
    assert compare.order_for_round(2) == ("ours", "megatron")


def test_ours_command_is_domino_bench_moe():
    args = compare.parse_args([])
    cmd = compare.ours_command(args, "loopback", "o.json", python="python")
    assert cmd[:6] == ["python", "-m", "domino.cli", "bench", "--model", "moe"]
    for name, value in [("--num-layers", "1"), ("--hidden-size", "512"),
                        ("--moe-ffn-hidden-size", "1024"), ("--num-experts", "8"),
                        ("--moe-router-topk", "2"), ("--seq-length", "256"),
                        ("--micro-batch-size", "4"), ("--tensor-model-parallel-size", "1"),
                        ("--expert-model-parallel-size", "2"), ("--steps", "6"),
                        ("--warmup", "2"), ("--json", "o.json"), ("--modes", args.modes),
                        ("--moe-aux-loss-coeff", "0.01")]:  # the loss Megatron's side computes
        assert _flag(cmd, name) == value, name
    for absent in ("--emulate-link", "--no-shared-memory-comm", "--swiglu",
                   "--moe-router-force-load-balancing", "--unit"):
        assert absent not in cmd
    slow = compare.ours_command(args, "1gbit", "o.json", gloo=False)
    assert _flag(slow, "--emulate-link") == "1gbit"
    assert "--no-shared-memory-comm" in compare.ours_command(args, "loopback", "o", gloo=True)


def test_options_reach_both_sides():
    args = compare.parse_args(["--swiglu", "--force-load-balancing", "--moe-aux-loss-coeff",
                               "0.001", "--ours-extra-args=--no-shared-memory-comm",
                               "--expert-model-parallel-size", "4", "--mcore-python", "/v/py"])
    ours = compare.ours_command(args, "loopback", "o.json")
    mc = compare.megatron_command(args, "m.json", "r0.log")
    for cmd in (ours, mc):
        assert "--swiglu" in cmd and "--moe-router-force-load-balancing" in cmd
        assert _flag(cmd, "--micro-batch-size") == "4" and _flag(cmd, "--dtype") == "fp32"
    assert ours[-1] == "--no-shared-memory-comm"  # --ours-extra-args, last
    assert _flag(ours, "--moe-aux-loss-coeff") == "0.001"
    assert _flag(ours, "--expert-model-parallel-size") == "4"
    assert mc[:2] == ["/v/py", compare.WORKER]
    assert _flag(mc, "--moe-aux-loss-coeff") == "0.001"
    assert _flag(mc, "--unit") == "block"  # the unit our side times
    layer = compare.parse_args(["--megatron-unit", "layer"])
    assert _flag(compare.megatron_command(layer, "m.json", "r0.log"), "--unit") == "layer"
    assert (_flag(mc, "--out"), _flag(mc, "--log")) == ("m.json", "r0.log")
    assert "--model" not in mc and "--modes" not in mc  # the worker has one model, no modes


def test_megatron_env_drops_our_venv():
    env = compare.megatron_env({"PATH": "/bin", "PYTHONPATH": "/src", "VIRTUAL_ENV": "/v",
                                "PYTHONHOME": "/h", "RANK": "1"})
    assert env == {"PATH": "/bin", "RANK": "1"}


def test_ours_cmd_only_prints_every_row_and_runs_nothing(capsys, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(compare, "run_ours", boom)
    monkeypatch.setattr(compare, "run_megatron", boom)
    monkeypatch.setattr(compare, "megatron_info", boom)
    assert compare.main(["--ours-cmd-only", "--links", "loopback,500mbit", "--gloo-row"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0::2] == ["# loopback", "# loopback, ours over gloo (--no-shared-memory-comm)",
                           "# 500mbit emulated"]
    cmds = [shlex.split(line) for line in lines[1::2]]
    assert all(c[:6] == ["python", "-m", "domino.cli", "bench", "--model", "moe"] for c in cmds)
    assert "--no-shared-memory-comm" in cmds[1] and _flag(cmds[2], "--emulate-link") == "500mbit"


def test_best_domino_and_report_parsing():
    times = {"sync": 0.1, "nocomm": 0.05, "domino:m2:cross": 0.3, "domino:m2:cross:c2": 0.2}
    assert compare.best_domino(times) == ("domino:m2:cross:c2", 0.2)
    assert compare.best_domino({"sync": 0.1}) is None
    report = {"config": {"transports": {"tp": "shm", "ep": "gloo"}},
              "results": [{"mode": "sync", "step_time_s": 0.5, "step_times_s": [0.4, 0.6],
                           "exposed_comm_s": 0.1},
                          {"mode": "domino:m2:cross", "step_time_s": 0.45}]}
    assert compare.ours_from_report(report) == {"sync": 0.5, "domino:m2:cross": 0.45}
    assert compare.transports_label(report) == "ep gloo, tp shm"
    assert compare.transports_label({"config": {}}) == "-"


def _megatron_report(step_times, copies=(993, 1018)):
    """What mcore_worker.py's rank 0 writes (the keys compare.py reads)."""
    n = len(step_times)
    return {"step_times_s": list(step_times),
            "dispatch_token_copies_per_step": {"rank0->rank1": [copies[0]] * n,
                                               "rank1->rank0": [copies[1]] * n}}


def test_median_of_round_medians_ranges_and_ratio():
    row = compare.LinkRounds("1gbit")
    rounds = [  # (our modes, Megatron step times) per round
        ({"sync": 0.9, "nocomm": 0.5, "domino:m2:cross": 0.70, "domino:m4:cross": 0.60},
         [0.80, 0.90, 1.00]),
        ({"sync": 1.1, "nocomm": 0.6, "domino:m2:cross": 0.65, "domino:m4:cross": 0.75},
         [1.30, 1.20, 5.00]),
        ({"sync": 1.0, "nocomm": 0.4, "domino:m2:cross": 0.80, "domino:m4:cross": 0.85},
         [0.70, 0.60, 0.65]),
    ]
    for ours, mc in rounds:
        row.add_ours(ours)
        assert row.add_megatron(_megatron_report(mc)) == row.megatron[-1]
    s = row.summary()
    assert row.best == [0.60, 0.65, 0.80]
    assert row.best_mode == ["domino:m4:cross", "domino:m2:cross", "domino:m2:cross"]
    assert row.megatron == [0.90, 1.30, 0.65]  # each round's median (5.0 is an outlier)
    assert s["our_best_domino"] == {"median": 0.65, "min": 0.60, "max": 0.80, "rounds": 3}
    assert s["our_sync"]["median"] == 1.0 and s["our_nocomm"]["median"] == 0.5
    assert s["megatron_alltoall"]["median"] == pytest.approx(0.90)
    assert s["megatron_over_ours"] == pytest.approx(0.90 / 0.65)
    assert s["megatron_over_ours_per_round"] == pytest.approx([1.5, 2.0, 0.8125])
    assert s["best_mode_counts"] == {"domino:m4:cross": 1, "domino:m2:cross": 2}
    assert s["megatron_dispatch_copies_per_step"] == {"rank0->rank1": 993, "rank1->rank0": 1018}
    json.dumps(s)  # the --json report holds it


def test_format_cells():
    assert compare.fmt_ms({"median": 0.8124, "min": 0.6702, "max": 1.0128, "rounds": 4}) == \
        "812 (670-1013)"
    assert compare.fmt_ms({"median": 0.5, "min": 0.5, "max": 0.5, "rounds": 1}) == "500"
    assert compare.fmt_ms(None) == "-"
    assert compare.fmt_ratio(1.234, [1.1, 1.4]) == "1.23x (1.10-1.40)"
    assert compare.fmt_ratio(0.9, [0.9]) == "0.90x"
    assert compare.fmt_ratio(None, []) == "-"


def test_format_table_and_side_lines():
    loop = compare.LinkRounds("loopback")
    loop.add_ours({"sync": 0.5, "nocomm": 0.4, "domino:m2:cross": 0.45})
    loop.transports.append("ep shm")
    loop.add_megatron(_megatron_report([0.9]))
    slow = compare.LinkRounds("1gbit")
    slow.add_megatron(_megatron_report([0.6, 0.7]))  # a Megatron-only row (--skip-ours)
    summaries = [loop.summary(), slow.summary()]
    lines = compare.format_table(summaries).splitlines()
    assert lines[0] == ("| link | our sync | our nocomm | our best Domino | Megatron alltoall | "
                        "Megatron / ours |")
    assert lines[1] == "|---|---:|---:|---:|---:|---:|"
    assert lines[2] == "| loopback | 500 | 400 | 450 | 900 | 2.00x |"
    assert lines[3] == "| 1gbit emulated | - | - | - | 650 | - |"
    assert compare.format_best_modes(summaries) == "our best Domino mode per round: loopback: " \
        "m2:cross x1"
    assert compare.format_transports(summaries).endswith("loopback: ep shm")
    copies = compare.format_copies(summaries)
    assert "loopback: rank0->rank1 993, rank1->rank0 1018" in copies
    assert "1gbit emulated: rank0->rank1 993" in copies


def test_measure_interleaves_and_the_gloo_row_reuses_megatrons_loopback(monkeypatch, tmp_path):
    calls = []

    def ours(args, link, workdir, tag, gloo=False):
        calls.append(("ours", link, gloo, tag))
        return {"sync": 0.5, "domino:m2:cross": 0.4}, "ep gloo" if gloo else "ep shm"

    def megatron(args, link, workdir, tag):
        calls.append(("megatron", link, tag))
        return _megatron_report([0.5])

    monkeypatch.setattr(compare, "run_ours", ours)
    monkeypatch.setattr(compare, "run_megatron", megatron)
    args = compare.parse_args(["--rounds", "2", "--links", "loopback,1gbit", "--gloo-row"])
    rows = compare.measure(args, str(tmp_path))
    assert [(r.link, r.gloo) for r in rows] == [("loopback", False), ("loopback", True),
                                                ("1gbit", False)]
    assert calls[:5] == [("ours", "loopback", False, "r0_loopback"),
                         ("megatron", "loopback", "r0_loopback"),
                         ("ours", "loopback", True, "r0_loopback_gloo"),
                         ("ours", "1gbit", False, "r0_1gbit"),
                         ("megatron", "1gbit", "r0_1gbit")]
    assert calls[5] == ("megatron", "loopback", "r1_loopback")  # Megatron first in round 2
    assert sum(c[0] == "megatron" for c in calls) == 4  # never for the gloo row
    assert rows[1].megatron == rows[0].megatron == [0.5, 0.5]
    assert rows[1].transports == ["ep gloo", "ep gloo"]

    calls.clear()
    only = compare.parse_args(["--rounds", "1", "--skip-ours"])
    rows = compare.measure(only, str(tmp_path))
    assert [c[0] for c in calls] == ["megatron", "megatron"]
    assert rows[0].summary()["megatron_over_ours"] is None


def test_latest_markdown_holds_the_command_table_and_progress():
    report = {"date": "2026-12-02T10:00:00+00:00", "cpu_count": 2,
              "command": "python scripts/compare_megatron_moe/compare.py --rounds 1"}
    text = compare.latest_markdown(report, "| link | ... |", ["[round 1] loopback: ..."])
    assert text.startswith("# Latest run\n")
    assert "2026-12-02 (UTC)" in text and compare.SETUP_CMD in text
    assert "python scripts/compare_megatron_moe/compare.py --rounds 1" in text
    assert "| link | ... |" in text and "[round 1] loopback: ..." in text


def test_main_prints_the_table_and_writes_json_and_latest(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compare, "megatron_info",
                        lambda py: {"megatron_core": "0.16.1", "torch": "2.13.0+cpu"})
    monkeypatch.setattr(compare, "run_ours", lambda *a, **k: (
        {"sync": 0.5, "nocomm": 0.3, "domino:m2:cross": 0.4}, "ep gloo"))
    monkeypatch.setattr(compare, "run_megatron", lambda *a, **k: _megatron_report([0.6, 0.8]))
    monkeypatch.setattr(compare, "HERE", str(tmp_path))  # where --write-latest writes
    out = tmp_path / "all.json"
    argv = ["--rounds", "2", "--links", "loopback", "--json", str(out), "--write-latest"]
    assert compare.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| loopback | 500 (500-500) | 300 (300-300) | 400 (400-400) | 700 (700-700) | " \
        "1.75x (1.75-1.75) |" in printed
    report = json.loads(out.read_text())
    assert report["megatron_core_version"] == "0.16.1"
    assert report["rows"][0]["rounds"]["megatron_alltoall_s"] == [0.7, 0.7]
    assert report["rows"][0]["megatron_over_ours"] == pytest.approx(1.75)
    assert json.loads((tmp_path / "latest_output.json").read_text())["rows"] == report["rows"]
    md = (tmp_path / "latest_output.md").read_text()
    assert "| loopback | 500 (500-500)" in md and "[round 2] loopback: megatron" in md
