"""`domino train` and `domino generate` under torchrun (2 ranks, rendezvous on this host): the
ranks agree on the run folder, checkpoint, and a saved model generates at TP=2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from domino.cli import main
from domino.data import ByteTokenizer, preprocess
from domino.data.preprocess import stdlib_corpus_files


def _torchrun(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "domino.cli", *argv]
    # torchrun leaves its log folder (torchelastic_*) in the temporary directory: the test's.
    tmp = cwd / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_train_then_generate_under_torchrun(tmp_path: Path, capfd) -> None:
    prefix = tmp_path / "data"
    preprocess(stdlib_corpus_files(limit_bytes=100_000), prefix, ByteTokenizer(), progress=False)
    done = _torchrun("train", "--data-path", str(prefix), "--split", "90,10,0",
                     "--train-iters", "3", "--num-layers", "2", "--hidden-size", "64",
                     "--seq-length", "32", "--micro-batch-size", "4", "--eval-iters", "1",
                     "--sample-tokens", "8", "--no-tensorboard", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 1  # rank 0 chose the folder, every rank used it
    run = runs[0]
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 3
    names = {p.name for p in (run / "checkpoints" / "step_0000003").iterdir()}
    assert {"model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"} <= names
    assert "TP=2 x DP=1" in done.stdout and "--- sample" in done.stdout
    gen = _torchrun("generate", str(run), "--prompt", "def ", "--greedy", "--ids",
                    "--max-new-tokens", "6", "--tensor-model-parallel-size", "2", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr[-3000:]
    ids = [int(x) for x in gen.stdout.split()]
    # The same model on one rank: in this process (as `domino generate` runs one local rank),
    # not a third interpreter importing torch.
    capfd.readouterr()
    assert main(["generate", str(run), "--prompt", "def ", "--greedy", "--ids",
                 "--max-new-tokens", "6"]) == 0
    local = capfd.readouterr()
    assert ids == [int(x) for x in local.out.split()] and len(ids) >= 1, local.err
