"""Emulate ranks on separate hosts joined by a slow link, using Linux network namespaces.

Each rank runs in its own network namespace. Two hosts are joined by one veth pair; more hosts
hang off a bridge that lives in an extra "switch" namespace. Every veth end is shaped on egress
with a ``tbf`` qdisc, so both directions of every hop are limited to ``rate``.

Namespace names are ``<prefix>-<pid>-<hex>-h<i>`` (``-sw`` for the switch), so a run's leftovers
can be found and removed by :func:`cleanup_stale` once the owning process is dead. Interfaces are
created directly inside the namespaces, so deleting the namespaces removes every veth with them
and nothing ever lands in the root namespace.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

from domino.supervisor import local_env, run_ranks
from domino.utils import free_port

__all__ = [
    "PREFIX",
    "EmulatedLink",
    "check_can_emulate",
    "cleanup_stale",
    "measure_link",
    "parse_rate",
    "rate_bits_per_s",
]

PREFIX = "domino"

_ROOT_MSG = (
    "--emulate-link needs root to create network namespaces; run as root or drop --emulate-link"
)

# tc rate units: bit-based SI units, and byte-based ones ("bps" means bytes per second in tc).
_RATE_UNITS: dict[str, float] = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8.0,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([a-z]+)$")
_RATE_HELP = (
    "expected <number><unit> with unit one of bit, kbit, mbit, gbit, tbit (bits/s) "
    "or bps, kbps, mbps, gbps, tbps (bytes/s), e.g. '1gbit', '500mbit', '100mbit', '10gbit'"
)
_SIZE_RE = re.compile(r"^\d+(?:\.\d+)?(?:b|k|kb|m|mb|g|gb|kbit|mbit|gbit)?$")
_TIME_RE = re.compile(r"^\d+(?:\.\d+)?(?:s|sec|secs|ms|msec|msecs|us|usec|usecs)$")

_MAX_HOSTS = 250  # hosts get .1 .. .N of one /24


def parse_rate(s: str) -> str:
    """Validate a tc rate such as ``"100mbit"`` and return it normalised (lower case)."""
    norm = s.strip().lower()
    m = _RATE_RE.match(norm)
    if m is None or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"invalid link rate {s!r}: {_RATE_HELP}")
    return norm


def rate_bits_per_s(s: str) -> float:
    """Return a tc rate string as bits per second, e.g. ``"1gbit"`` -> ``1e9``."""
    m = _RATE_RE.match(parse_rate(s))
    assert m is not None  # parse_rate already validated it
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def _check_spec(value: str, pattern: re.Pattern[str], what: str, example: str) -> str:
    norm = value.strip().lower()
    if not pattern.match(norm):
        raise ValueError(f"invalid tbf {what} {value!r}; expected something like {example!r}")
    return norm


def _run(cmd: list[str]) -> str:
    """Run a command, raising RuntimeError with its stderr when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}: {detail}")
    return proc.stdout


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


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
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state field follows the parenthesised command name, which may contain spaces.
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _delete_namespace(ns: str) -> None:
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
        _delete_namespace(ns)
        removed.append(ns)
    return removed


# ---- teardown on exit and signals ---------------------------------------------------------------
#
# Module-level on purpose: signal handlers and atexit hooks belong to the whole process, so the
# list of live links they must tear down (and the handlers they chain to) does too.

_live: list[EmulatedLink] = []
_live_lock = threading.RLock()
_atexit_registered = False
_prev_handlers: dict[int, Any] = {}
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _close_all() -> None:
    with _live_lock:
        links = list(_live)
    for link in links:
        # A forked child inherits the registry but must not tear down its parent's link.
        if link._owner_pid == os.getpid():
            link.close()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _close_all()
    prev = _prev_handlers.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        # Default action: re-deliver with the default disposition so the exit status still
        # says "killed by SIGTERM" to whoever waits on us.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(link: EmulatedLink) -> None:
    global _atexit_registered
    with _live_lock:
        _live.append(link)
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True
        for sig in _SIGNALS:
            current = signal.getsignal(sig)
            if current is _on_signal:
                continue
            try:
                signal.signal(sig, _on_signal)
            except ValueError:
                # Not the main thread: signals cannot be hooked; atexit and __exit__ still apply.
                continue
            _prev_handlers[sig] = current


def _unregister(link: EmulatedLink) -> None:
    with _live_lock:
        if link in _live:
            _live.remove(link)
        if _live:
            return
        for sig, prev in list(_prev_handlers.items()):
            # Only restore if nobody chained on top of us meanwhile; otherwise leave theirs.
            try:
                if signal.getsignal(sig) is _on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except ValueError:
                continue
            del _prev_handlers[sig]


# ---- the link -----------------------------------------------------------------------------------


class EmulatedLink:
    """Network namespaces, one per host, joined by shaped veths; a context manager.

    Construction only picks names and addresses; :meth:`up` (or ``with``) creates them and
    :meth:`close` (or leaving the ``with``) deletes them, idempotently.
    """

    def __init__(
        self,
        num_hosts: int = 2,
        rate: str = "1gbit",
        burst: str = "256kb",
        latency: str = "200ms",
        prefix: str = PREFIX,
        mtu: int | None = None,
    ) -> None:
        if not 2 <= num_hosts <= _MAX_HOSTS:
            raise ValueError(f"num_hosts must be in [2, {_MAX_HOSTS}], got {num_hosts}")
        if not re.fullmatch(r"[a-z][a-z0-9]*", prefix):
            raise ValueError(f"prefix must be lower-case alphanumeric, got {prefix!r}")
        self.num_hosts = num_hosts
        self.rate = parse_rate(rate)
        self.burst = _check_spec(burst, _SIZE_RE, "burst", "256kb")
        self.latency = _check_spec(latency, _TIME_RE, "latency", "200ms")
        if mtu is not None and not 1280 <= mtu <= 65535:
            raise ValueError(f"mtu={mtu} must be in [1280, 65535] (1500 is Ethernet's, 9000 "
                             "jumbo frames), or None for the veth default")
        self.mtu = mtu
        self._owner_pid = os.getpid()
        rid = secrets.token_hex(2)
        self.run_id = f"{prefix}-{self._owner_pid}-{rid}"
        self.namespaces: list[str] = [f"{self.run_id}-h{i}" for i in range(num_hosts)]
        self.switch_namespace: str | None = f"{self.run_id}-sw" if num_hosts > 2 else None
        # "d" + base36 pid (<= 5) + 4 hex + role + index (<= 3): at most 14 chars (limit is 15).
        tag = f"d{_b36(self._owner_pid)}{rid}"
        self.ifnames: list[str] = [f"{tag}h{i}" for i in range(num_hosts)]
        self._switch_ifnames = [f"{tag}s{i}" for i in range(num_hosts)]
        self._bridge = f"{tag}br"
        # A random 10.x.y.0/24 per run keeps concurrent runs' addresses (and logs) distinct.
        rnd = secrets.randbelow(256 * 256)
        net = f"10.{rnd // 256}.{rnd % 256}"
        self.subnet = f"{net}.0/24"
        self.addresses: list[str] = [f"{net}.{i + 1}" for i in range(num_hosts)]
        self._created: list[str] = []
        self._active = False

    @property
    def master_addr(self) -> str:
        """Address of rank 0's namespace, for MASTER_ADDR."""
        return self.addresses[0]

    @property
    def active(self) -> bool:
        """True between a successful :meth:`up` and :meth:`close`."""
        return self._active

    def __repr__(self) -> str:
        return (
            f"EmulatedLink(num_hosts={self.num_hosts}, rate={self.rate!r}, "
            f"run_id={self.run_id!r}, active={self._active})"
        )

    def up(self) -> EmulatedLink:
        """Create namespaces, veths and qdiscs; on any failure remove whatever was made."""
        if self._active or self._created:
            raise RuntimeError(f"{self.run_id} is already up")
        # Register first, so a signal arriving mid-setup still tears down the partial set.
        _register(self)
        try:
            extra = [self.switch_namespace] if self.switch_namespace else []
            for ns in [*self.namespaces, *extra]:
                _run(["ip", "netns", "add", ns])
                self._created.append(ns)
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.switch_namespace is None:
                ns0, ns1 = self.namespaces
                if0, if1 = self.ifnames
                _run(
                    ["ip", "-n", ns0, "link", "add", if0, "type", "veth"]
                    + ["peer", "name", if1, "netns", ns1]
                )
            else:
                sw = self.switch_namespace
                _run(["ip", "-n", sw, "link", "add", self._bridge, "type", "bridge"])
                _run(["ip", "-n", sw, "link", "set", self._bridge, "up"])
                ports = zip(self.namespaces, self.ifnames, self._switch_ifnames, strict=True)
                for ns, ifname, swif in ports:
                    _run(
                        ["ip", "-n", sw, "link", "add", swif, "type", "veth"]
                        + ["peer", "name", ifname, "netns", ns]
                    )
                    _run(["ip", "-n", sw, "link", "set", swif, "master", self._bridge])
                    self._set_mtu(sw, swif)
                    _run(["ip", "-n", sw, "link", "set", swif, "up"])
                    self._shape(sw, swif)
            hosts = zip(self.namespaces, self.ifnames, self.addresses, strict=True)
            for ns, ifname, addr in hosts:
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname])
                self._set_mtu(ns, ifname)
                _run(["ip", "-n", ns, "link", "set", ifname, "up"])
                self._shape(ns, ifname)
        except BaseException:
            self.close()
            raise
        self._active = True
        return self

    def _set_mtu(self, ns: str, dev: str) -> None:
        if self.mtu is not None:
            _run(["ip", "-n", ns, "link", "set", "dev", dev, "mtu", str(self.mtu)])

    def _shape(self, ns: str, dev: str) -> None:
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])

    def close(self) -> None:
        """Delete every namespace of this link (which removes its veths); safe to call twice."""
        with _live_lock:
            created, self._created = self._created, []
            self._active = False
        for ns in reversed(created):
            _delete_namespace(ns)
        _unregister(self)

    def __enter__(self) -> EmulatedLink:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def env_for(self, rank: int, master_port: int | None = None) -> dict[str, str]:
        """Environment variables rank ``rank`` needs to run gloo over the emulated link."""
        ifname = self.ifnames[rank]
        env = {
            "GLOO_SOCKET_IFNAME": ifname,
            "TP_SOCKET_IFNAME": ifname,  # tensorpipe (torch RPC) reads its own variable
            "MASTER_ADDR": self.master_addr,
        }
        if master_port is not None:
            env["MASTER_PORT"] = str(master_port)
        return env

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        """Prefix ``argv`` so it runs inside host ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]


# ---- sanity check -------------------------------------------------------------------------------


def measure_link(
    link: EmulatedLink | None,
    nbytes: int = 8 << 20,
    iters: int = 1,
    num_ranks: int = 2,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Time a gloo all-reduce of ``nbytes`` float32 between the link's hosts (the benchmark's own
    probe, :mod:`domino.bench.probe`, one rank per host).

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
