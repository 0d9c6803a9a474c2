"""Tests for domino.netem and the link probe (domino.bench.probe.measure_link). Those that build
namespaces skip unless root may create them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import domino
from domino import netem
from domino.bench.probe import measure_link
from domino.netem import EmulatedLink, cleanup_stale, parse_rate

SRC_DIR = str(Path(domino.__file__).resolve().parents[1])


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@pytest.fixture
def netns_ok() -> None:
    try:
        netem.check_can_emulate()
    except RuntimeError as e:
        pytest.skip(f"cannot emulate links here: {e}")


# ---- no privileges needed -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "norm", "bps"),
    [
        ("1gbit", "1gbit", 1e9),
        ("500mbit", "500mbit", 5e8),
        ("100mbit", "100mbit", 1e8),
        ("10gbit", "10gbit", 1e10),
        (" 2.5Gbit ", "2.5gbit", 2.5e9),
        ("64kbit", "64kbit", 6.4e4),
        ("125mbps", "125mbps", 1e9),  # tc's bps is bytes per second
    ],
)
def test_parse_rate(text: str, norm: str, bps: float) -> None:
    assert parse_rate(text) == norm
    assert netem.rate_bits_per_s(text) == pytest.approx(bps)


@pytest.mark.parametrize("bad", ["", "fast", "100", "100 mbit", "mbit", "-1gbit", "0mbit", "1gb"])
def test_parse_rate_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="gbit"):
        parse_rate(bad)


def test_link_arguments_validated() -> None:
    with pytest.raises(ValueError):
        EmulatedLink(1)
    with pytest.raises(ValueError):
        EmulatedLink(2, rate="quick")
    with pytest.raises(ValueError):
        EmulatedLink(2, latency="soon")
    with pytest.raises(ValueError):
        EmulatedLink(2, burst="lots")
    with pytest.raises(ValueError, match="mtu=70000"):
        EmulatedLink(2, mtu=70000)


def test_link_names_without_creating_anything() -> None:
    a, b = EmulatedLink(4, rate="500mbit"), EmulatedLink(4)
    assert not set(a.namespaces) & set(b.namespaces)
    assert all(str(os.getpid()) in ns for ns in a.namespaces)
    assert a.switch_namespace is not None and EmulatedLink(2).switch_namespace is None
    assert all(len(n) <= 15 for n in [*a.ifnames, *a._switch_ifnames, a._bridge])
    assert len(set(a.ifnames)) == 4
    nets = {addr.rsplit(".", 1)[0] for addr in a.addresses}
    assert len(nets) == 1 and a.addresses[0].startswith("10.") and a.master_addr == a.addresses[0]
    assert a.wrap(2, ["python", "-V"]) == ["ip", "netns", "exec", a.namespaces[2], "python", "-V"]
    env = a.env_for(1, master_port=1234)
    assert env["GLOO_SOCKET_IFNAME"] == a.ifnames[1] and env["MASTER_ADDR"] == a.addresses[0]
    assert env["MASTER_PORT"] == "1234"
    a.close()  # closing a link that was never brought up is a no-op


def test_check_can_emulate_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="needs root.*drop --emulate-link"):
        netem.check_can_emulate()


# ---- needs root and netns -----------------------------------------------------------------------


def test_two_host_allreduce_and_teardown(netns_ok: None) -> None:
    with EmulatedLink(2, rate="100mbit") as link:
        names = set(link.namespaces)
        assert names <= _netns_names()
        # Veths are made inside the namespaces, so none shows up in the root namespace.
        assert not any(ifname in _root_links() for ifname in link.ifnames)
        for ns, ifname in zip(link.namespaces, link.ifnames, strict=True):
            qdisc = subprocess.run(
                ["tc", "-n", ns, "qdisc", "show", "dev", ifname], capture_output=True, text=True
            ).stdout
            assert "tbf" in qdisc
        result = measure_link(link, nbytes=8 << 20, iters=1)
        assert result["ok"] and result["world_size"] == 2
        secs, ideal = result["seconds"], result["expected_s"]
        print(f"\n8 MiB all-reduce at 100mbit: {secs:.3f} s (ideal {ideal:.3f} s)")
    assert not names & _netns_names()
    link.close()  # idempotent


def test_mtu_is_set_on_every_veth(netns_ok: None) -> None:
    with EmulatedLink(3, rate="1gbit", mtu=9000) as link:
        ends = [*zip(link.namespaces, link.ifnames, strict=True),
                *((link.switch_namespace, swif) for swif in link._switch_ifnames)]
        for ns, ifname in ends:
            shown = subprocess.run(["ip", "-n", ns, "link", "show", "dev", ifname],
                                   capture_output=True, text=True, check=True).stdout
            assert " mtu 9000 " in shown, shown
        result = measure_link(link, nbytes=1 << 20, iters=1)
        assert result["ok"]


def test_teardown_when_body_raises(netns_ok: None) -> None:
    link = EmulatedLink(2, rate="1gbit")
    with pytest.raises(KeyError), link:
        assert set(link.namespaces) <= _netns_names()
        raise KeyError("boom")
    assert not set(link.namespaces) & _netns_names()
    assert not link.active


def test_close_kills_processes_left_in_namespace(netns_ok: None) -> None:
    with EmulatedLink(2) as link:
        # Closed once the process runs inside (a process still starting is not in it yet).
        proc = subprocess.Popen(link.wrap(1, [sys.executable, "-c", "import time; print('in', "
                                              "flush=True); time.sleep(60)"]),
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "in"
    assert proc.wait(timeout=10) != 0
    proc.stdout.close()
    assert not set(link.namespaces) & _netns_names()


def test_three_hosts_share_a_switch(netns_ok: None) -> None:
    server = textwrap.dedent(
        """
        import socket, sys
        s = socket.socket(); s.bind((sys.argv[1], 5000)); s.listen(1)
        print("ready", flush=True)
        c, _ = s.accept(); c.sendall(c.recv(16).upper()); c.close()
        """
    )
    client = textwrap.dedent(
        """
        import socket, sys
        c = socket.create_connection((sys.argv[1], 5000), timeout=5); c.sendall(b"ping")
        print(c.recv(16).decode())
        """
    )
    with EmulatedLink(3, rate="100mbit") as link:
        assert link.switch_namespace in _netns_names()
        # Each host pair talks through the bridge: 0 -> 2 and 2 -> 1.
        for src, dst in [(0, 2), (2, 1)]:
            srv = subprocess.Popen(
                link.wrap(dst, [sys.executable, "-c", server, link.addresses[dst]]),
                stdout=subprocess.PIPE,
                text=True,
            )
            assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
            out = subprocess.run(
                link.wrap(src, [sys.executable, "-c", client, link.addresses[dst]]),
                capture_output=True,
                text=True,
                timeout=10,
            )
            assert out.stdout.strip() == "PING", out.stderr
            srv.wait(timeout=5)
        names = {*link.namespaces, link.switch_namespace}
    assert not names & _netns_names()


def test_teardown_on_sigterm(netns_ok: None) -> None:
    script = textwrap.dedent(
        """
        import time
        from domino.netem import EmulatedLink
        link = EmulatedLink(2, rate="100mbit").up()
        print(" ".join(link.namespaces), flush=True)
        time.sleep(60)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        names = set(proc.stdout.readline().split())
        assert len(names) == 2 and names <= _netns_names()
        proc.send_signal(signal.SIGTERM)
        # The handler chains to the default action, so the child still dies "by SIGTERM".
        assert proc.wait(timeout=15) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not names & _netns_names()


@pytest.mark.serial
def test_cleanup_stale(netns_ok: None) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{netem.PREFIX}-{dead.pid}-beef-h0"
    mine = f"{netem.PREFIX}-{os.getpid()}-beef-h0"
    other = f"notdomino-{dead.pid}-beef-h0"
    for ns in (stale, mine, other):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = cleanup_stale()
        assert stale in removed and mine not in removed and other not in removed
        assert stale not in _netns_names() and {mine, other} <= _netns_names()
    finally:
        for ns in (stale, mine, other):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
