"""Run a benchmark's worker ranks on this host (in the emulated link's namespaces when the spec
names one) and read back rank 0's raw measurements."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from domino.netem import EmulatedLink, cleanup_stale
from domino.supervisor import local_env, run_ranks
from domino.utils import free_port

WORKER = (sys.executable, "-m", "domino.bench.worker")


def launch_ranks(spec_path: str, spec: dict[str, Any], link: EmulatedLink | None,
                 worker: tuple[str, ...] = WORKER) -> None:
    """Run ``worker + (spec_path,)`` once per rank (in the link's namespaces when given);
    raise :class:`~domino.supervisor.RankFailed` if any rank fails."""
    world = spec.get("world_size", spec["tensor_model_parallel_size"])
    per_host = spec.get("ranks_per_host", 1)  # a pipeline stage's ranks share a host
    # A fresh namespace has every port free; on loopback pick one that is free now.
    port = 29500 if link is not None else free_port()
    threads = str(spec["threads_per_rank"])
    commands, envs = [], []
    for rank in range(world):
        env = local_env(rank, world, port, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        argv = [*worker, spec_path]
        if link is not None:
            env.update(link.env_for(rank // per_host, port))
            # c10d warns that it cannot resolve peer hostnames in a bare namespace: noise.
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            argv = link.wrap(rank // per_host, argv)
        else:
            env["GLOO_SOCKET_IFNAME"] = "lo"
        commands.append(argv)
        envs.append(env)
    run_ranks(commands, envs, label="domino bench", straggler_s=spec["timeout"])


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the workers on ``spec`` (on the emulated link when it names one); rank 0's raw
    results."""
    with tempfile.TemporaryDirectory(prefix="domino-bench-") as tmp:
        spec["result_path"] = os.path.join(tmp, "raw.json")
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        if "link" in spec:
            cleanup_stale()  # namespaces left by runs that were killed
            hosts = spec.get("hosts", spec["tensor_model_parallel_size"])
            with EmulatedLink(num_hosts=hosts, rate=spec["link"],
                              mtu=spec.get("link_mtu")) as link:
                launch_ranks(spec_path, spec, link)
        else:
            launch_ranks(spec_path, spec, None)
        with open(spec["result_path"]) as f:
            return json.load(f)
