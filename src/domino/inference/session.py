"""Running a saved model: the shared launch of ``domino generate`` / ``domino eval`` (local ranks,
one of them in this process, or torchrun); each rank runs
:func:`domino.inference.worker.run_rank`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from domino.checkpoint.layout import open_checkpoint
from domino.config import TransformerConfig
from domino.precision import PRECISIONS, precision_of
from domino.supervisor import RankFailed, local_env, run_ranks
from domino.utils import free_port


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="RUN_DIR",
                        help="run, checkpoints or step folder (default: its latest checkpoint)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="TP size to run at (any size the model divides by) [default: 1]")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local processes when not under torchrun [default: the TP size]")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available")
    parser.add_argument("--precision", choices=tuple(PRECISIONS), default=None,
                        help="compute dtype (bf16 / fp16: from copies of the fp32 weights) "
                             "[default: the run's: bf16 after --bf16, fp16 after --fp16, else "
                             "fp32]")


def run_precision(args: dict[str, Any] | None) -> str:
    """The precision a run trained in, from its saved settings (fp32 when there are none)."""
    args = args or {}
    return precision_of(bool(args.get("bf16")), bool(args.get("fp16")))


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_here(spec: dict[str, Any]) -> int:
    """One local rank: run it in this process, as under torchrun, rather than start an
    interpreter for it (seconds of imports); the environment and thread count are restored."""
    from domino.inference.worker import run_rank

    env = local_env(0, 1, free_port())
    saved = {k: os.environ.get(k) for k in env}
    threads = torch.get_num_threads()
    os.environ.update(env)
    try:
        return run_rank(spec)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(threads)


def launch(command: str, ns: argparse.Namespace, spec: dict[str, Any],
           check: Callable[[Path, Any, dict[str, Any]], None] | None = None) -> int:
    """Check the checkpoint (and ``check(step_dir, meta, spec)`` the request against it), then
    run ``domino.inference.worker`` on every rank (here, under torchrun or for one local rank;
    else as ``--nproc`` local processes)."""
    tp = ns.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size={tp} must be >= 1")
    step_dir, meta, _ = open_checkpoint(ns.checkpoint, hashes=True)
    TransformerConfig.from_dict(meta.config).validate_parallel(tp)  # (run without SP)
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
    precision = ns.precision or run_precision(meta.args)
    if precision == "fp16" and device != "cuda":
        how = "" if ns.precision else " (the run trained in fp16)"
        raise ValueError(f"--precision fp16{how} needs a CUDA device; on a CPU pass "
                         "--precision bf16 or --precision fp32.")
    if check is not None:
        check(step_dir, meta, spec)
    spec = {**spec, "command": command, "step_dir": str(step_dir.resolve()), "tp": tp,
            "device": device, "precision": precision}
    if _under_torchrun():
        from domino.inference.worker import run_rank  # (the rank's side, run here)

        return run_rank(spec)
    nproc = ns.nproc or tp
    if nproc % tp:
        raise ValueError(f"--nproc {nproc} is not a multiple of --tensor-model-parallel-size "
                         f"{tp}")
    if nproc == 1 and not dist.is_initialized():
        return _run_here(spec)
    with tempfile.TemporaryDirectory(prefix=f"domino-{command}-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        port = free_port()
        threads = str(max(1, (os.cpu_count() or 1) // nproc))
        envs = [local_env(r, nproc, port, OMP_NUM_THREADS=threads) for r in range(nproc)]
        try:
            run_ranks([[sys.executable, "-m", "domino.inference.worker", str(path)]] * nproc,
                      envs, label=f"domino {command}")
        except RankFailed as err:
            return err.exit_code
    return 0
