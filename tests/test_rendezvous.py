"""A local run exposes nothing to the network: while 2 ranks started by the product's launcher
(``supervisor.run_ranks`` + ``local_env``) hold their process groups (gloo, the shared-memory
transport and rank 0's rendezvous store), every TCP socket they listen on is on loopback."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from domino.supervisor import local_env, run_ranks
from domino.utils import free_port

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

# Each rank: join the run, build the TP x DP groups (DP=2 over shared memory), report its pid,
# then hold everything open until the test says go (or 60 s pass).
RANK_SCRIPT = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
from domino.parallel_state import ParallelState
from domino.distributed import init_distributed, shutdown_distributed

flags = Path(sys.argv[1])
init_distributed("cpu", timeout_s=30.0)
state = ParallelState.build(1)
assert state.transports() == {"tp": "-", "dp": "shm"}, state.transports()
dist.barrier()
rank = os.environ["RANK"]
(flags / f"{rank}.tmp").write_text(str(os.getpid()))
os.replace(flags / f"{rank}.tmp", flags / f"{rank}.pid")
deadline = time.monotonic() + 60.0
while not (flags / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
state.close()
shutdown_distributed()
"""

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} writes the address as 32-bit words in host byte order."""
    raw = bytes.fromhex(hex_addr)
    host = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(host) == 4 else socket.AF_INET6, host)


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():  # no IPv6 in this kernel
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == _LISTEN and cols[9] in inodes:
                addr, port = cols[1].split(":")
                found.append((_address(addr), int(port, 16)))
    return found


def test_local_run_listens_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    envs = [local_env(r, 2, port, OMP_NUM_THREADS="1") for r in range(2)]
    command = [sys.executable, "-c", RANK_SCRIPT, str(tmp_path)]
    errors: list[BaseException] = []

    def launch() -> None:
        try:
            run_ranks([command] * 2, envs, label="rendezvous test", grace_s=2.0)
        except BaseException as exc:  # reported by the test's thread below
            errors.append(exc)

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60.0
        while len(pids) < 2:
            assert not errors and thread.is_alive(), f"the ranks failed: {errors}"
            assert time.monotonic() < deadline, "the ranks did not come up within 60 s"
            pids = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
            time.sleep(0.05)
        sockets = {rank: listening(pid) for rank, pid in enumerate(pids)}
        assert any(p == port for _, p in sockets[0]), f"no store on port {port}: {sockets}"
        exposed = {rank: [(a, p) for a, p in found if not ipaddress.ip_address(a).is_loopback]
                   for rank, found in sockets.items()}
        assert exposed == {0: [], 1: []}, f"listening beyond loopback: {exposed}"
    finally:
        (tmp_path / "go").touch()
        thread.join(timeout=15.0)
        if thread.is_alive():  # run_ranks always stops its ranks; this is for one that hung
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert not thread.is_alive() and not errors, errors


def test_free_ports_lie_below_the_ephemeral_range() -> None:
    """A local rendezvous port is one no outgoing connection can be handed in the meantime
    (the kernel's ephemeral range is where it picks those), and it is free."""
    import socket

    from domino.utils import _ephemeral_range

    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # drawn at random, not one fixed port
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
