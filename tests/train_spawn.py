"""Several `domino train` runs of one world size trained in one spawn of ranks.

A test that checks runs against each other (a strategy against ``no_shard``, a layout against
another) needs each run set up as `domino train` sets it up, but not a fresh world per run: a
run's first step in a process costs each rank several times what a later run's does (lazy
initialisation), and rank 0 draws each run's loss curve. So `domino train` itself
(``domino.cli.main``) validates the flags, prepares the data and saves each run's config with
its launch held back (:func:`held_launches`); then one spawn of ranks (tests/dist.py) trains the
runs in order, each as a launched rank does (``domino.training.worker``: its config.json,
``build_run``, ``build_state``, ``train``), writing the same metrics and checkpoints. How ranks
are launched and supervised is tested where the launcher is (test_train_cli and others).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dist import run_distributed


@contextlib.contextmanager
def held_launches() -> Iterator[list[tuple[Path, int]]]:
    """Inside, `domino train` does all it does before its ranks start and returns 0 without
    starting them; yields the (config.json, --nproc) of each run, in order."""
    import domino.training.launch as launch

    held: list[tuple[Path, int]] = []

    def hold(config_path: Path, nproc: int, *args, **kwargs) -> int:
        held.append((Path(config_path), nproc))
        return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "launch_local", hold)
        yield held


def train_held(held: list[tuple[Path, int]]) -> None:
    """Train the held runs, all of one --nproc, in one spawn of that many ranks, in order."""
    worlds = sorted({nproc for _, nproc in held})
    assert len(worlds) == 1, f"one spawn trains runs of one --nproc, not {worlds}"
    run_distributed(train_configs, worlds[0], [str(path) for path, _ in held])


def train_configs(rank: int, world: int, configs: list[str]) -> None:
    """In a rank: train each config's run as a launched rank does (its loss curve not drawn:
    nothing here reads it)."""
    import torch.distributed as dist

    from domino.training import logging as train_logging
    from domino.training.arguments import TrainArgs
    from domino.training.loop import train
    from domino.training.prepare import build_run
    from domino.training.worker import build_state

    train_logging.plot_loss_curve = lambda path, train, val: None  # (this rank's process only)
    for config in map(Path, configs):
        args = TrainArgs(**json.loads(config.read_text(encoding="utf-8")))
        assert args.nproc == world, (config, args.nproc, world)
        run = build_run(args, config.parent)
        state = build_state(args, args.device)
        try:
            train(run, state)
        except BaseException:
            state.close(wait=False)
            raise
        state.close()
        dist.barrier()  # (as a launched run's ranks leave together)


def run_output(run: Path, hashes: bool = True) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """What a run wrote: its metrics.jsonl records and every tensor of its latest checkpoint,
    whole (weights and AdamW moments; the step counters left out)."""
    from domino.checkpoint.layout import open_checkpoint
    from domino.checkpoint.shards import ShardReader, TensorSpec

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step_dir, meta, _ = open_checkpoint(run, hashes=hashes)
    reader = ShardReader(step_dir)
    return records, {k: reader.full(k, TensorSpec.from_json(k, raw))
                     for k, raw in meta.tensors.items() if not k.startswith("optimizer.step")}
