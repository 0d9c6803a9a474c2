"""Run a function on N gloo ranks (CPU) and collect what each rank returns.

The ranks are forked from a fork server that imported torch (and the other heavy modules a rank
uses) once for the whole session: a fresh interpreter per rank spends seconds of CPU on those
imports, and the suite starts over a hundred ranks on two cores. Each rank still gets the
parent's sys.path, working directory and (below) environment, and imports the test module
afresh, as a spawned rank would. The server itself is a fresh interpreter that only imported
modules, so forking it is safe (no threads, no process group).
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from domino import rank_fork
from domino.utils import free_port  # below the kernel's ephemeral range (its docstring says why)

# Imported once in the fork server; a module that fails to import there is skipped silently
# (the rank imports it itself when it needs it).
# The launcher's forked ranks (domino.rank_fork, which the suite uses) share this server: its
# list first, whichever of the two starts the server.
PRELOAD = [*rank_fork.PRELOAD, "matplotlib.figure",
           # domino itself (0.2 s per rank): the modules a rank's model, trainer, pipeline
           # and checkpoints come from (importing them starts no thread).
           "domino.models.gpt", "domino.training.loop", "domino.pipeline.runtime",
           "domino.checkpoint.store", "domino.inference.loading"]
START_METHOD = "forkserver"


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple,
           env: dict | None = None) -> None:
    if env is not None:  # the server's environment is the one it started with
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import datetime

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def start_ranks(fn: Callable, world: int, out_dir: str, *args, join: bool = True):
    """Start ``world`` ranks running ``fn(rank, world, *args)`` (results pickled to
    ``out_dir``); with ``join=False`` returns the processes' context without waiting."""
    if START_METHOD == "forkserver":
        mp.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    return mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args,
                                            dict(os.environ)),
                              nprocs=world, join=join, start_method=START_METHOD)


def run_distributed(fn: Callable, world: int, *args) -> list:
    """Start ``world`` ranks running ``fn(rank, world, *args)``; returns their results.

    ``fn`` must be a module-level function. A rank that raises makes the others terminate and
    re-raises here with the rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        start_ranks(fn, world, out_dir, *args)
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def fit(args, run_dir: str):
    """``domino.training.loop.train`` of ``args`` into ``run_dir`` on this rank, without drawing
    loss_curve.png (half a second of matplotlib per run) and, unless ``args`` give a peak, with
    ``peak_tflops=1`` instead of timing the model's GEMM shapes (a second per shape set), and
    unless they name an attention backend, on PyTorch's own SDPA choice (``flash``) instead of
    measuring the attention's paths: the tests that train many runs in a spawn compare
    numbers, which a path chosen per shape set would move; test_train_cli checks the figure,
    the measured MFU and the measured attention."""
    import dataclasses

    from domino.training import logging as train_logging
    from domino.training.loop import train
    from domino.training.prepare import build_run
    from domino.training.worker import build_state

    if args.peak_tflops is None:
        args = dataclasses.replace(args, peak_tflops=1.0)
    if args.attention_backend == "auto":
        args = dataclasses.replace(args, attention_backend="flash")

    draw = train_logging.plot_loss_curve
    train_logging.plot_loss_curve = lambda path, train, val: None
    run = build_run(args, Path(run_dir))
    state = build_state(args, args.device)
    try:
        result = train(run, state)
    except BaseException:
        state.close(wait=False)  # leaving on an error: a worker may wait on a peer
        raise
    finally:
        train_logging.plot_loss_curve = draw
    state.close()
    return result
