"""Checkpoints: one file per TP rank (its model shard, optimizer state, RNG and step).

Layout (Megatron-like)::

    RUN/checkpoint/latest_checkpointed_iteration.txt
    RUN/checkpoint/iter_0000300/mp_rank_00/model_optim_rng.pt

Only DP rank 0 writes: DP replicas hold identical weights and optimizer states.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"


def _root(path: str | os.PathLike) -> Path:
    """A run folder or its checkpoint folder -> the checkpoint folder."""
    p = Path(path)
    return p / "checkpoint" if (p / "checkpoint" / TRACKER).is_file() else p


def shard_path(root: Path, iteration: int, tp_rank: int) -> Path:
    return root / f"iter_{iteration:07d}" / f"mp_rank_{tp_rank:02d}" / FILENAME


def find_checkpoint(path: str | os.PathLike, tp_size: int) -> tuple[Path, int]:
    """(checkpoint folder, iteration) of the latest checkpoint; ValueError if absent or if it
    was written with another TP size."""
    root = _root(path)
    tracker = root / TRACKER
    if not tracker.is_file():
        raise ValueError(f"--load {os.fspath(path)}: no checkpoint found (missing {tracker}); "
                         "pass a run folder that was trained with --save")
    iteration = int(tracker.read_text().strip())
    for rank in range(tp_size):
        if not shard_path(root, iteration, rank).is_file():
            raise ValueError(f"--load {os.fspath(path)}: {shard_path(root, iteration, rank)} is "
                             f"missing; the checkpoint must come from a run with "
                             f"--tensor-model-parallel-size {tp_size}")
    if shard_path(root, iteration, tp_size).is_file():
        raise ValueError(f"--load {os.fspath(path)}: the checkpoint has more than {tp_size} TP "
                         "shards; resume with the TP size it was trained with")
    return root, iteration


def save_checkpoint(run_dir: Path, iteration: int, state: Any, payload: dict[str, Any]) -> Path:
    """Write this rank's shard (DP rank 0 only) and, on global rank 0, the tracker file."""
    root = Path(run_dir) / "checkpoint"
    path = shard_path(root, iteration, state.tp.rank)
    if state.dp.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"iteration": iteration, "tp_size": state.tp.size, **payload}, tmp)
        os.replace(tmp, path)  # a crash mid-write never leaves a half file under the real name
    state.world.barrier()  # the tracker must only point at complete shards
    if state.world.rank == 0:
        (root / TRACKER).write_text(f"{iteration}\n")
    return path


def load_checkpoint(path: str | os.PathLike, state: Any) -> dict[str, Any]:
    """This TP rank's shard of the latest checkpoint under ``path``."""
    root, iteration = find_checkpoint(path, state.tp.size)
    return torch.load(shard_path(root, iteration, state.tp.rank), map_location=state.device,
                      weights_only=False)
