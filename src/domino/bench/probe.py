"""The probes: how long an all-reduce (and an all-to-all) of a fixed size takes between the
ranks, and how much host CPU it costs. Every benchmark run measures them (``worker.py``);
:func:`measure_link` runs the all-reduce's on its own, over an emulated link or loopback, as
``python -m domino.bench.probe RESULT.json NBYTES ITERS TIMEOUT_S`` per rank.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from domino.distributed import init_distributed, shutdown_distributed
from domino.netem import EmulatedLink, rate_bits_per_s
from domino.supervisor import local_env, run_ranks
from domino.tensor_parallel import CommGroup
from domino.timing import device_sync
from domino.utils import free_port


def busy_cpu_s() -> float | None:
    """Host-wide busy CPU seconds so far (all processes and the kernel's network work), from
    /proc/stat: user + nice + system + irq + softirq. None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu_per_op(windows: list[tuple[float | None, float | None, int]]) -> float | None:
    """Busy CPU seconds per operation from (busy before, busy after, operations) windows: the
    median over windows (None if /proc/stat could not be read)."""
    per_op = [(b1 - b0) / n for b0, b1, n in windows if b0 is not None and b1 is not None and n]
    return statistics.median(per_op) if per_op else None


def probe_allreduce(group: CommGroup, nbytes: int = 8 << 20, windows: int = 5,
                    window_s: float = 0.2, min_iters: int = 2, max_iters: int = 40,
                    check: bool = False) -> dict[str, object] | None:
    """All-reduces of ``nbytes`` fp32 ones in ``windows`` windows of at least ``window_s`` and
    ``min_iters`` to ``max_iters`` all-reduces each (rank 0 decides when a window ends, so
    every rank runs the same number).

    ``seconds``: median of the slowest rank's time per all-reduce (``per_iter_s``: all of them).
    ``cpu_s``: host-wide busy CPU seconds per all-reduce (both ranks' threads and the kernel's
    packet work, read on rank 0), i.e. what a transfer takes from compute when it overlaps it
    on the same host, from as many windows of back-to-back all-reduces (enough for
    ``window_s`` each): the median over windows, so one window disturbed by another process on
    the host does not skew it. With ``check``, every timed all-reduce starts from ones (refilled
    outside the timing) and ``ok`` says whether each summed to the group size. None for a
    group of one.
    """
    if group.size < 2:
        return None
    x = torch.ones(nbytes // 4, device=group.device)
    ok = [True]

    def verify() -> None:
        ok[0] = ok[0] and float(x[0]) == group.size and float(x[-1]) == group.size

    result = _probe(group, lambda: group.all_reduce(x), windows, window_s, min_iters,
                    max_iters, prepare=(lambda: x.fill_(1.0)) if check else None,
                    verify=verify if check else None, before_cpu=x.zero_)
    if check:
        flag = torch.tensor([0.0 if ok[0] else 1.0], device=group.device)
        group.all_reduce(flag, op=dist.ReduceOp.MAX)
        result["ok"] = flag.item() == 0.0
    return result


def probe_exchange(group: CommGroup, nbytes: int = 8 << 20, windows: int = 5,
                   window_s: float = 0.2, min_iters: int = 2,
                   max_iters: int = 40) -> dict[str, object] | None:
    """:func:`probe_allreduce` for an all-to-all (expert parallelism's dispatch and combine,
    the transport of context parallelism's exchanges): each rank sends ``nbytes`` of fp32,
    split evenly over the other ranks, and receives as much. ``cpu_s``: host-wide busy CPU
    seconds per exchange. None for a group of one."""
    if group.size < 2:
        return None
    rows = [0 if q == group.rank else nbytes // 4 // (group.size - 1)
            for q in range(group.size)]
    x = torch.ones(sum(rows), device=group.device)
    out = torch.empty_like(x)
    return _probe(group, lambda: group.all_to_all(out, x, rows, rows), windows, window_s,
                  min_iters, max_iters)


def _probe(group: CommGroup, once, windows: int, window_s: float, min_iters: int,
           max_iters: int, prepare=None, verify=None, before_cpu=None) -> dict[str, object]:
    """Time the collective ``once()`` and measure its host CPU (see :func:`probe_allreduce`);
    ``prepare`` / ``verify`` run before / after each timed one (outside the timing),
    ``before_cpu`` before the CPU windows."""
    device = group.device
    group.all_reduce(torch.ones(1024, device=device))  # connect before timing
    times: list[float] = []
    for _ in range(windows):
        start, n = time.perf_counter(), 0
        while True:
            if prepare is not None:
                prepare()
            group.barrier()
            device_sync(device)
            t0 = time.perf_counter()
            once()
            device_sync(device)
            times.append(time.perf_counter() - t0)
            n += 1
            if verify is not None:
                verify()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64,
                                   device=device)
            group.broadcast(elapsed)
            if n >= min_iters and (elapsed.item() >= window_s or n >= max_iters):
                break
    # One MAX reduction over ranks for all iterations at once.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    group.all_reduce(t, op=dist.ReduceOp.MAX)
    per_iter = t.tolist()
    seconds = float(statistics.median(per_iter))
    # CPU windows run the collectives back to back: the timing loop's barriers and broadcasts
    # cost CPU too, as much as a whole all-reduce of a fast transport. Every rank derives the
    # same count from the same (reduced) times.
    burst = max(min_iters, min(max_iters, math.ceil(window_s / max(seconds, 1e-6))))
    if before_cpu is not None:
        before_cpu()  # (e.g. zeros, which stay zeros summed: no growth over the windows)
    cpu_windows: list[tuple[float | None, float | None, int]] = []
    for _ in range(windows):
        group.barrier()
        busy0 = busy_cpu_s()
        for _ in range(burst):
            once()
        device_sync(device)
        cpu_windows.append((busy0, busy_cpu_s(), burst))
    return {"seconds": seconds, "per_iter_s": per_iter, "cpu_s": cpu_per_op(cpu_windows)}


def measure_link(
    link: EmulatedLink | None,
    nbytes: int = 8 << 20,
    iters: int = 1,
    num_ranks: int = 2,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Time a gloo all-reduce of ``nbytes`` float32 between the link's hosts, one rank per host
    (:func:`probe_allreduce`: a check that the link is up and shaped).

    With ``link=None`` the ranks run on loopback in the current namespace, as a baseline.
    ``seconds`` is the median over iterations of the slowest rank's time.
    """
    world = link.num_hosts if link is not None else num_ranks
    port = 29500 if link is not None else free_port()  # fresh namespaces have every port free
    with tempfile.TemporaryDirectory(prefix="domino-probe-") as tmp:
        out = os.path.join(tmp, "probe.json")
        argv = [sys.executable, "-m", "domino.bench.probe", out, str(nbytes), str(iters),
                str(timeout_s)]
        commands, envs = [], []
        for rank in range(world):
            env = local_env(rank, world, port, OMP_NUM_THREADS="1")
            if link is not None:
                env.update(link.env_for(rank, port))
                commands.append(link.wrap(rank, argv))
            else:
                env["GLOO_SOCKET_IFNAME"] = "lo"
                commands.append(argv)
            envs.append(env)
        run_ranks(commands, envs, label="link probe", straggler_s=timeout_s)
        with open(out) as f:
            probe = json.load(f)
    result: dict[str, Any] = {
        "world_size": world,
        "nbytes": nbytes,
        "rate": link.rate if link is not None else "loopback",
        "seconds": probe["seconds"],
        "per_iter_s": probe["per_iter_s"],
        "ok": probe["ok"],
    }
    if link is not None:
        # Ring all-reduce sends 2(n-1)/n of the buffer over each host's link.
        sent_bits = 2 * (world - 1) / world * nbytes * 8
        result["expected_s"] = sent_bits / rate_bits_per_s(link.rate)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 4:
        print("usage: python -m domino.bench.probe RESULT.json NBYTES ITERS TIMEOUT_S",
              file=sys.stderr)
        return 2
    out, nbytes, iters, timeout = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=timeout)
    try:
        group = CommGroup.world()
        result = probe_allreduce(group, nbytes, windows=1, window_s=0.0, min_iters=iters,
                                 max_iters=iters, check=True)
        if group.rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
