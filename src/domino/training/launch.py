"""Start and supervise the ranks: torchrun's environment, or N local processes.

Local launch: one subprocess per rank (``python -m domino.training.worker CONFIG``), each in its
own session so a terminal Ctrl-C reaches only this parent, which then stops every child and
exits 130. When a rank exits non-zero the parent terminates the others at once; the
process-group timeout is only a backstop (and each child also exits if the parent disappears).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from domino.training.arguments import TrainArgs
from domino.utils import free_port, stop_processes

PARENT_ENV = "DOMINO_LAUNCHER_PID"
GRACE_S = 5.0


def launch_local(config_path: Path, nproc: int, device: str) -> int:
    """Run ``nproc`` worker processes on this host; returns the exit code of the run."""
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // nproc) if device == "cpu" else None
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), **{PARENT_ENV: str(os.getpid())})
            if threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)  # ranks share the cores, no oversubscription
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "domino.training.worker", str(config_path)], env=env,
                start_new_session=True))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"domino train: rank {rank} exited with code {code}; stopping the other "
                      "ranks", file=sys.stderr)
                stop_processes(procs, GRACE_S)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("domino train: interrupted; stopping all ranks", file=sys.stderr)
        stop_processes(procs, GRACE_S)
        return 130
    finally:
        stop_processes(procs, GRACE_S)


def _watch_parent(parent: int) -> None:
    """Exit if the launcher dies (e.g. SIGKILL): a child in its own session would not notice."""
    def loop() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=loop, daemon=True, name="domino-parent-watch").start()


def run_worker(args: TrainArgs, run_dir: Path | None) -> int:
    """Body of one rank (under torchrun or started by :func:`launch_local`)."""
    from domino.parallel_state import init_distributed
    from domino.training.loop import train

    if os.environ.get(PARENT_ENV):
        _watch_parent(int(os.environ[PARENT_ENV]))
        # SIGTERM from the launcher: leave at once (default action), no traceback spam.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rank = int(os.environ.get("RANK", "0"))
    try:
        device = init_distributed(args.device, args.distributed_timeout_minutes * 60.0)
        if device.type == "cpu":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        if run_dir is None:  # torchrun: every rank must use rank 0's folder name
            from domino.training.checks import default_run_dir

            box = [str(Path(args.save) if args.save else default_run_dir())]
            dist.broadcast_object_list(box, src=0)
            run_dir = Path(box[0])
            args.save = str(run_dir)
            if rank == 0:
                write_config(run_dir, args)
        args.device = str(device)
        train(args, run_dir)
        dist.barrier()  # DP rank 0's TP group may still be sampling: leave together
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # report with the rank, then fail: the launcher stops the rest
        sys.stderr.write(f"[rank {rank}] {type(err).__name__}: {err}\n")
        if not isinstance(err, ValueError):
            traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def write_config(run_dir: Path, args: TrainArgs) -> Path:
    """Save the effective settings as config.json (read by the workers) and config.toml."""
    from domino.training.arguments import to_toml

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(args), encoding="utf-8")
    path = run_dir / "config.json"
    path.write_text(json.dumps(args.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path
