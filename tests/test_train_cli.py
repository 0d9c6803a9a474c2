"""`domino train` end to end through the real entry point: the default path at a reduced size
(2 local processes, TP=2, Domino, stdlib corpus), a crashing rank, and Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from domino.checkpoint.layout import open_checkpoint
from domino.cli import main
from domino.config import TransformerConfig
from domino.data import ByteTokenizer, preprocess
from domino.data.preprocess import stdlib_corpus_files
from domino.flops import train_flops_per_step
from domino.training import data
from domino.training.arguments import tomllib

SMALL = ["--train-iters", "6", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "64",
         "--micro-batch-size", "4", "--log-interval", "2", "--eval-interval", "3",
         "--eval-iters", "1", "--sample-tokens", "24", "--no-tensorboard"]
FAULTS = str(Path(__file__).parent / "faults")  # test-only fault injection (sitecustomize.py)


def test_default_path_end_to_end(tmp_path, capfd, monkeypatch) -> None:
    monkeypatch.setenv("DOMINO_CACHE_DIR", str(tmp_path / "cache"))  # exercise the corpus prep
    # The parent prepares the data: a slice of the corpus keeps the BPE training short.
    small = [f for f in data.default_corpus_files() if os.path.getsize(f) < 15_000][:80]
    monkeypatch.setattr(data, "default_corpus_files", lambda: small)
    run = tmp_path / "run"
    assert main(["train", *SMALL, "--nproc", "2", "--save", str(run)]) == 0
    out = capfd.readouterr().out
    assert "effective configuration" in out and "tensor_model_parallel_size = 2" in out
    assert "TP=2 x DP=1" in out and "--- sample (24 tokens" in out
    assert "| TP over shm" in out  # two local CPU ranks: the shared-memory transport
    # The attention's paths measured at the run's shapes (TP=2: 2 heads of 32 per rank).
    assert re.search(r"attention auto: causal \w+, .*\((measured|cached) at float32, batch 2 "
                     r"x 2 heads x seq 64 x 16, causal masks; ms per fwd\+bwd causal: flash ", out)
    assert "validation at step 6: loss" in out and "perplexity" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 6]
    for rec in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
                "exposed_comm_s"} <= rec.keys()
    assert "val_ppl" in records[-1] and records[-1]["loss"] < records[0]["loss"]
    # MFU: the model's FLOPs per step (domino.flops) over the time, per rank, against the GEMM
    # rate the ranks measured on this machine.
    settings = tomllib.loads((run / "config.toml").read_text())
    config = TransformerConfig.from_dict(open_checkpoint(run)[1].config)  # the trained model
    flops = train_flops_per_step(config, settings["global_batch_size"] * settings["seq_length"],
                                 tp=2)
    # The peak the ranks measured (printed to 3 digits): MFU is the model's rate over it. (The
    # measured rate of this tiny model's GEMMs moves a lot on a busy machine: no bound on MFU.)
    peak = float(re.search(r"MFU of measured GEMM rate \(([\d.e+-]+) TFLOP/s per rank\)",
                           out).group(1))
    for rec in records:
        assert rec["model_tflops_per_rank"] * 1e12 * 2 * rec["step_time_s"] == pytest.approx(
            flops, rel=1e-9)
        assert rec["mfu"] > 0
        assert rec["mfu"] == pytest.approx(rec["model_tflops_per_rank"] / peak, rel=6e-3)
    assert " TFLOP/s/rank MFU " in out
    assert f"model FLOPs: {flops / 1e12:.4g} TFLOP per step" in out
    assert (run / "loss_curve.png").stat().st_size > 1000
    assert json.loads((run / "config.json").read_text())["num_layers"] == 2
    assert "hidden_size = 64" in (run / "config.toml").read_text()
    assert (run / "sample.txt").read_text().startswith("def")
    assert 'tokenizer_type = "bpe"' in (run / "config.toml").read_text()
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 6
    assert any((tmp_path / "cache").glob("stdlib-*/stdlib_bpe_*.bin"))
    assert any((tmp_path / "cache").glob("stdlib-*/bpe-*/merges.txt"))

    # Resume from the run folder for 2 more steps, with the settings from its config.toml.
    more = tmp_path / "more"
    argv = ["train", "--config", str(run / "config.toml"), "--train-iters", "8", "--load",
            str(run), "--save", str(more), "--sample-tokens", "0"]
    assert main(argv) == 0
    steps = [json.loads(x)["step"] for x in (more / "metrics.jsonl").read_text().splitlines()]
    assert steps == [8]


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory) -> list[str]:
    prefix = tmp_path_factory.mktemp("data") / "small"
    preprocess(stdlib_corpus_files(limit_bytes=400_000), prefix, ByteTokenizer(), progress=False)
    return ["--data-path", str(prefix), "--split", "90,10,0"]


def fail_rank_at(monkeypatch, rank: int, step: int) -> None:
    """The ranks start with tests/faults/sitecustomize.py, which makes ``rank`` fail at
    ``step``: a fresh interpreter's start-up reads it (forked ranks would not)."""
    path = os.pathsep.join(p for p in (FAULTS, os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("DOMINO_RANK_START", "exec")
    monkeypatch.setenv("DOMINO_TEST_FAIL_RANK", str(rank))
    monkeypatch.setenv("DOMINO_TEST_FAIL_STEP", str(step))


def test_crashed_rank_stops_every_rank(tmp_path, capfd, monkeypatch, byte_data) -> None:
    fail_rank_at(monkeypatch, 1, 2)
    t0 = time.monotonic()
    rc = main(["train", *SMALL, *byte_data, "--nproc", "2", "--save", str(tmp_path / "run")])
    elapsed = time.monotonic() - t0
    err = capfd.readouterr().err
    assert rc != 0
    assert "injected failure on rank 1 at step 2" in err
    # Rank 0 fails on the lost peer within milliseconds: the launcher may see both at once.
    assert re.search(r"ranks? (\d, )*1(, \d)* exited with codes? .*; stopping the other ranks",
                     err), err
    # Bound, not a speed check: far below the process-group timeout (5 min) that would
    # otherwise be the only way out for rank 0.
    assert elapsed < 120


def _workers_of(config: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config).encode() in cmd and b"domino.training.worker" in cmd:
            pids.append(int(proc.name))
    return pids


def test_ctrl_c_stops_all_ranks(tmp_path, byte_data) -> None:
    run = tmp_path / "run"
    # stderr to a file: an undrained pipe fills with the progress bar and blocks the rank.
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "domino.cli", "train", *SMALL, *byte_data, "--train-iters", "100000",
         "--nproc", "2", "--save", str(run)],
        stdout=subprocess.DEVNULL, stderr=err, text=True,
        # Fresh interpreters: _workers_of finds ranks by their command line (test_rank_fork
        # stops forked ranks with Ctrl-C).
        env=dict(os.environ, PYTHONUNBUFFERED="1", DOMINO_RANK_START="exec"),
        # As from a terminal: a test run started in the background (`pytest &`) has SIGINT
        # ignored, which the launcher would inherit.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or not _workers_of(run / "config.json"):
            assert proc.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err.seek(0)
    text = err.read()
    assert rc == 130, text
    assert "interrupted" in text
    assert _workers_of(run / "config.json") == []


def test_demo_agrees_with_single_process(capfd) -> None:
    """`domino demo`: TP=2 training next to the single-process model, ranks under the shared
    supervisor."""
    assert main(["demo", "--steps", "3"]) == 0
    out = capfd.readouterr().out
    assert "OK: TP and single-process training agree" in out and "loss TP=2" in out
