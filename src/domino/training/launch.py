"""Start the ranks of a `domino train` run on this host (``--nproc N``; under torchrun the ranks
already exist) and save the settings they read.

Each rank is ``python -m domino.training.worker RUN/config.json`` under the shared supervisor
(:mod:`domino.supervisor`): a rank that fails stops the others at once, Ctrl-C stops all and
exits 130.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from domino.safe_files import write_atomic
from domino.supervisor import Interrupted, RankFailed, local_env, run_ranks
from domino.training.arguments import TrainArgs, to_toml
from domino.training.finetune import resume_toml
from domino.utils import free_port

# After Ctrl-C / SIGTERM the ranks get this long to reach a step boundary and checkpoint.
WIND_DOWN_S = 120.0
# A rank stopped this long past the collective timeout stops the run from the launcher: the
# peers' own timeouts fire first and say what they were waiting in; this is the backstop.
STALL_MARGIN_S = 10.0


def launch_local(config_path: Path, nproc: int, device: str, link_rate: str | None = None,
                 hosts: int | None = None, timeout_s: float = 300.0) -> int:
    """Run ``nproc`` worker processes on this host (with ``link_rate``: on ``hosts`` emulated
    hosts, default one per rank, joined by a link of that rate; consecutive ranks share a host);
    returns the exit code of the run. A rank whose process stays stopped ``STALL_MARGIN_S``
    past ``timeout_s`` (the ranks' collective timeout) stops them all."""
    hosts = hosts or nproc
    per_host = nproc // hosts
    extra = {}
    if device == "cpu":  # ranks share the cores: no oversubscription
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    command = [sys.executable, "-m", "domino.training.worker", str(config_path)]
    with contextlib.ExitStack() as stack:
        link = None
        if link_rate is not None:
            from domino.netem import EmulatedLink, cleanup_stale

            cleanup_stale()  # namespaces left by runs that were killed
            link = stack.enter_context(EmulatedLink(num_hosts=hosts, rate=link_rate))
        # A fresh namespace has every port free; on loopback pick one that is free now.
        port = 29500 if link is not None else free_port()
        commands, envs = [], []
        for r in range(nproc):
            env = local_env(r, nproc, port, **extra)
            if link is None:
                commands.append(command)
            else:
                env.update(link.env_for(r // per_host, port), TORCH_CPP_LOG_LEVEL="ERROR")
                commands.append(link.wrap(r // per_host, command))
            envs.append(env)
        return _run(commands, envs, timeout_s)


def _run(commands: list[list[str]], envs: list[dict[str, str]], timeout_s: float) -> int:
    try:
        run_ranks(commands, envs, label="domino train", wind_down_s=WIND_DOWN_S,
                  stall_s=timeout_s + STALL_MARGIN_S)
    except RankFailed as err:
        return err.exit_code
    except Interrupted as err:
        print("domino train: interrupted; all ranks stopped", file=sys.stderr)
        return err.exit_code
    return 0


def write_config(run_dir: Path, args: TrainArgs) -> Path:
    """Save the effective settings as config.json (read by the workers) and config.toml."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # (a link there: replaced). A fine-tune's record resumes it, not its base.
    write_atomic(run_dir / "config.toml", resume_toml(args) if args.finetune else to_toml(args))
    path = run_dir / "config.json"
    write_atomic(path, json.dumps(args.to_dict(), indent=2) + "\n")
    return path
