"""Durable runs through the real `domino train` command (2 local ranks, TP=2): a SIGKILL in the
middle of a save loses nothing, SIGTERM checkpoints at the step boundary, and the clock-based save
interval and keep-K work (what starts from a saved run: test_saved_run_cli.py, which shares
this file's worker and its 6-step run: conftest.py's ``clock_run``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_train_cli import _workers_of

from domino.checkpoint.store import PAUSE_ENV
from domino.cli import main

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "64", "--micro-batch-size",
         "4", "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "1",
         "--sample-tokens", "0", "--no-tensorboard", "--nproc", "2", "--hidden-dropout", "0.1",
         "--save-interval-minutes", "0"]


@pytest.fixture(scope="module")
def data(byte_dataset) -> list[str]:
    return data_flags(byte_dataset)


def data_flags(byte_dataset) -> list[str]:
    """The dataset of this file's runs (and of conftest.py's ``clock_run``)."""
    return ["--data-path", byte_dataset(400_000), "--split", "90,10,0"]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads,
                                             (run / "metrics.jsonl").read_text().splitlines())}


def _latest(run: Path) -> int:
    return json.loads((run / "checkpoints" / "latest.json").read_text())["step"]


def _workers(run: Path) -> list[int]:
    return _workers_of(run / "config.json")


def _start(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    # stderr goes to a file: a pipe nobody reads while the run goes fills up (the progress bar
    # redraws there) and blocks the rank writing to it.
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "domino.cli", "train", *argv],
                            stdout=subprocess.DEVNULL, stderr=err, text=True,
                            # Fresh interpreters: _workers finds the ranks by command line.
                            env=dict(os.environ, PYTHONUNBUFFERED="1",
                                     DOMINO_RANK_START="exec", **(env or {})))
    proc.err_file = err  # type: ignore[attr-defined]
    return proc


def _stderr(proc: subprocess.Popen) -> str:
    proc.err_file.seek(0)  # type: ignore[attr-defined]
    return proc.err_file.read()  # type: ignore[attr-defined]


def _wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}: {_stderr(proc)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_sigkill_mid_save_loses_nothing(tmp_path: Path, data, clock_run) -> None:
    common = [*FLAGS, *data, "--train-iters", "6", "--save-interval", "2"]
    ref = clock_run  # the same 6 steps, uninterrupted
    run = tmp_path / "run"
    proc = _start([*common, "--save", str(run)], {PAUSE_ENV: "4:120"})
    half = run / "checkpoints" / "step_0000004.tmp"
    try:
        _wait_for(lambda: (half / "model-tp01-pp00.safetensors").exists()
                  and (half / "model-tp00-pp00.safetensors").exists(), proc, "the step-4 save")
        time.sleep(0.5)
        for pid in [proc.pid, *_workers(run)]:  # the whole machine "crashes"
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert half.exists() and _latest(run) == 2  # the interrupted save never became visible
    rc = main(["train", *common, "--load", str(run), "--save", str(run)])
    assert rc == 0
    assert not half.exists() and _latest(run) == 6
    assert _losses(run) == _losses(ref)  # steps 3-6 recomputed exactly: nothing lost


def test_sigterm_checkpoints_at_the_step_boundary(tmp_path: Path, data) -> None:
    run = tmp_path / "run"
    proc = _start([*FLAGS, *data, "--train-iters", "100000", "--save-interval", "0",
                   "--save", str(run)])
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists()
                  and len(_losses(run)) >= 2, proc, "two steps")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = _stderr(proc)
    assert rc == 128 + signal.SIGTERM, err
    assert "next step boundary with a checkpoint" in err and "interrupted" in err
    step = _latest(run)
    assert step == max(_losses(run)), (step, _losses(run))  # saved the last step it finished
    assert _workers(run) == []
    more = step + 2
    assert main(["train", *FLAGS, *data, "--train-iters", str(more), "--load", str(run),
                 "--save", str(run)]) == 0
    assert _latest(run) == more and max(_losses(run)) == more


def test_clock_save_interval_and_keep(clock_run: Path) -> None:
    names = sorted(p.name for p in (clock_run / "checkpoints").iterdir())
    assert names == ["latest.json", "step_0000005", "step_0000006"]
