"""Run a function on N gloo ranks (CPU) and collect what each rank returns."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
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


def run_distributed(fn: Callable, world: int, *args) -> list:
    """Spawn ``world`` processes running ``fn(rank, world, *args)``; returns their results.

    ``fn`` must be a module-level function. A rank that raises makes spawn terminate the others
    and re-raise here with the rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, free_port(), out_dir, fn, args), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
