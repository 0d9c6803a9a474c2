"""One rank of a `domino train` run: its body (:func:`run_worker`, also what a torchrun rank
runs) and the entry point of a locally launched rank,
``python -m domino.training.worker RUN/config.json``."""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import torch

from domino.distributed import init_distributed, shutdown_distributed
from domino.host_memory import keep_freed_memory
from domino.parallel_state import ParallelState
from domino.tensor_parallel import CommGroup
from domino.training.arguments import TrainArgs
from domino.training.flag_text import as_flags, train_flags
from domino.training.launch import write_config
from domino.training.loop import TrainingDiverged, train
from domino.training.prepare import Run, build_run, default_run_dir
from domino.training.progress import (
    Progress,
    StopRequest,
    is_collective_timeout,
    timeout_report,
)


def _stop_on_signals() -> StopRequest:
    """SIGTERM (what launchers and clusters send before preemption) or SIGINT: checkpoint at
    the next step boundary and exit 128 + signal; a second one stops at once."""
    stop = StopRequest()

    def handler(signum: int, _frame) -> None:
        if stop.signum is not None:
            # Raising here could leave whatever lock the interrupted code held taken (a
            # progress bar's, an allocator's) and hang the exit: leave at once instead. A
            # checkpoint being written is in its .tmp folder, never published half-done.
            exit_now(128 + signum)
        stop.request(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop


def run_worker(run: Run) -> int:
    """Train on this rank; returns its exit code (2 for an error the user can fix - bad input,
    a full disk - and 1 for any other, reported with the rank; 128 + signal after a SIGTERM /
    SIGINT checkpoint)."""
    rank = int(os.environ.get("RANK", "0"))
    args = run.args
    stop = _stop_on_signals()
    progress = Progress()
    # Threads the process groups start (gloo's workers) inherit this mask: a stop signal
    # delivered to one of them would interrupt its socket calls mid-collective and leave the
    # ranks out of step. Only the main thread takes them, once the groups exist.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        device = init_distributed(args.device, args.distributed_timeout_minutes * 60.0)
        if device.type == "cpu":
            keep_freed_memory()
            local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        world = CommGroup.world(device)
        if run.run_dir is None:  # torchrun: every rank must use rank 0's folder name
            run.run_dir = Path(world.broadcast_json(args.save or str(default_run_dir())))
            args.save = str(run.run_dir)
            if rank == 0:
                write_config(run.run_dir, args)
        args.device = str(device)
        state = build_state(args, device)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
        result = train(run, state, stop=stop, progress=progress)
        state.close()
        world.barrier()  # DP rank 0's TP/EP group may still be sampling: leave together
        if result.stopped_at is not None:
            return 128 + (stop.signum or signal.SIGTERM)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # report with the rank, then fail: the launcher stops the rest
        if is_collective_timeout(err):  # a peer's fault, not this rank's: no traceback
            sys.stderr.write(f"[rank {rank}] " + timeout_report(
                err, progress, args.distributed_timeout_minutes) + "\n")
            return 1
        text = as_flags(str(err), train_flags()) if type(err) is ValueError else str(err)
        sys.stderr.write(f"[rank {rank}] {progress}: {type(err).__name__}: {text}\n")
        if isinstance(err, ValueError):  # bad input or a full disk: the message says the fix
            return 2
        if not isinstance(err, TrainingDiverged):
            traceback.print_exc()
        return 1
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
        shutdown_distributed()


def build_state(args: TrainArgs, device: torch.device | str | None) -> ParallelState:
    """The run's parallel state: its groups at the run's sizes, on ``device`` (the process group
    is initialised). The one place a run builds it; the caller closes it."""
    return ParallelState.build(device=device, shared_memory=args.shared_memory_comm,
                               **args.parallel_sizes())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m domino.training.worker RUN/config.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    args = TrainArgs(**json.loads(path.read_text(encoding="utf-8")))
    try:
        run = build_run(args, path.parent)
    except ValueError as err:
        print(f"[rank {os.environ.get('RANK', '0')}] ValueError: "
              f"{as_flags(str(err), train_flags())}", file=sys.stderr)
        return 2
    return run_worker(run)


def exit_now(code: int) -> NoReturn:
    """Flush the standard streams and end the process without the interpreter's teardown
    (its destructors and daemon threads can deadlock on locks a finished run no longer needs:
    seen with tqdm's monitor thread)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
