"""What starts from a run `domino train` saved (2 local ranks, TP=2, 6 steps: conftest.py's
``clock_run``, trained once for this file and test_durable_cli.py): a diverged loss stops without
overwriting the last good checkpoint; `domino convert` to TP=1 and TP=4, `domino generate`
(greedy, nucleus, top-k, seeded sampling) and `domino eval` on it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from test_durable_cli import FLAGS, _latest

from domino.cli import main


@pytest.fixture(scope="module")
def data(byte_dataset) -> list[str]:
    return ["--data-path", byte_dataset(400_000), "--split", "90,10,0"]


@pytest.fixture(scope="module")
def saved_run(clock_run) -> Path:
    """The saved 6-step run (a test that writes into it works on a copy)."""
    return clock_run


def test_diverged_loss_stops_without_overwriting(tmp_path: Path, data, saved_run, capfd) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    files = {p: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in (run / "checkpoints").rglob("*") if p.is_file()}
    capfd.readouterr()
    rc = main(["train", *FLAGS, *data, "--train-iters", "40", "--lr", "1e30", "--min-lr", "0",
               "--lr-warmup-iters", "0", "--max-nonfinite-steps", "3", "--save-interval", "0",
               "--load", str(run), "--save", str(run)])
    err = capfd.readouterr().err
    assert rc == 1, err
    assert "NaN/inf for 3 consecutive steps" in err and "stopped without saving" in err
    assert _latest(run) == 6
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in (run / "checkpoints").rglob("*") if p.is_file()} == files


def _val_loss(out: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith("domino eval:"))
    return float(line.split(" loss ")[1].split(",")[0])


def test_convert_generate_and_eval_a_saved_run(tmp_path: Path, data, saved_run, byte_dataset,
                                               capfd, monkeypatch) -> None:
    run = saved_run  # only read here
    # One local rank runs in this process (no interpreter started), leaving the environment
    # and thread count as they were; two start processes.
    import torch

    from domino.inference import session

    started = []
    launch = session.run_ranks
    monkeypatch.setattr(session, "run_ranks", lambda cmds, *a, **k: started.append(len(cmds))
                        or launch(cmds, *a, **k))
    env, threads = dict(os.environ), torch.get_num_threads()
    logged = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "val_loss" in r][-1]["val_loss"]
    for tp in ("1", "4"):
        assert main(["convert", str(run), str(tmp_path / f"tp{tp}"),
                     "--tensor-model-parallel-size", tp]) == 0
    names = {p.name for p in (tmp_path / "tp1" / "checkpoints" / "step_0000006").iterdir()}
    assert {"model-tp00-pp00.safetensors", "optim-tp00-pp00.safetensors"} <= names
    assert "model-tp01-pp00.safetensors" not in names  # one consolidated file set
    capfd.readouterr()
    outs = []
    for folder, tp in ((run, "2"), (tmp_path / "tp1", "1"), (tmp_path / "tp4", "2")):
        assert main(["generate", str(folder), "--prompt", "def ", "--greedy", "--ids",
                     "--max-new-tokens", "8", "--tensor-model-parallel-size", tp]) == 0
        outs.append(capfd.readouterr().out.split())
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) >= 1
    for sampled in (["--top-p", "1e-9", "--seed", "3"], ["--top-k", "1"]):
        assert main(["generate", str(run), "--prompt", "def ", "--ids", "--max-new-tokens",
                     "8", *sampled]) == 0
        assert capfd.readouterr().out.split() == outs[0]  # a nucleus of one token is greedy
    a, b = ([main(["generate", str(run), "--prompt", "def ", "--ids", "--max-new-tokens", "8",
                   "--top-k", "20", "--temperature", "1.5", "--seed", "9"]),
             capfd.readouterr().out] for _ in range(2))
    assert a == b  # seeded sampling repeats
    # Eval reads what training's validation read (the run's settings) and gets its number.
    assert main(["eval", str(run), *data[:2], "--eval-iters", "1"]) == 0
    assert _val_loss(capfd.readouterr().out) == pytest.approx(logged, rel=1e-5)
    assert started == [2, 2] and dict(os.environ) == env and torch.get_num_threads() == threads
    # The whole split (the default), of a smaller dataset (same byte tokenizer).
    assert main(["eval", str(tmp_path / "tp4"), "--data-path", byte_dataset(40_000),
                 "--tensor-model-parallel-size", "2", "--nproc", "2"]) == 0
    out = capfd.readouterr().out
    assert "valid split" in out and "perplexity" in out and "TP=2 x DP=1" in out
