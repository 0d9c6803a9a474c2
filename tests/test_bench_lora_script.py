"""Pure helpers of scripts/bench_lora.py on fixed `domino train` output (no runs started, no
timing asserted), and its --help."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_lora.py")
_spec = importlib.util.spec_from_file_location("bench_lora", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# The lines of a LoRA run the script reads (tqdm's bar before the memory line, as printed).
LORA_OUT = (
    "model: 262,144 parameters | TP=2 x DP=1 | global batch 8 x 128 tokens = micro-batch 8 x "
    "DP 1 x 1 accumulation step(s) | Domino plan m2:cross inside each micro-batch | 48 train\n"
    "train: 100%|##########| 6/6 [00:05<00:00,  1.15step/s, loss=7.470]    peak memory per rank "
    "(process RSS high-water mark (VmHWM)): 434, 422 MiB; optimizer state per rank: 1.3, 1.3 "
    "MiB; model state per rank (weights + gradients + optimizer): 9.7 (7.8 + 0.6 + 1.3), 9.7 "
    "(7.8 + 0.6 + 1.3) MiB\n")
FULL_OUT = LORA_OUT.replace("434, 422", "416, 430").replace(
    "9.7 (7.8 + 0.6 + 1.3), 9.7 (7.8 + 0.6 + 1.3)", "28.7 (7.2 + 7.2 + 14.3), 28.7 (7.2 + 7.2 + "
    "14.3)")


def test_parse_output_reads_memory_state_batch_and_plan():
    got = bench.parse_output(LORA_OUT)
    assert got["memory_method"] == "process RSS high-water mark (VmHWM)"
    assert got["peak_mib"] == [434.0, 422.0]
    assert got["state_mib"] == [{"total": 9.7, "weights": 7.8, "grads": 0.6,
                                 "optimizer": 1.3}] * 2
    assert got["tokens_per_step"] == 8 * 128
    assert got["plan"] == "m2:cross"
    with pytest.raises(ValueError, match="model state"):
        bench.parse_output(LORA_OUT.split("; model state")[0])


def test_step_times_skip_warmup():
    lines = "\n".join(json.dumps({"step": i + 1, "step_time_s": t})
                      for i, t in enumerate([9.0, 5.0, 0.3, 0.1, 0.2]))
    assert bench.step_times_ms(lines, 2) == pytest.approx([300.0, 100.0, 200.0])
    with pytest.raises(ValueError, match="warm-up"):
        bench.step_times_ms(lines, 5)
    rec = bench.run_record("default", "fp32", "lora", 0, bench.parse_output(LORA_OUT),
                           [300.0, 100.0, 200.0])
    assert (rec["step_ms"], rec["best_ms"], rec["peak_mib"]) == (200.0, 100.0, 434.0)


def test_summary_ratios_goals_and_table():
    records = []
    for round_, (full_ms, lora_ms) in enumerate([(1000.0, 700.0), (900.0, 750.0),
                                                  (5000.0, 800.0)]):
        for mode, out, ms in (("full", FULL_OUT, full_ms), ("lora", LORA_OUT, lora_ms)):
            # each run: its median step and one step 100 ms faster
            records.append(bench.run_record("default", "fp32", mode, round_,
                                            bench.parse_output(out), [ms - 100, ms, ms + 50]))
    full, lora = bench.summarize(records)
    assert full["step_ms"] == 1000.0 and (full["step_ms_min"], full["step_ms_max"]) == (900, 5000)
    assert full["tokens_per_s"] == pytest.approx(1024.0)
    assert full["peak_mib"] == 430.0  # the largest rank's, median over rounds
    assert lora["step_over_full"] == pytest.approx(0.75) and lora["step_goal_met"]
    assert lora["step_over_full_per_round"] == pytest.approx([0.7, 750 / 900, 0.16])
    assert (full["best_ms"], lora["best_ms"]) == (800.0, 600.0)  # the fastest of all rounds
    assert lora["best_over_full"] == pytest.approx(0.75) and lora["best_goal_met"]
    assert lora["base_weights_mib"] == pytest.approx(7.2)  # W - G: fp32 adapters
    assert lora["state_over_base"] == pytest.approx(9.7 / 7.2)
    assert not lora["state_goal_met"]
    text = bench.table([full, lora])
    assert "| default | fp32 | lora | 750 (700-800) | 600 | 1,365 | 434 | 9.7 = 7.8 + 0.6 + " \
           "1.3 | 0.75 (rounds 0.16-0.83); 0.75 | 1.347 (base 7.2) |" in text
    assert "1.347 -> NOT met; step <= 0.8 x full: median 0.75 (rounds 0.16-0.83) -> met, " \
           "fastest 0.75 -> met" in text


def test_run_order_rotates_each_round():
    order = bench.run_order(["fp32", "bf16"], 2)
    assert order[:4] == [(0, "fp32", "full"), (0, "fp32", "lora"), (0, "bf16", "full"),
                         (0, "bf16", "lora")]
    assert order[4:] == [(1, "fp32", "lora"), (1, "bf16", "full"), (1, "bf16", "lora"),
                         (1, "fp32", "full")]


def test_help_runs():
    done = subprocess.run([sys.executable, _PATH, "--help"], capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert "--json OUT" in done.stdout and "issue47" in done.stdout
