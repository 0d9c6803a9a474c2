"""One rank of ``domino generate`` / ``domino eval``: ``python -m domino.inference.worker
SPEC.json`` (started by :func:`domino.inference.session.launch`)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from domino.distributed import init_distributed, shutdown_distributed
from domino.host_memory import keep_freed_memory
from domino.inference.tasks import eval_rank, generate_rank
from domino.parallel_state import ParallelState


def run_rank(spec: dict[str, Any]) -> int:
    """One rank: initialise, load the model at the spec's TP size, run the command."""
    commands: dict[str, Callable[[dict, Any], None]] = {
        "generate": generate_rank, "eval": eval_rank}
    rank = int(os.environ.get("RANK", "0"))
    state = None
    try:
        device = init_distributed(spec["device"])
        if device.type == "cpu":
            keep_freed_memory()
            local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        state = ParallelState.build(spec["tp"], device=device)
        commands[spec["command"]](spec, state)
        state.world.barrier()
        return 0
    except Exception as err:
        sys.stderr.write(f"[rank {rank}] {type(err).__name__}: {err}\n")
        if isinstance(err, ValueError):  # bad input: the message says the fix
            return 2
        traceback.print_exc()
        return 1
    finally:
        if state is not None:  # its transports' threads stop before the groups go
            state.close()
        shutdown_distributed()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m domino.inference.worker SPEC.json", file=sys.stderr)
        sys.exit(2)
    with open(sys.argv[1], encoding="utf-8") as f:
        sys.exit(run_rank(json.load(f)))
