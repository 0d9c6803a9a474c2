"""`domino bench --pipeline-model-parallel-size P`: a real 2-stage run of every schedule (its
table, JSON and one timeline per schedule with a row per stage), PP=2 x TP=2 on an emulated
link with each stage on its own host, and the checks before any process starts. No timing
assertions."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from domino import netem
from domino.bench.spec import build_config
from domino.cli import main
from domino.commands import bench
from domino.flops import train_flops_per_step
from domino.pipeline.schedules import theoretical_bubble

TINY = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--vocab-size", "64",
        "--pipeline-micro-batches", "4", "--steps", "2", "--warmup", "1"]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_every_schedule_on_two_stages(tmp_path: Path, capsys) -> None:
    out_json, out_dir = tmp_path / "pp.json", tmp_path / "tl"
    # No warm-up round: --compile runs each schedule's first step before the timed ones.
    argv = TINY[:-2] + ["--warmup", "0"]
    assert main(["bench", *argv, "--json", str(out_json), "--out-dir", str(out_dir),
                 "--compile", "--compile-backend", "aot_eager"]) == 0
    table = capsys.readouterr().out
    assert "domino bench (pipeline)" in table and "interleaved (x2 chunks)" in table
    # every stage's pieces compiled before the timed steps (the slowest rank's figures), none
    # while timed
    assert re.search(r"compiled pieces \(aot_eager\): \d+ forward graphs in [\d.]+ s before "
                     r"the timed steps\n", table)
    report = json.loads(out_json.read_text())
    rows = {r["schedule"]: r for r in report["results"]}
    assert list(rows) == ["gpipe", "1f1b", "interleaved", "zero_bubble"]
    for name, r in rows.items():
        assert r["step_time_s"] > 0 and len(r["step_times_s"]) == 2
        assert 0.0 <= r["bubble"] < 1.0
        chunks = 2 if name == "interleaved" else 1
        assert r["theoretical_bubble"] == pytest.approx(theoretical_bubble(name, 2, 4, chunks))
        assert len(r["peak_mem_bytes_per_stage"]) == 2 and min(r["peak_mem_bytes_per_stage"]) > 0
        # Model FLOPs of the whole GPT (LM head included) over the step, per rank; MFU.
        assert r["model_flops_per_s_per_rank"] * r["step_time_s"] * 2 == pytest.approx(
            report["config"]["model_flops_per_step"], rel=1e-9)
        assert r["mfu"] == pytest.approx(r["model_flops_per_s_per_rank"]
                                         / report["config"]["peak_flops_per_s"], rel=1e-9)
        png = Path(r["timeline_png"])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        events = json.loads((out_dir / f"trace_pp_{name}.json").read_text())["traceEvents"]
        passes = {e["name"][0] for e in events if e.get("cat") == "compute"}
        assert passes == ({"F", "B", "W"} if name == "zero_bubble" else {"F", "B"})
        assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}  # a row per stage
    # What each schedule holds: GPipe every micro-batch, 1F1B at most (stages - stage).
    assert rows["gpipe"]["held_micro_batches_per_stage"] == [4, 4]
    assert rows["1f1b"]["held_micro_batches_per_stage"] == [2, 1]
    assert rows["interleaved"]["layers"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    c = report["config"]
    assert c["compile_graphs"] > 0 and c["compile_graphs_timed"] == 0
    gpt = build_config({**c, "model": "gpt", "attention_dropout": 0.0})
    assert c["model_flops_per_step"] == train_flops_per_step(
        gpt, 4 * c["micro_batch_size"] * c["seq_length"])
    assert c["mfu_of"] == "of measured GEMM rate" and "TFLOP/s/rank" in table


def test_stages_on_emulated_hosts(tmp_path: Path, capsys) -> None:
    try:
        netem.check_can_emulate()
    except RuntimeError as err:
        pytest.skip(f"cannot emulate links here: {err}")
    # PP=2 x TP=2: each stage's two TP ranks share an emulated host, the stages talk over it.
    argv = [a if a != "1" or TINY[i - 1] != "--tensor-model-parallel-size" else "2"
            for i, a in enumerate(TINY[:-4])]
    # One measured round, no warm-up, a given peak (no GEMM timing): only the placement on the
    # emulated hosts is checked here.
    argv += ["--steps", "1", "--warmup", "0", "--peak-tflops", "1"]
    assert main(["bench", *argv, "--emulate-link", "1gbit", "--schedules", "1f1b,zero_bubble"]) == 0
    out = capsys.readouterr().out
    assert "link 1gbit" in out and "PP=2 x TP=2" in out


@pytest.mark.parametrize(("extra", "match"), [
    (["--schedules", "1f1b,turbo"], "not one of"),
    (["--num-layers", "3", "--schedules", "1f1b"], "does not divide into 2 pipeline stages"),
    (["--num-layers", "6", "--schedules", "interleaved"], "multiple of 2 x PP = 4"),
    (["--pipeline-micro-batches", "3", "--schedules", "interleaved"], "not a multiple of 2"),
    (["--simulate-link", "1gbit"], "loopback or --emulate-link"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2 is not part of it"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size 2, --num-experts 4 is not part of it"),
    (["--plan", "m4:cross"], "larger than --micro-batch-size=2"),
    (["--peak-tflops", "-1"], "--peak-tflops=-1.0 must be > 0"),
])
def test_pipeline_bench_checks(extra: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bench.run(_args(TINY + extra))
