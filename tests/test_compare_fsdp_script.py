"""Pure helpers of scripts/compare_fsdp/ (compare.py, fsdp_figures.py, largest.py): no
processes trained, no timing asserted."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "compare_fsdp")


def _load(name: str, module: str):
    spec = importlib.util.spec_from_file_location(module, os.path.join(_DIR, name))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


compare = _load("compare.py", "compare_fsdp")
figures = sys.modules["fsdp_figures"]  # (compare.py imports it from its folder)
largest = _load("largest.py", "compare_fsdp_largest")

# The lines domino train prints, as they come (progress bar in front, nested brackets).
LOG = (
    "train:   0%|          | 0/6 [00:00<?, ?step/s]      model state per rank implied by "
    "--data-parallel-sharding-strategy optim_grads_params: 145.8 MiB (weights 28.6 + gradients "
    "38.3 + optimizer 78.9; docs/parallelism.md)\n"
    "train:   0%|          | 0/6 [00:01<?, ?step/s]      model: 13,790,208 parameters | TP=1 x "
    "DP=2 | global batch 8 x 256 tokens\n"
    "train: 100%|##########| 6/6 [00:16<00:00,  2.78s/step, loss=6.680]       peak memory per "
    "rank (process RSS high-water mark (VmHWM)): 676, 664 MiB; optimizer state per rank: 78.9, "
    "78.9 MiB (sharded over DP); model state per rank (weights + gradients + optimizer): 109.7 "
    "(4.5 + 26.3 + 78.9), 109.6 (4.5 + 26.2 + 78.9) MiB\n")


def test_help_runs_as_a_script():
    for name in ("compare.py", "largest.py"):
        out = subprocess.run([sys.executable, os.path.join(_DIR, name), "--help"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        assert out.startswith("usage:")
    out = subprocess.run([sys.executable, os.path.join(_DIR, "compare.py"), "--help"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert "--emulated-systems" in out and "optim_grads_params_waited" in out


def test_parses_domino_train_lines():
    assert figures.parse_peaks_mib(LOG) == [676.0, 664.0]
    assert figures.parse_model_state_mib(LOG) == [109.7, 109.6]
    assert figures.parse_implied_mib(LOG) == 145.8
    assert figures.parse_param_count(LOG) == 13790208
    with pytest.raises(ValueError, match="peak memory per rank"):
        figures.parse_peaks_mib("no such line")
    assert figures.parse_model_state_mib("") == [] and figures.parse_implied_mib("") is None


def test_run_figures_leave_out_the_warmup():
    records = [{"step": i, "loss": 7.0 - i, "step_time_s": t, "exposed_dp_comm_s": e}
               for i, (t, e) in enumerate([(9.0, 5.0), (8.0, 4.0), (2.0, 0.2), (1.0, 0.1),
                                           (4.0, 0.3)], start=1)]
    fig = compare.ours_figures(records, LOG, warmup=2, tokens_per_step=2048)
    assert fig["step_s"] == 2.0 and fig["tokens_s"] == 1024.0
    assert fig["exposed_dp_s"] == 0.2 and fig["peak_mib"] == 676.0
    assert fig["params"] == 13790208 and fig["model_state_mib"] == [109.7, 109.6]
    with pytest.raises(ValueError, match="warm-up"):
        compare.ours_figures(records, LOG, warmup=5, tokens_per_step=2048)
    report = {"step_times_s": [1.0, 3.0, 2.0], "peak_mem_bytes_per_rank": [700 * 2**20,
                                                                          710 * 2**20],
              "model_state_bytes_rank0": {"weights": 2**20, "grads": 2**20, "optimizer": 2**21},
              "params": 13790208, "losses": [7.7]}
    peer = compare.fsdp2_figures(report, tokens_per_step=2048)
    assert peer["step_s"] == 2.0 and peer["peak_mib"] == 710.0
    assert peer["exposed_dp_s"] is None and peer["model_state_mib"] == [4.0]


def _cells(ogp_step, ns_step, peer_step, ogp_exposed, waited_exposed):
    def cell(step, exposed=None, peak=700.0):
        return compare.cell_summary([{"step_s": step, "tokens_s": 2048 / step, "peak_mib": peak,
                                      "step_min_s": step * 0.8, "exposed_dp_s": exposed,
                                      "model_state_mib": [110.0]}])
    return {"optim_grads_params": cell(ogp_step, ogp_exposed, 650.0),
            "no_shard": cell(ns_step, 0.0), "fsdp2": cell(peer_step, None, 700.0),
            compare.WAITED: cell(ogp_step + 0.5, waited_exposed, 660.0)}


def test_goals_and_tables():
    loop = compare.goals(_cells(1.05, 1.0, 1.2, None, None), emulated=False)
    assert loop["ogp_over_no_shard_step"] == pytest.approx(1.05)
    assert loop["ogp_over_fsdp2_tokens"] == pytest.approx(1.2 / 1.05)
    assert loop["met"] == {"within_1.10x_of_no_shard": True, "tokens_vs_fsdp2": True,
                           "memory_vs_fsdp2": True, "hidden_80pct": None}
    slow = compare.goals(_cells(2.0, 1.0, 2.2, 0.3, 1.0), emulated=True)
    assert slow["hidden_share"] == pytest.approx(0.7) and slow["step_saved_share"] == 0.5
    assert slow["met"]["tokens_vs_fsdp2"] is False  # 1.1x < 1.2x on a slow link
    assert slow["met"]["hidden_80pct"] is False and slow["met"]["within_1.10x_of_no_shard"] is None
    rows = [{"link": "1gbit", "dtype": "bf16", "system": s, **c}
            for s, c in _cells(2.0, 1.0, 2.2, 0.3, 1.0).items()]
    table = compare.format_table(rows).splitlines()
    assert table[0].startswith("| link | dtype | system | step ms | fastest step ms | tokens/s |")
    assert table[2] == ("| 1gbit emulated | bf16 | ours optim_grads_params | 2000 | 1600 | 1024 "
                        "| 650 | 300 | 110.0 |")
    assert "| FSDP2 (prefetch 1) | 2200 | 1760 | 931 | 700 | - |" in table[4]
    goal = compare.format_goals([{"link": "1gbit", "dtype": "bf16", **slow}]).splitlines()
    assert slow["hidden_beyond_no_shard"] == pytest.approx(0.7)  # no_shard exposed 0 here
    assert goal[2] == ("| 1gbit emulated | bf16 | 2.00x; fastest steps 2.00x | 1.10x (not met); "
                       "fastest steps 1.10x | 0.93x (met) | 70% (not met) | 70% | 50% |")


def test_ranges_over_rounds():
    runs = [{"step_s": s, "tokens_s": 2048 / s, "peak_mib": 600.0 + i, "exposed_dp_s": None}
            for i, s in enumerate([0.8124, 0.6702, 1.0128])]
    cell = compare.cell_summary(runs)
    assert compare._fmt(cell["step_s"], 1e3) == "812 (670-1013)"
    assert compare._fmt(cell["peak_mib"]) == "601 (600-602)" and cell["exposed_dp_s"] is None


def test_systems_rotate_and_the_waited_one_runs_on_emulated_links(monkeypatch, tmp_path):
    assert compare.order_for_round(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert compare.order_for_round(["a", "b", "c"], 4) == ["b", "c", "a"]
    with pytest.raises(ValueError, match="unknown system 'zero3'"):
        compare.parse_systems("fsdp2,zero3")
    calls = []

    def fake(args, system, link, dtype, workdir, tag):
        calls.append((link, dtype, system))
        return {"step_s": 1.0, "tokens_s": 1.0, "peak_mib": 1.0, "exposed_dp_s": None,
                "params": 10}

    monkeypatch.setattr(compare, "run_ours", fake)
    monkeypatch.setattr(compare, "run_fsdp2", fake)
    # (domino's rate parser imports torch: seconds this test does not need)
    monkeypatch.setattr(compare, "parse_links", lambda text: text.split(","))
    args = compare.parse_args(["--rounds", "2", "--dtypes", "bf16"])
    runs = compare.measure(args, str(tmp_path))
    assert calls[:3] == [("loopback", "bf16", s) for s in ("fsdp2", "no_shard",
                                                           "optim_grads_params")]
    assert calls[3:7] == [("1gbit", "bf16", s) for s in compare.DEFAULT_EMULATED.split(",")]
    assert calls[7] == ("loopback", "bf16", "no_shard")  # round 2 starts one later
    assert ("loopback", "bf16", compare.WAITED) not in runs
    assert compare.check_same_model(runs) == 10
    runs[("1gbit", "bf16", "fsdp2")][0]["params"] = 11
    with pytest.raises(SystemExit, match="parameter counts differ"):
        compare.check_same_model(runs)


def test_largest_fit_and_depths():
    a, b = largest.fit_line([4, 10, 16], [1000.0, 1600.0, 2200.0])
    assert (round(a, 6), round(b, 6)) == (600.0, 100.0)
    assert largest.largest_depth(a, b, 11000.0) == 104
    assert largest.depth_over(a, b, 1.05 * 11000.0) == 110
    with pytest.raises(ValueError, match="distinct depths"):
        largest.fit_line([4, 4], [1.0, 2.0])
    assert largest.layer_params(512) == 3152384  # what domino train counts per layer
    assert largest.formula_bytes_per_param("optim", 2) == 14
    assert largest.formula_bytes_per_param("optim_grads_params", 2) == 8


def test_tabulate_reads_what_kept_runs_left(monkeypatch, tmp_path):
    import json

    monkeypatch.setattr(compare, "parse_links", lambda text: text.split(","))
    ours = tmp_path / "ours_r0_loopback_fp32_optim_grads_params"
    ours.mkdir()
    ours.with_suffix(".log").write_text(LOG)
    (ours / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "loss": 7.0, "step_time_s": t, "exposed_dp_comm_s": 0.1}) + "\n"
        for i, t in enumerate([5.0, 2.0, 3.0], start=1)))
    (tmp_path / "fsdp2_r0_loopback_fp32_fsdp2.json").write_text(json.dumps({
        "step_times_s": [4.0, 6.0], "peak_mem_bytes_per_rank": [2**30, 2**30], "params": 13790208,
        "model_state_bytes_rank0": {"weights": 0, "grads": 0, "optimizer": 0}, "losses": []}))
    (tmp_path / "figures_r0_loopback_fp32_fsdp2.json").write_text(json.dumps({"load_1min": 3.5}))
    args = compare.parse_args(["--rounds", "1", "--links", "loopback", "--dtypes", "fp32",
                               "--loopback-systems", "fsdp2,optim_grads_params", "--warmup", "1",
                               "--tabulate", str(tmp_path)])
    runs = compare.measure(args, args.tabulate, read_only=True)
    assert runs[("loopback", "fp32", "optim_grads_params")][0]["step_s"] == 2.5
    assert runs[("loopback", "fp32", "optim_grads_params")][0]["load_1min"] is None
    peer = runs[("loopback", "fp32", "fsdp2")][0]
    assert (peer["step_s"], peer["step_min_s"], peer["peak_mib"], peer["load_1min"]) == \
        (5.0, 4.0, 1024.0, 3.5)
