"""Network namespaces of emulated hosts: create-or-fail commands, whether this machine can make
them at all, and removing them (with whatever still runs inside) when a run is over or died.

Namespace names are ``<prefix>-<pid>-<hex>-...``, so a dead run's leftovers can be found by
:func:`cleanup_stale`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time

from domino.utils import process_state

PREFIX = "domino"

_ROOT_MSG = (
    "--emulate-link needs root to create network namespaces; run as root or drop --emulate-link"
)


def run_checked(cmd: list[str]) -> str:
    """Run a command, raising RuntimeError with its stderr when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}: {detail}")
    return proc.stdout


def _list_namespaces() -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return []
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_ns_procs(ns: str, grace_s: float = 1.0) -> None:
    """Terminate processes left inside ``ns``: they would keep the namespace (and veths) alive."""
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    pids = [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    if not pids:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            pids = [p for p in pids if _pid_alive(p) and not _is_zombie(p)]
            if not pids:
                return
            time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    return process_state(pid) == "Z"


def delete_namespace(ns: str) -> None:
    """Stop what still runs in ``ns``, then delete it (its veths go with it)."""
    _kill_ns_procs(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def check_can_emulate() -> None:
    """Raise RuntimeError explaining why link emulation cannot run here, if it cannot."""
    if os.geteuid() != 0:
        raise RuntimeError(_ROOT_MSG)
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise RuntimeError(
                f"--emulate-link needs the '{tool}' command (iproute2); install iproute2 "
                "or drop --emulate-link"
            )
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            "--emulate-link could not create a network namespace "
            f"('ip netns add' failed: {proc.stderr.strip()}); in a container this usually needs "
            "CAP_SYS_ADMIN (e.g. --privileged); otherwise drop --emulate-link"
        )


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix>-<pid>-...`` whose owning pid is dead; return their names.

    Liveness is judged in this process's pid namespace, so only call it where the earlier runs
    shared that pid namespace (the normal case on one machine).
    """
    pat = re.compile(rf"^{re.escape(prefix)}-(\d+)-[0-9a-f]+-")
    removed = []
    for ns in _list_namespaces():
        m = pat.match(ns)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        delete_namespace(ns)
        removed.append(ns)
    return removed
