"""An emulated slow link between hosts on one machine: network namespaces joined by shaped veths.

Each host is a network namespace. Two hosts are joined by one veth pair; more hosts hang off a
bridge that lives in an extra "switch" namespace. Every veth end is shaped on egress with a
``tbf`` qdisc, so both directions of every hop are limited to ``rate``.

Namespace names are ``<prefix>-<pid>-<hex>-h<i>`` (``-sw`` for the switch), so a run's leftovers
can be found and removed by :func:`~domino.netem.namespaces.cleanup_stale` once the owning
process is dead. Interfaces are created directly inside the namespaces, so deleting the
namespaces removes every veth with them and nothing ever lands in the root namespace.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import signal
import threading
from types import FrameType
from typing import Any

from domino.netem.namespaces import PREFIX, delete_namespace, run_checked
from domino.netem.rates import SIZE_RE, TIME_RE, check_tbf_value, parse_rate

__all__ = ["EmulatedLink"]

_MAX_HOSTS = 250  # hosts get .1 .. .N of one /24


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


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
        self.burst = check_tbf_value(burst, SIZE_RE, "burst", "256kb")
        self.latency = check_tbf_value(latency, TIME_RE, "latency", "200ms")
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
                run_checked(["ip", "netns", "add", ns])
                self._created.append(ns)
                run_checked(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.switch_namespace is None:
                ns0, ns1 = self.namespaces
                if0, if1 = self.ifnames
                run_checked(
                    ["ip", "-n", ns0, "link", "add", if0, "type", "veth"]
                    + ["peer", "name", if1, "netns", ns1]
                )
            else:
                sw = self.switch_namespace
                run_checked(["ip", "-n", sw, "link", "add", self._bridge, "type", "bridge"])
                run_checked(["ip", "-n", sw, "link", "set", self._bridge, "up"])
                ports = zip(self.namespaces, self.ifnames, self._switch_ifnames, strict=True)
                for ns, ifname, swif in ports:
                    run_checked(
                        ["ip", "-n", sw, "link", "add", swif, "type", "veth"]
                        + ["peer", "name", ifname, "netns", ns]
                    )
                    run_checked(["ip", "-n", sw, "link", "set", swif, "master", self._bridge])
                    self._set_mtu(sw, swif)
                    run_checked(["ip", "-n", sw, "link", "set", swif, "up"])
                    self._shape(sw, swif)
            hosts = zip(self.namespaces, self.ifnames, self.addresses, strict=True)
            for ns, ifname, addr in hosts:
                run_checked(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname])
                self._set_mtu(ns, ifname)
                run_checked(["ip", "-n", ns, "link", "set", ifname, "up"])
                self._shape(ns, ifname)
        except BaseException:
            self.close()
            raise
        self._active = True
        return self

    def _set_mtu(self, ns: str, dev: str) -> None:
        if self.mtu is not None:
            run_checked(["ip", "-n", ns, "link", "set", "dev", dev, "mtu", str(self.mtu)])

    def _shape(self, ns: str, dev: str) -> None:
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
        run_checked(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])

    def close(self) -> None:
        """Delete every namespace of this link (which removes its veths); safe to call twice."""
        with _live_lock:
            created, self._created = self._created, []
            self._active = False
        for ns in reversed(created):
            delete_namespace(ns)
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
