"""Tests for ``domino bench`` (domino.commands.bench; domino.bench spec / figures / execute /
modes / worker). No timing assertions."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from domino.bench import figures
from domino.bench.execute import launch_ranks
from domino.bench.modes import DEFAULT_MODES, parse_mode, parse_modes
from domino.bench.spec import build_config
from domino.cli import main
from domino.commands import bench
from domino.flops import train_flops_per_step
from domino.transformer import Plan

TINY = ["--hidden-size", "64", "--num-attention-heads", "4", "--num-layers", "2",
        "--seq-length", "32", "--micro-batch-size", "4", "--tensor-model-parallel-size", "2",
        "--steps", "2", "--warmup", "1"]

ROW_KEYS = {
    "mode", "comm_enabled", "micro_batches", "overlap", "column_chunks", "step_time_s",
    "step_times_s", "step_times_s_per_rank", "tokens_per_s", "exposed_comm_s",
    "exposed_comm_vs_split_nocomm_s", "split_cost_s", "comm_hidden", "speedup_vs_sync",
    "peak_mem_bytes", "peak_mem_bytes_per_rank", "peak_rss_bytes_per_rank", "timeline_png",
    "chrome_trace", "allreduce_bytes_per_step", "exchange_bytes_per_step", "comm_cpu_s_per_step",
    "sequence_parallel", "traced_work_s_per_rank", "traced_wait_s_per_rank",
    "model_flops_per_s_per_rank", "mfu", "compiled", "comm_hidden_paired", "cpu_s_per_step",
    "cpu_s_per_step_per_rank", "cpu_vs_split_nocomm_s",
}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


# ---- mode grammar -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name", "plan", "comm"),
    [
        ("sync", "sync", Plan(1, "none", 1), True),
        (" NoComm ", "nocomm", Plan(1, "none", 1), False),
        ("domino:m2:cross", "domino:m2:cross", Plan(2, "cross_layer", 1), True),
        ("Domino:M4:Cross:C2", "domino:m4:cross:c2", Plan(4, "cross_layer", 2), True),
        ("domino:m2:intra_layer:c1", "domino:m2:intra", Plan(2, "intra_layer", 1), True),
        ("domino:m1:none:c4", "domino:m1:none:c4", Plan(1, "none", 4), True),
        ("nocomm:m4:cross:c2", "nocomm:m4:cross:c2", Plan(4, "cross_layer", 2), False),
        ("sync:SP", "sync:sp", Plan(1, "none", 1), True),
        ("nocomm:sp", "nocomm:sp", Plan(1, "none", 1), False),
        ("domino:m2:cross_layer:sp", "domino:m2:cross:sp", Plan(2, "cross_layer", 1), True),
        ("nocomm:m4:cross:c2:sp", "nocomm:m4:cross:c2:sp", Plan(4, "cross_layer", 2), False),
        ("sync:Compiled", "sync:compiled", Plan(1, "none", 1), True),
        ("domino:m2:cross:sp:compiled", "domino:m2:cross:sp:compiled", Plan(2, "cross_layer", 1),
         True),
    ],
)
def test_parse_mode(text: str, name: str, plan: Plan, comm: bool) -> None:
    mode = parse_mode(text)
    assert (mode.name, mode.plan, mode.comm) == (name, plan, comm)
    assert mode.sequence_parallel == name.removesuffix(":compiled").endswith(":sp")
    assert mode.compiled == name.endswith(":compiled")
    assert mode.is_domino == name.startswith("domino:")
    assert parse_mode(mode.name) == mode  # canonical names parse back to themselves


@pytest.mark.parametrize(
    "bad",
    ["", "fast", "domino", "domino:m2", "domino:m0:cross", "domino:m2:sideways",
     "domino:m2:cross:c0", "domino:m2:cross:x3", "sync:m2:cross", "domino:2:cross", "sp",
     "sync:sp:sp", "domino:sp:m2:cross", "sync:compiled:sp", "nocomm:compiled:compiled"],
)
def test_parse_mode_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match=r"domino:m<N>:<none\|intra\|cross>"):
        parse_mode(bad)


def test_parse_modes() -> None:
    modes = parse_modes("sync, domino:m2:cross,domino:m2:cross_layer,,nocomm")
    assert [m.name for m in modes] == ["sync", "domino:m2:cross", "nocomm"]
    assert len(parse_modes(DEFAULT_MODES)) == len(DEFAULT_MODES.split(","))
    with pytest.raises(ValueError, match="empty"):
        parse_modes(" , ")


# ---- validation before any process starts -------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--modes", "domino:m8:cross"], "micro-batch"),
        (["--modes", "sync,bogus"], "unknown benchmark mode"),
        (["--num-attention-heads", "3"], "divisible"),
        (["--steps", "0"], "--steps"),
        (["--peak-tflops", "0"], "--peak-tflops=0.0 must be > 0"),
        (["--emulate-link", "fast"], "gbit"),
        (["--emulate-link", "1gb"], "invalid link rate"),
        (["--link-mtu", "9000"], "add --emulate-link"),
        (["--simulate-link", "1gbit", "--emulate-link", "1gbit"], "exclude each other"),
        (["--simulate-link", "fast"], "gbit"),
        (["--emulate-link", "1gbit", "--link-mtu", "100"], "--link-mtu=100"),
        (["--json", "/nonexistent-dir/x.json"], "does not exist"),
        (["--compile", "--modes", "sync,sync:compiled"], "drop one or the other"),
        (["--model", "moe"], "--model moe needs MoE layers: add --num-experts"),
        (["--expert-model-parallel-size", "2"], "needs MoE layers: add --num-experts"),
        (["--num-experts", "6", "--expert-model-parallel-size", "4"], "not divisible by"),
        (["--num-experts", "4", "--modes", "sync:sp,nocomm"], "nocomm lack it; end them in"),
        (["--num-experts", "4", "--tensor-model-parallel-size", "1", "--simulate-link",
          "1gbit"], "--tensor-model-parallel-size >= 2 or --expert-model-parallel-size >= 2"),
        (["--context-parallel-size", "3"], r"--seq-length 32 is not divisible by 2 x "
                                           r"--context-parallel-size = 6"),
        (["--context-parallel-size", "2", "--num-experts", "4"],
         "measures context parallelism and MoE in separate"),
        (["--context-parallel-size", "2", "--simulate-link", "1gbit"], "no context parallel"),
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a"],
         r"--tensor-model-parallel-size x --context-parallel-size = 8"),
        (["--context-parallel-size", "0"], "--context-parallel-size=0 must be >= 1"),
        (["--tensor-model-parallel-size", "4", "--context-parallel-size", "3", "--seq-length",
          "18", "--modes", "sync:sp"], "each CP rank's 6 tokens"),
    ],
)
def test_validation_errors(extra: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bench.run(_args(TINY + extra))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may emulate links")
def test_emulate_link_needs_root() -> None:
    with pytest.raises(ValueError, match="root"):
        bench.run(_args(TINY + ["--emulate-link", "1gbit"]))


def test_main_reports_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *TINY, "--modes", "domino:m2:diagonal"]) == 2
    assert "unknown benchmark mode" in capsys.readouterr().err


# ---- figures on synthetic measurements ----------------------------------------------------------


def test_compute_results_and_best_mode() -> None:
    modes = parse_modes("sync,nocomm,domino:m2:cross,domino:m4:cross:c2,nocomm:m4:cross:c2")
    med = {"sync": 1.0, "nocomm": 0.6, "domino:m2:cross": 0.7, "domino:m4:cross:c2": 0.65,
           "nocomm:m4:cross:c2": 0.62}
    raw = {
        "step_times_s": {n: [t, t] for n, t in med.items()},
        "per_rank_step_times_s": {n: [[t, t], [t, t]] for n, t in med.items()},
        "peak_bytes": {n: [10, 12] for n in med},
        "peak_rss_bytes": {n: [None, None] for n in med},
        "allreduce_8mib_cpu_s": 0.05,
        "allreduce_bytes_per_step": {n: 0 if n.startswith("nocomm") else 32 << 20 for n in med},
    }
    rows = {r["mode"]: r for r in figures.compute_results(raw, modes, tokens=100)}
    assert rows["sync"]["comm_cpu_s_per_step"] == pytest.approx(0.2)  # 4 x the 8 MiB probe
    assert rows["nocomm"]["comm_cpu_s_per_step"] == 0
    # 0.2 s of CPU over 2 busy CPUs takes 0.1 s from compute; sync exposes 0.4 s: <= 75% hideable.
    bound = figures.comm_cpu_bound(list(rows.values()), cpus=2)
    assert bound["floor_s"] == pytest.approx(0.1)
    assert bound["comm_hidden_ceiling"] == pytest.approx(0.75)
    assert figures.comm_cpu_bound([rows["nocomm"]], cpus=2) is None
    sp = {**rows["sync"], "mode": "sync:sp"}  # without a plain sync: its sequence-parallel kind
    assert figures.comm_cpu_bound([sp, rows["nocomm"]], cpus=2)["floor_s"] == pytest.approx(0.1)
    # Exchanged bytes (EP, CP) at the all-to-all probe's cost, the rest at the all-reduce's;
    # bytes of a kind whose probe did not run: no figure.
    assert figures.comm_cpu_s({"allreduce_8mib_cpu_s": 0.05, "exchange_8mib_cpu_s": 0.02},
                              24 << 20, 16 << 20) == pytest.approx(0.05 + 0.04)
    assert figures.comm_cpu_s({"allreduce_8mib_cpu_s": 0.05}, 24 << 20, 16 << 20) is None
    assert figures.comm_cpu_s({"exchange_8mib_cpu_s": 0.02}, 16 << 20, 16 << 20) == \
        pytest.approx(0.04)
    assert all(set(r) == ROW_KEYS for r in rows.values())
    assert rows["sync"]["comm_hidden"] is None and rows["nocomm"]["comm_hidden"] is None
    assert rows["domino:m2:cross"]["comm_hidden"] == pytest.approx(1 - 0.1 / 0.4)
    assert rows["domino:m2:cross"]["exposed_comm_vs_split_nocomm_s"] is None
    assert rows["domino:m4:cross:c2"]["exposed_comm_vs_split_nocomm_s"] == pytest.approx(0.03)
    assert rows["nocomm:m4:cross:c2"]["split_cost_s"] == pytest.approx(0.02)
    assert rows["sync"]["cpu_s_per_step"] is None  # no CPU times measured: no CPU figures
    # CPU per step: the ranks' mean per round, the median over rounds; against the split.
    raw["per_rank_step_cpu_s"] = {n: [[0.5, 0.7, 0.6], [0.7, 0.9, 0.8]] for n in med}
    raw["per_rank_step_cpu_s"]["domino:m4:cross:c2"] = [[0.9, 0.8, 1.0], [0.9, 1.2, 1.0]]
    cpu = {r["mode"]: r for r in figures.compute_results(raw, modes, tokens=100)}
    assert cpu["sync"]["cpu_s_per_step"] == pytest.approx(0.7)
    assert cpu["sync"]["cpu_s_per_step_per_rank"] == pytest.approx([0.6, 0.8])
    assert cpu["domino:m4:cross:c2"]["cpu_s_per_step"] == pytest.approx(1.0)
    assert cpu["domino:m4:cross:c2"]["cpu_vs_split_nocomm_s"] == pytest.approx(0.3)
    assert cpu["domino:m2:cross"]["cpu_vs_split_nocomm_s"] is None  # its split did not run
    assert rows["nocomm:m4:cross:c2"]["exposed_comm_s"] is None
    assert rows["domino:m2:cross"]["speedup_vs_sync"] == pytest.approx(1 / 0.7)
    assert rows["sync"]["tokens_per_s"] == pytest.approx(100.0)
    assert rows["sync"]["peak_mem_bytes"] == 12
    assert parse_mode(figures.best_mode(list(rows.values()))).plan == Plan(4, "cross_layer", 2)
    assert figures.best_mode([rows["sync"], rows["nocomm"]]) is None  # no Domino mode
    # Regime: sync exposes 67% of the comm-free step; the probe (8 MiB in 0.1 s, 0.05 CPU-s)
    # keeps 25% of 2 CPUs busy: link-bound, and the fastest Domino mode wins there.
    raw["allreduce_8mib_s"] = 0.1
    regime = figures.detect_regime(list(rows.values()), raw, cpus=2, busy=True)
    assert regime["name"] == "link-bound" and regime["comm_cpu_share"] == pytest.approx(0.25)
    assert regime["pick"] == "domino:m4:cross:c2"
    raw["allreduce_8mib_cpu_s"] = 0.16  # 80% of the host's CPUs: host-bound
    assert figures.detect_regime(list(rows.values()), raw, cpus=2, busy=True)["name"] == \
        "host-bound"
    assert figures.detect_regime(list(rows.values()), raw, cpus=2, busy=False)["name"] == \
        "link-bound"  # the ranks leave CPUs free: the probe's CPU cost does not compete
    rows["sync"]["step_time_s"] = 0.61  # sync within 5% of nocomm: negligible, no split
    regime = figures.detect_regime(list(rows.values()), raw, cpus=2, busy=True)
    assert (regime["name"], regime["pick"]) == ("negligible", "sync")
    assert figures.detect_regime([rows["sync"]], raw, cpus=2, busy=True) is None


def test_hidden_share_paired_by_round_cancels_drift() -> None:
    """The host slowing down 1.6x during round 3 (after its sync ran) moves the medians of
    different modes to different speeds; differences within a round (the modes run back to
    back) keep the share near what each speed alone shows (75%)."""
    modes = parse_modes("sync,nocomm,domino:m2:cross")
    times = {"nocomm": [0.6, 0.6, 0.96, 0.96, 0.96],
             "sync": [1.0, 1.0, 1.0, 1.6, 1.6],
             "domino:m2:cross": [0.7, 0.7, 1.12, 1.12, 1.12]}
    raw = {"step_times_s": times,
           "per_rank_step_times_s": {n: [t, t] for n, t in times.items()},
           "peak_bytes": {n: [1, 1] for n in times}, "peak_rss_bytes": {n: [None] for n in times}}
    rows = {r["mode"]: r for r in figures.compute_results(raw, modes, tokens=100)}
    dom = rows["domino:m2:cross"]
    assert dom["comm_hidden"] == pytest.approx(1 - 0.16 / 0.04)  # medians: fast sync, slow rest
    # Per round sync exposes 0.4, 0.4, 0.04, 0.64, 0.64 s (median 0.4), m2:cross 0.1, 0.1,
    # 0.16, 0.16, 0.16 (median 0.16).
    assert figures.paired_exposed_s(times, "sync", "nocomm") == pytest.approx(0.4)
    assert dom["comm_hidden_paired"] == pytest.approx(1 - 0.16 / 0.4)
    assert rows["sync"]["comm_hidden_paired"] is None  # for Domino modes only
    flat = {**times, "sync": list(times["nocomm"])}  # sync exposing nothing: no share
    assert figures.hidden_share_paired(flat, "domino:m2:cross", "sync", "nocomm") is None


def test_sequence_parallel_modes_take_their_own_baselines() -> None:
    """An :sp mode's exposed and hidden figures are against sync:sp and nocomm:sp, and its
    split comparison against the comm-free run of the same split *and* layout."""
    modes = parse_modes("sync,nocomm,domino:m2:cross,nocomm:m2:cross,sync:sp,nocomm:sp,"
                        "domino:m2:cross:sp,nocomm:m2:cross:sp")
    med = {"sync": 1.0, "nocomm": 0.6, "domino:m2:cross": 0.7, "nocomm:m2:cross": 0.65,
           "sync:sp": 1.2, "nocomm:sp": 0.5, "domino:m2:cross:sp": 0.6,
           "nocomm:m2:cross:sp": 0.55}
    raw = {"step_times_s": {n: [t] for n, t in med.items()},
           "per_rank_step_times_s": {n: [[t], [t]] for n, t in med.items()},
           "peak_bytes": {n: [1, 1] for n in med}, "peak_rss_bytes": {n: [None] for n in med}}
    rows = {r["mode"]: r for r in figures.compute_results(raw, modes, tokens=100)}
    sp = rows["domino:m2:cross:sp"]
    assert sp["sequence_parallel"] and not rows["domino:m2:cross"]["sequence_parallel"]
    assert sp["exposed_comm_s"] == pytest.approx(0.1)  # vs nocomm:sp, not nocomm
    assert sp["comm_hidden"] == pytest.approx(1 - 0.1 / 0.7)  # sync:sp exposes 0.7 s
    assert sp["exposed_comm_vs_split_nocomm_s"] == pytest.approx(0.05)
    assert sp["speedup_vs_sync"] == pytest.approx(1.2 / 0.6)
    assert rows["domino:m2:cross"]["comm_hidden"] == pytest.approx(1 - 0.1 / 0.4)
    assert rows["domino:m2:cross"]["exposed_comm_vs_split_nocomm_s"] == pytest.approx(0.05)


def test_compiled_modes_take_compiled_baselines_only() -> None:
    """A :compiled mode's exposed, hidden and speedup figures are against sync:compiled and
    nocomm:compiled (an :sp:compiled one falls back to those), never the eager ones; without
    compiled baselines they are unknown; the best Domino mode is picked among the eager
    modes, which the eager sync is read against."""
    modes = parse_modes("sync,nocomm,domino:m2:cross,sync:compiled,nocomm:compiled,"
                        "domino:m2:cross:compiled,domino:m2:cross:sp:compiled")
    med = {"sync": 1.0, "nocomm": 0.6, "domino:m2:cross": 0.7, "sync:compiled": 0.9,
           "nocomm:compiled": 0.4, "domino:m2:cross:compiled": 0.5,
           "domino:m2:cross:sp:compiled": 0.45}

    def rows_of(names):
        raw = {"step_times_s": {n: [med[n]] for n in names},
               "per_rank_step_times_s": {n: [[med[n]], [med[n]]] for n in names},
               "peak_bytes": {n: [1, 1] for n in names},
               "peak_rss_bytes": {n: [None] for n in names}}
        chosen = [m for m in modes if m.name in names]
        return {r["mode"]: r for r in figures.compute_results(raw, chosen, tokens=100)}

    rows = rows_of(list(med))
    c = rows["domino:m2:cross:compiled"]
    assert c["compiled"] and c["exposed_comm_s"] == pytest.approx(0.1)  # vs nocomm:compiled
    assert c["comm_hidden"] == pytest.approx(1 - 0.1 / 0.5)  # sync:compiled exposes 0.5 s
    assert c["speedup_vs_sync"] == pytest.approx(0.9 / 0.5)
    assert rows["domino:m2:cross:sp:compiled"]["exposed_comm_s"] == pytest.approx(0.05)
    assert rows["domino:m2:cross"]["comm_hidden"] == pytest.approx(1 - 0.1 / 0.4)
    assert figures.best_mode(list(rows.values())) == "domino:m2:cross"  # eager beside eager
    alone = rows_of(["sync", "nocomm", "domino:m2:cross:compiled"])["domino:m2:cross:compiled"]
    assert alone["exposed_comm_s"] is None and alone["comm_hidden"] is None
    assert alone["speedup_vs_sync"] is None


def test_simulated_link_charges_each_kind_its_bytes() -> None:
    """Bytes on one rank's link: an all-reduce twice (size-1)/size of its buffer; an all-to-all
    (shown the rows it sends other ranks) and point-to-point sends all they send; transfers
    queue."""
    from domino.bench.hooks import SimulatedLink

    link = SimulatedLink(8e6)  # 1 MB/s: n bytes take n microseconds
    t0 = time.perf_counter()
    works = [link.schedule(1000, 2, "all_reduce"), link.schedule(1000, 4, "all_to_all"),
             link.schedule(1000, 2, "p2p")]
    ends = [w.done_at - t0 for w in works]
    assert ends[0] == pytest.approx(1000e-6, abs=5e-4)
    assert ends[1] - ends[0] == pytest.approx(1000e-6, rel=1e-6)
    assert ends[2] - ends[1] == pytest.approx(1000e-6, rel=1e-6)


def test_cpu_probe_takes_the_median_window() -> None:
    """The 8 MiB probe's CPU per all-reduce is the median over windows: one window disturbed
    by another process on the host (here 10x the others) does not move it."""
    from domino.bench.probe import cpu_per_op

    windows = [(10.0, 10.1, 2), (20.0, 20.15, 3), (30.0, 31.0, 2), (40.0, 40.1, 2)]
    assert cpu_per_op(windows) == pytest.approx(0.05)
    assert cpu_per_op([(None, None, 3)]) is None


# ---- real runs ----------------------------------------------------------------------------------


def test_real_two_rank_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_dir = tmp_path / "bench.json", tmp_path / "traces"
    modes = ("sync,nocomm,domino:m2:cross,domino:m2:intra:c2,nocomm:m2:cross,domino:m2:cross:sp,"
             "domino:m2:cross:compiled")
    # Two measured rounds (each records a time per mode, the second in rotated order), no
    # warm-up round: the :compiled mode's pieces compile in the step before the timed ones.
    argv = TINY[:-2] + ["--warmup", "0", "--modes", modes, "--json", str(out_json),
                        "--out-dir", str(out_dir), "--compile-backend", "aot_eager"]
    assert main(["bench", *argv]) == 0
    table = capsys.readouterr().out
    assert "best Domino mode: domino:m2:" in table
    # The :compiled mode ran a compiled twin, compiled before the timed steps and not in them.
    assert re.search(r"compiled pieces \(aot_eager\): \d+ forward graphs in [\d.]+ s before "
                     r"the timed steps\n", table)

    report = json.loads(out_json.read_text())
    config = report["config"]
    assert config["tensor_model_parallel_size"] == 2 and config["link"] == "loopback"
    assert config["transports"] == {"tp": "shm", "dp": "-"} and "TP over shm" in table
    # every rank kept its freed memory (domino.host_memory), and the header says so
    assert config["host_malloc"] == "freed memory kept" and "malloc keeps freed memory" in table
    assert config["torch_version"] and config["memory_method"] and config["timing_method"]
    assert config["compile_graphs"] > 0 and config["compile_graphs_timed"] == 0
    assert config["modes"] == modes.split(",")
    rows = {r["mode"]: r for r in report["results"]}
    assert list(rows) == modes.split(",")
    for name, r in rows.items():
        assert set(r) == ROW_KEYS, name
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert len(r["step_times_s"]) == 2 and all(t > 0 for t in r["step_times_s"])
        assert len(r["step_times_s_per_rank"]) == 2
        assert len(r["peak_mem_bytes_per_rank"]) == 2 and r["peak_mem_bytes"] > 0
        # each rank's process CPU time per step (all its threads)
        assert 0 < r["cpu_s_per_step"] and len(r["cpu_s_per_step_per_rank"]) == 2
        assert r["comm_enabled"] == (not name.startswith("nocomm"))
        assert r["compiled"] == name.endswith(":compiled")
        # Model FLOPs per rank over the step time; MFU against the measured GEMM rate.
        assert r["model_flops_per_s_per_rank"] * r["step_time_s"] * 2 == pytest.approx(
            config["model_flops_per_step"], rel=1e-9)
        assert r["mfu"] == pytest.approx(r["model_flops_per_s_per_rank"]
                                         / config["peak_flops_per_s"], rel=1e-9)
    stack = build_config({**config, "vocab_size": 0})  # the stack: layers only, no LM head
    assert config["model_flops_per_step"] == train_flops_per_step(stack, 4 * 32, head=False)
    assert config["mfu_of"] == "of measured GEMM rate" and config["peak_flops_per_s"] > 0
    assert "TFLOP/s/rank" in table and "MFU" in table
    # The attention's paths, measured by both ranks at the model's shapes, in the header.
    assert config["attention_backend"] == "auto"
    assert re.match(r"auto: causal \w+, .*\((measured|cached) at float32, batch 4 x 2 heads "
                    r"x seq 32 x 16, causal masks; ms per fwd\+bwd causal: flash ",
                    config["attention"]) and f"attention {config['attention']}\n" in table
    for name in ("sync", "nocomm", "nocomm:m2:cross"):
        assert rows[name]["comm_hidden"] is None
    assert rows["sync"]["speedup_vs_sync"] == pytest.approx(1.0)
    # "hidden" is a share of what sync exposes: undefined when, on a run this small over shared
    # memory, sync came out no slower than nocomm (timing decides which; both are checked).
    sync_exposed = rows["sync"]["exposed_comm_s"]
    for name in ("domino:m2:cross", "domino:m2:intra:c2"):
        assert rows[name]["exposed_comm_s"] is not None
        assert (rows[name]["comm_hidden"] is not None) == (sync_exposed > 0), (name, rows)
    assert rows["domino:m2:cross"]["exposed_comm_vs_split_nocomm_s"] is not None
    assert rows["domino:m2:cross"]["cpu_vs_split_nocomm_s"] is not None and "CPU ms" in table
    assert rows["domino:m2:intra:c2"]["exposed_comm_vs_split_nocomm_s"] is None
    assert (rows["domino:m2:intra:c2"]["micro_batches"], rows["domino:m2:intra:c2"]["overlap"],
            rows["domino:m2:intra:c2"]["column_chunks"]) == (2, "intra_layer", 2)
    assert report["best_domino_mode"] in ("domino:m2:cross", "domino:m2:intra:c2",
                                          "domino:m2:cross:sp", "domino:m2:cross:compiled")
    regime = report["regime"]
    assert regime["name"] in ("negligible", "host-bound", "link-bound")
    assert f"regime: {regime['name']} ({regime['why']}) -> pick {regime['pick']}" in table
    assert parse_mode(figures.best_mode(report["results"])).plan in (Plan(2, "cross_layer", 1),
                                                                      Plan(2, "intra_layer", 2))
    sp = rows["domino:m2:cross:sp"]  # against sync and nocomm: no :sp baselines ran
    assert sp["sequence_parallel"] and sp["exposed_comm_s"] is not None
    assert sp["allreduce_bytes_per_step"] > 0

    # Comm volume: per layer two forward and two backward all-reduces of [s, b, h] fp32, whatever
    # the split; none without comm. The 8 MiB probe's host CPU cost scales it to a step.
    # Sequence parallel: each becomes a reduce-scatter of that tensor and an all-gather into
    # one (counted at that size each), plus one all-reduce of the norm and bias gradients the
    # shards touched (per block norm weight and bias, dense bias; the final norm).
    s, b, h, layers = 32, 4, 64, 2
    for name, r in rows.items():
        expected = 0 if name.startswith("nocomm") else 4 * layers * s * b * h * 4
        if name.endswith(":sp"):
            expected = 2 * expected + (2 * layers * 3 * h + 2 * h) * 4
        assert r["allreduce_bytes_per_step"] == expected, name
    assert config["allreduce_8mib_s"] > 0 and config["allreduce_8mib_cpu_s"] > 0
    assert rows["sync"]["comm_cpu_s_per_step"] == pytest.approx(
        config["allreduce_8mib_cpu_s"] * rows["sync"]["allreduce_bytes_per_step"] / (8 << 20))
    bound = report["comm_cpu_bound"]  # 2 ranks x 1 thread fill this 2-CPU host
    if (os.cpu_count() or 1) <= 2:
        assert bound["comm_cpu_s_per_step"] == rows["sync"]["comm_cpu_s_per_step"]
    mib = rows["sync"]["allreduce_bytes_per_step"] / 2**20
    if bound is not None:
        assert f"comm per step: {mib:.1f} MiB all-reduced per rank, at least" in table

    # Traced: every comm-enabled mode; comm-free ones have nothing to overlap.
    for name in ("sync", "domino:m2:cross", "domino:m2:intra:c2"):
        png, trace = Path(rows[name]["timeline_png"]), Path(rows[name]["chrome_trace"])
        assert png.parent == out_dir and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        events = json.loads(trace.read_text())["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == {0, 1}
        assert {"compute", "comm"} <= {e["cat"] for e in spans}
        # Each rank worked and (sync) waited some of its traced step, at most all of it.
        step = [max(e["ts"] + e["dur"] for e in spans if e["pid"] == r)
                - min(e["ts"] for e in spans if e["pid"] == r) for r in (0, 1)]
        work, wait = rows[name]["traced_work_s_per_rank"], rows[name]["traced_wait_s_per_rank"]
        for r in (0, 1):
            assert 0 < work[r] and 0 <= wait[r] and work[r] + wait[r] <= step[r] / 1e6 + 1e-6
        assert name != "sync" or min(wait) > 0, (name, wait)
    assert rows["nocomm"]["timeline_png"] is None
    assert rows["nocomm"]["traced_work_s_per_rank"] is None
    assert "traced step, per rank: sync worked " in table


# The ranks meet on MASTER_PORT as a process group's would (without importing torch: seconds of
# CPU per rank), then rank 1 fails.
_CRASHING_WORKER = """
import os, socket, sys, time
addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
if os.environ["RANK"] == "1":
    for _ in range(600):
        try:
            socket.create_connection(addr).close()
            break
        except OSError:
            time.sleep(0.1)
    sys.exit(3)
server = socket.create_server(addr)
peer, _ = server.accept()
time.sleep(600)  # rank 0 would wait far longer than the test allows
"""


def test_failed_rank_stops_the_others(tmp_path: Path) -> None:
    spec = {"tensor_model_parallel_size": 2, "threads_per_rank": 1, "timeout": 600}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        launch_ranks(str(spec_path), spec, None, worker=(sys.executable, "-c", _CRASHING_WORKER))
    # launch_ranks waits for every rank it stopped, so returning at all means none is left running.
    assert time.monotonic() - t0 < 60


def test_simulated_link_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--simulate-link: every all-reduce takes the link's time (no data moved, no root needed)."""
    out_json = tmp_path / "sim.json"
    # One measured round, no warm-up and a given peak (no GEMM timing): only the link's floor
    # under each step is checked here (the real run above checks rounds and MFU).
    argv = TINY[:-4] + ["--steps", "1", "--warmup", "0", "--peak-tflops", "1",
                        "--modes", "sync,nocomm,domino:m2:cross", "--simulate-link", "100mbit",
                        "--json", str(out_json)]
    assert main(["bench", *argv]) == 0
    assert "link 100mbit simulated" in capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["config"]["link_rate_bits_per_s"] == 1e8
    assert report["comm_cpu_bound"] is None
    rows = {r["mode"]: r for r in report["results"]}
    # Sync waits for every transfer in turn: at least bytes * 8 / rate per step (2 ranks: each
    # all-reduce moves its size once per rank).
    floor = rows["sync"]["allreduce_bytes_per_step"] * 8 / 1e8
    assert floor > 0.02 and min(rows["sync"]["step_times_s"]) >= floor
    # Expert parallelism: the link times the rows' all-to-alls (the counts travel for real, so
    # each rank's experts compute the rows the routing sends them). Sync waits for each: at
    # least the time of the bytes that cross the link, the rows sent to the other rank.
    argv = TINY[:-6] + ["--steps", "1", "--warmup", "0", "--peak-tflops", "1", "--model", "moe",
                        "--num-experts", "4", "--tensor-model-parallel-size", "1",
                        "--expert-model-parallel-size", "2", "--moe-router-force-load-balancing",
                        "--modes", "sync,domino:m2:cross", "--simulate-link", "100mbit",
                        "--json", str(out_json)]
    assert main(["bench", *argv]) == 0
    rows = {r["mode"]: r for r in json.loads(out_json.read_text())["results"]}
    floor = rows["sync"]["exchange_bytes_per_step"] * 8 / 1e8
    assert floor > 0.01 and min(rows["sync"]["step_times_s"]) >= floor


def test_ranks_failing_together_are_all_named() -> None:
    """A peer that loses the failing rank may exit before it: both are named, whatever the
    order their processes end in."""
    from domino.supervisor import RankFailed, run_ranks

    first = [sys.executable, "-c", "import sys; sys.exit(1)"]
    late = [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"]
    with pytest.raises(RankFailed, match=r"ranks 0, 1 exited with codes 1, 3"):
        run_ranks([first, late], [dict(os.environ)] * 2, label="test")


def test_context_parallel_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--context-parallel-size 2 (TP = 1, two ranks holding a head and a tail chunk of each
    sequence): the ring's transfers are counted (sync waits for them, Domino overlaps them,
    nocomm sends nothing) and traced on the timeline."""
    out_json, out_dir = tmp_path / "cp.json", tmp_path / "traces"
    argv = TINY[:-6] + ["--steps", "1", "--warmup", "0", "--peak-tflops", "1",
                        "--tensor-model-parallel-size", "1", "--context-parallel-size", "2",
                        "--modes", "sync,nocomm,domino:m2:cross", "--json", str(out_json),
                        "--out-dir", str(out_dir)]
    assert main(["bench", *argv]) == 0
    assert "TP=1 x CP=2 (p2p)" in capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["config"]["context_parallel_size"] == 2
    assert report["config"]["tokens_per_step"] == 4 * 32  # one sequence set, split
    rows = {r["mode"]: r for r in report["results"]}
    # Per layer: forward the other rank's K/V block, backward its dK/dV (fp32, 16 tokens x 64
    # each of K and V), for the 2 layers of TINY
    block = 2 * 16 * 4 * 64 * 4
    for mode in ("sync", "domino:m2:cross"):
        assert rows[mode]["allreduce_bytes_per_step"] == 2 * 2 * block, rows[mode]
    assert rows["nocomm"]["allreduce_bytes_per_step"] == 0
    trace = json.loads((out_dir / "trace_sync.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"cp fwd kv", "cp bwd dkv"} <= names, names


def test_moe_expert_parallel_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--model moe at EP = 2 (two ranks with their own tokens, TP = 1): the MoE blocks alone
    under sync, Domino and comm-free modes; the step all-to-alls its rows (counted), and the
    comm-free mode sends nothing."""
    out_json = tmp_path / "moe.json"
    argv = TINY[:-6] + ["--steps", "1", "--warmup", "0", "--peak-tflops", "1",
                        "--model", "moe", "--num-experts", "4",
                        "--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "2",
                        "--moe-router-force-load-balancing",
                        "--modes", "sync,nocomm,domino:m2:cross:c2", "--json", str(out_json)]
    assert main(["bench", *argv]) == 0
    out = capsys.readouterr().out
    assert "domino:m2:cross:c2" in out
    report = json.loads(out_json.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert report["config"]["tokens_per_step"] == 2 * 4 * 32  # each EP rank its own tokens
    # fwd + bwd dispatch and combine: at least 4 x the rows sent (T x k / 2 cross the link on
    # average, 64 floats + the weight column each) - a lower bound, routing is random
    assert rows["sync"]["allreduce_bytes_per_step"] > 4 * 32 * 4 * 64 * 4 * 0.25
    assert rows["nocomm"]["allreduce_bytes_per_step"] == 0
    # All of it exchanged (TP = 1), counted without the rows a rank sends itself (half of
    # them, balanced): well under the rows of all T x k assignments (64 + 4 floats: the weight
    # and padding) in each of the 4 exchanges of each of the 2 layers.
    for name in ("sync", "domino:m2:cross:c2"):
        r = rows[name]
        assert r["exchange_bytes_per_step"] == r["allreduce_bytes_per_step"], name
        assert r["allreduce_bytes_per_step"] < 0.75 * 2 * 4 * (32 * 4 * 2) * 68 * 4, name
    # The all-to-all probe ran on the EP group and prices the step's exchanges.
    config = report["config"]
    assert config["allreduce_8mib_s"] is None and config["exchange_8mib_s"] > 0
    if config["exchange_8mib_cpu_s"] is not None:
        assert rows["sync"]["comm_cpu_s_per_step"] == pytest.approx(
            config["exchange_8mib_cpu_s"] * rows["sync"]["exchange_bytes_per_step"] / (8 << 20))
        if (os.cpu_count() or 1) <= 2:  # 2 ranks x 1 thread fill the host: a bound
            mib = rows["sync"]["exchange_bytes_per_step"] / 2**20
            assert report["comm_cpu_bound"]["exchange_bytes_per_step"] > 0
            assert f"comm per step: {mib:.1f} MiB exchanged per rank, at least" in out
    assert all(r["step_time_s"] > 0 for r in rows.values())
