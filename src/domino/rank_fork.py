"""Rank processes forked from a server that imported torch once (``DOMINO_RANK_START=fork``).

A fresh interpreter per rank spends seconds of CPU importing torch before it does anything;
where one process starts many short runs' ranks (the test suite: over a hundred ranks on two
cores) that is most of their cost. With ``DOMINO_RANK_START=fork`` the supervisor starts each
rank whose command is ``python -m MODULE ...`` as a fork of multiprocessing's fork server (a
single-threaded interpreter that only imported modules, started once per launcher process),
and runs the module there as ``python -m`` would: its own session, the launcher's stdin,
stdout, stderr and working directory, the rank's environment, no other inherited descriptor,
SIGTERM when the launcher dies, however it dies. The default, ``exec``, starts fresh
interpreters, as torchrun does; commands of another form (an emulated host's ``ip netns
exec ...``) always run that way.

What a fork cannot give: environment variables that a module reads when it is imported take
the server's value (the launcher's when it started the server; the ranks' thread counts are set
by the ranks themselves), and interpreter options (``-X``, ``PYTHONIOENCODING``; the rank's
``PYTHONPATH`` and ``PYTHONUNBUFFERED`` are applied); a ``sitecustomize`` is not read again;
multiprocessing imports the launcher's main module into the server as ``__mp_main__`` (so it
must keep its work under ``if __name__ == "__main__"``, as domino's entry points do); an
uncaught KeyboardInterrupt exits 1, not -2; ``ps`` shows every rank with the server's command
line. It pays where one process launches ranks many times (the test suite, a script driving
runs through ``domino.cli.main``): a single launch also starts the server, which imports its
list one module after another.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing import reduction

from domino.utils import process_state

ENV = "DOMINO_RANK_START"
# Imported once in the server (a module that fails to import there is skipped: the rank
# imports it itself).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.optim", "numpy",
           "safetensors.torch", "matplotlib", "matplotlib.pyplot", "domino.training.worker",
           "domino.bench.worker", "domino.inference.worker"]


def forking() -> bool:
    """Does ``DOMINO_RANK_START`` ask for forked ranks? (ValueError naming it if it is neither
    ``exec`` nor ``fork``; ``fork`` needs Linux.)"""
    value = os.environ.get(ENV, "exec")
    if value not in ("exec", "fork"):
        raise ValueError(f"{ENV}={value!r}: must be 'exec' (a fresh interpreter per rank, the "
                         "default) or 'fork' (ranks forked from a pre-imported server)")
    return value == "fork" and sys.platform == "linux"


def module_of(argv: Sequence[str]) -> str | None:
    """The module ``argv`` runs when it is ``[sys.executable, "-m", MODULE, ...]``, else None."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2]
    return None


class ForkedRank:
    """One rank forked from the server, with the part of :class:`subprocess.Popen` the
    supervisor uses (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``); exit codes as Popen's (negative: the signal that ended it)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        module = module_of(argv)
        if module is None:
            raise ValueError(f"only 'python -m MODULE ...' commands fork, not {list(argv)}")
        self.args = list(argv)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first rank)
        self._process = ctx.Process(
            target=_run_module, name=f"{module} (rank)",
            args=(module, list(argv[3:]), dict(env), [_Fd(fd) if _is_open(fd) else None
                                                      for fd in (0, 1, 2)]))
        self._process.start()
        # The supervisor alone waits for its ranks: multiprocessing's exit hook would join one
        # left running (a second Ctrl-C mid-stop), hanging the launcher where a Popen'd rank
        # would be left to its SIGTERM.
        multiprocessing.process._children.discard(self._process)
        self.pid: int = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            code = self._process.exitcode
            # 255 is also what multiprocessing reports when the server died (a signal to the
            # launcher's process group reaches it): the fork may still run, unreaped.
            if code != 255 or not _running(self.pid):
                self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            if self._process.exitcode is None:
                self._process.join(0.05)
            else:  # the server is gone: the fork is watched by its pid
                time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # exited since
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Fd:
    """A descriptor of the launcher's that the forked rank gets a copy of (passed to the server
    over its socket while the process is being started)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _identity, (reduction.DupFd(self.fd),)


def _terminate_after(sentinel: int) -> None:
    """SIGTERM this process once ``sentinel`` (the launcher's) is ready: the launcher is gone."""
    from multiprocessing.connection import wait

    wait([sentinel])
    os.kill(os.getpid(), signal.SIGTERM)


def _running(pid: int) -> bool:
    """Is ``pid`` a process that has not exited (Linux: neither gone nor a zombie)?"""
    return process_state(pid) not in (None, "Z", "X")


def _identity(x):
    return x


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _run_module(module: str, args: list[str], env: dict[str, str], fds: list) -> None:
    """In the fork: become what ``python -m module args`` started by Popen would be."""
    os.setsid()  # a terminal's Ctrl-C reaches the launcher, which stops the ranks itself
    # SIGTERM when the launcher dies, as PR_SET_PDEATHSIG gives a rank it started itself: the
    # parent here is the server, which lives while any of its forks does, so the fork watches
    # the launcher's end of the pipe multiprocessing keeps open for this (closed at its exit).
    launcher = multiprocessing.parent_process()
    if launcher is not None:
        threading.Thread(target=_terminate_after, args=(launcher.sentinel,), daemon=True,
                         name="launcher watch").start()
    for target, fd in enumerate(fds):  # a descriptor the launcher had closed: /dev/null
        fd = fd.detach() if fd is not None else os.open(os.devnull, os.O_RDWR)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # multiprocessing gave the fork /dev/null
    # Popen closes every other descriptor; here the server's pipes are open: a process the
    # rank starts must not inherit them (it would keep the server, and through it the
    # launcher's output pipes, open after the rank ends).
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.set_inheritable(int(name), False)
            except OSError:  # the listing's own descriptor, closed by now
                pass
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONUNBUFFERED"):  # what the interpreter would have read at start
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    # sys.path is the launcher's (multiprocessing's); the rank's own PYTHONPATH goes first,
    # as a fresh interpreter's would.
    extra = [d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d]
    sys.path[:0] = [d for d in extra if d not in sys.path]
    import atexit
    import runpy

    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:  # multiprocessing ends the fork with os._exit; an interpreter runs these first
        atexit._run_exitfuncs()
