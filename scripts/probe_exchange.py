"""How fast gloo moves one exchange between two ranks, by the order its messages are posted.

Two ranks (each its own emulated host on ``--link``, or both on loopback) swap ``--mib`` MiB
each way, timed as the slower rank's, median of ``--rounds``:

- ``one way``: rank 0 sends, rank 1 receives (the link's rate, alone);
- ``send first``: each rank ``isend`` then ``irecv`` (one gloo pair, both directions);
- ``receive first``: each rank ``irecv`` then ``isend`` (what ``CommGroup`` does on gloo);
- ``all_to_all_single``: gloo's own all-to-all of the same rows;
- ``CommGroup.all_to_all``: the library's, as the MoE dispatcher calls it;
- ``CommGroup.exchange``: the library's point-to-point swap, as the context-parallel ring at
  CP = 2 calls it;
- ``shared memory all_to_all`` (loopback only): the shared-memory transport's.

It measured (2026-12-03, 2-core Xeon, 1 Gbit/s emulated, 2 MiB each way): one way 16-19 ms,
send first 31-33 ms, receive first 18-23 ms, ``all_to_all_single`` 32-37 ms: a gloo pair
whose ranks both send before receiving moves one direction at a time. Beside each time, the
host's busy CPU seconds over the case (/proc/stat: every process and the kernel's packet work,
from rank 0's view, so a little of the barrier too): what an exchange takes from compute that
runs beside it on the same cores. Run as root (namespaces),
with the project's venv::

    python scripts/probe_exchange.py --link 1gbit
    python scripts/probe_exchange.py --link loopback --mib 8
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

REPS = 10  # exchanges per busy-CPU window


def _rank(mib: float, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from domino.bench.probe import busy_cpu_s
    from domino.tensor_parallel import CommGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    me = dist.get_rank()
    peer = 1 - me
    rows = max(1, int(mib * 2**20 / (512 * 4)))
    x, y = torch.randn(rows, 512), torch.empty(rows, 512)
    both_x, both_y = torch.randn(2 * rows, 512), torch.empty(2 * rows, 512)
    group = CommGroup.world()
    from domino.tensor_parallel import shm

    shared = CommGroup(group.group, group.size, group.rank,
                       transport=shm.open_transport(group.group, group.rank, group.size, "probe"))

    def one_way():
        if me == 0:
            dist.send(x, 1)
        else:
            dist.recv(y, 0)

    def send_first():
        for w in [dist.isend(x, peer), dist.irecv(y, peer)]:
            w.wait()

    def receive_first():
        for w in [dist.irecv(y, peer), dist.isend(x, peer)]:
            w.wait()

    cases = {"one way": one_way, "send first": send_first, "receive first": receive_first,
             "all_to_all_single": lambda: dist.all_to_all_single(both_y, both_x),
             "CommGroup.all_to_all": lambda: group.all_to_all(both_y, both_x),
             "CommGroup.exchange": lambda: group.exchange([(peer, x)], [(peer, y)]).wait()}
    if shared.transport is not None:  # both ranks on one host (loopback)
        cases["shared memory all_to_all"] = lambda: shared.all_to_all(both_y, both_x)
    times: dict[str, list[float]] = {name: [] for name in cases}
    busy: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():  # interleaved: the host's drift hits every case alike
            dist.barrier()
            t = time.perf_counter()
            run()
            took = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times[name].append(float(took))
            # The host's busy CPU over REPS back to back (/proc/stat counts in 10 ms ticks).
            dist.barrier()
            b0 = busy_cpu_s()
            for _ in range(REPS):
                run()
            dist.barrier()
            b1 = busy_cpu_s()
            if b0 is not None and b1 is not None:
                busy[name].append((b1 - b0) / REPS)
    if shared.transport is not None:
        shared.transport.close()
    if me == 0:
        print(f"{rows * 512 * 4 / 2**20:.2f} MiB each way, median of {rounds} (slower rank; "
              "busy CPU: the whole host's, both ranks and the kernel's packet work):")
        for name, ts in times.items():
            cpu = (f"  busy CPU {statistics.median(busy[name]) * 1e3:6.1f} ms"
                   if busy[name] else "")
            print(f"  {name:26s} {statistics.median(ts) * 1e3:7.1f} ms{cpu}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="1gbit", help="a tc rate (root: namespaces) or loopback")
    p.add_argument("--mib", type=float, default=2.0, help="MiB each way")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        _rank(args.mib, args.rounds)
        return 0
    from domino.supervisor import local_env, run_ranks
    from domino.utils import free_port

    cmd = [sys.executable, os.path.abspath(__file__), "--rank", "--mib", str(args.mib),
           "--rounds", str(args.rounds)]
    if args.link == "loopback":
        port = free_port()
        run_ranks([cmd] * 2, [local_env(r, 2, port) for r in range(2)], label="probe")
        return 0
    from domino.netem import EmulatedLink

    with EmulatedLink(num_hosts=2, rate=args.link) as link:
        envs = [dict(local_env(r, 2, 29500), **link.env_for(r, 29500), TORCH_CPP_LOG_LEVEL="ERROR")
                for r in range(2)]
        run_ranks([link.wrap(r, cmd) for r in range(2)], envs, label="probe")
    return 0


if __name__ == "__main__":
    sys.exit(main())
