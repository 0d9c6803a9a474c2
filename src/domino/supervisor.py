"""Start one process per rank on this host and supervise them: the one launcher behind
``domino train`` (local ranks), ``domino bench`` and the link probe.

Each rank runs in its own session, so a terminal's Ctrl-C reaches only the parent, which then
stops every rank itself. On Linux each rank also gets SIGTERM when the parent dies, however it
dies (``PR_SET_PDEATHSIG``), so no rank outlives its launcher. When a rank exits non-zero the
others are stopped at once (the process-group timeout is only a backstop for ranks on other
hosts). A rank whose process is stopped (SIGSTOP, Ctrl-Z, a debugger) holds its peers in their
collectives without exiting: with ``stall_s`` the launcher stops every rank once one has been
stopped that long, and any failure report names the stopped ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from domino import host_memory, rank_fork
from domino.utils import process_state, stop_processes

GRACE_S = 5.0  # SIGTERM first; SIGKILL whatever is left after this long
SETTLE_S = 1.0  # after a rank fails, how long to wait for the others before naming who failed


class Interrupted(KeyboardInterrupt):
    """The launcher was interrupted (Ctrl-C or SIGTERM); every rank has exited."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Terminate(BaseException):
    """Raised in the main thread by the launcher's SIGTERM handler."""


class RankFailed(RuntimeError):
    """A rank exited non-zero (or outlived another rank by too long); the others were stopped."""

    def __init__(self, message: str, rank: int, code: int | None) -> None:
        super().__init__(message)
        self.rank, self.code = rank, code

    @property
    def exit_code(self) -> int:
        """What the launcher should exit with: the rank's code, 1 for a signal or a straggler."""
        return self.code if self.code is not None and self.code > 0 else 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_ranks(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *,
              label: str, straggler_s: float | None = None, grace_s: float = GRACE_S,
              wind_down_s: float | None = None, stall_s: float | None = None,
              poll_s: float = 0.05) -> None:
    """Run ``commands[r]`` with environment ``envs[r]`` for every rank r; return when all exit 0.

    The first rank to fail stops the others and raises :class:`RankFailed` (so does a rank still
    running ``straggler_s`` after another finished). Ctrl-C or SIGTERM to this process raises
    :class:`Interrupted` once every rank is stopped; with ``wind_down_s`` the ranks first get
    SIGTERM and that long to finish on their own (a trainer checkpoints at its next step
    boundary), a second Ctrl-C cutting it short. A rank whose process stays stopped for
    ``stall_s`` (the ranks' collective timeout) fails the run as a failed rank would. Every rank
    has exited when this returns or raises.
    """
    if len(commands) != len(envs):
        raise ValueError(f"{len(commands)} commands but {len(envs)} environments")
    preexec = _die_with_parent if sys.platform == "linux" else None
    fork = rank_fork.forking()
    host_memory.enabled()  # a bad DOMINO_MALLOC_TUNING fails here, before any rank starts
    procs: list[subprocess.Popen | rank_fork.ForkedRank] = []
    previous = _on_sigterm_raise()
    try:
        for argv, env in zip(commands, envs, strict=True):
            if fork and rank_fork.module_of(argv) is not None:
                procs.append(rank_fork.ForkedRank(argv, env))
            else:
                procs.append(subprocess.Popen(list(argv), env=dict(env), start_new_session=True,
                                              preexec_fn=preexec))
        _watch(procs, label, _Limits(straggler_s, stall_s, grace_s, poll_s))
    except (KeyboardInterrupt, _Terminate) as exc:
        signum = signal.SIGTERM if isinstance(exc, _Terminate) else signal.SIGINT
        if wind_down_s and any(p.poll() is None for p in procs):
            print(f"{label}: {signal.Signals(signum).name}: interrupted; the ranks stop at their "
                  f"next step boundary with a checkpoint (waiting up to {wind_down_s:.0f} s; "
                  "Ctrl-C again to stop them now)", file=sys.stderr, flush=True)
            _wind_down(procs, wind_down_s)
        raise Interrupted(signum) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        stop_processes(procs, grace_s)


def _on_sigterm_raise():
    """In the main thread: SIGTERM raises _Terminate (returns the previous handler)."""
    def handler(_signum, _frame):
        raise _Terminate

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave SIGTERM as it is
        return None


def _wind_down(procs: list[subprocess.Popen], wait_s: float) -> None:
    """SIGTERM every live rank and wait up to ``wait_s`` for them to exit by themselves."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    except (KeyboardInterrupt, _Terminate):
        pass  # a second interrupt: stop_processes kills what is left


@dataclass(frozen=True)
class _Limits:
    straggler_s: float | None
    stall_s: float | None
    grace_s: float
    poll_s: float


def _watch(procs: list[subprocess.Popen], label: str, limits: _Limits) -> None:
    first_done: float | None = None
    stopped_since: dict[int, float] = {}
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            _fail(procs, label, limits)
        if all(c == 0 for c in codes):
            return
        if limits.straggler_s is not None and any(c == 0 for c in codes):
            first_done = first_done or time.monotonic()
            if time.monotonic() - first_done > limits.straggler_s:
                late = [r for r, c in enumerate(codes) if c is None]
                stop_processes(procs, limits.grace_s)
                raise RankFailed(f"{label}: ranks {late} still running {limits.straggler_s:.0f} "
                                 "s after another finished; stopped them", late[0], None)
        if limits.stall_s is not None:
            _check_stopped(procs, label, limits, stopped_since)
        time.sleep(limits.poll_s)


def _fail(procs: list[subprocess.Popen], label: str, limits: _Limits) -> NoReturn:
    """A rank exited non-zero: name it (and every rank that failed within SETTLE_S of it, and
    any rank whose process is stopped), stop the others, raise RankFailed."""
    # Ranks that lose a peer fail within milliseconds of it, sometimes before the failing
    # rank's own process is gone: every rank that fails within SETTLE_S of the first is named
    # (their own output says which one started it).
    codes = [p.poll() for p in procs]
    settle = time.monotonic() + SETTLE_S
    while time.monotonic() < settle and any(c is None for c in codes):
        time.sleep(limits.poll_s)
        codes = [p.poll() for p in procs]
    failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
    rank, code = failed[0]
    who = (f"rank {rank} exited with code {code}" if len(failed) == 1 else
           "ranks " + ", ".join(str(r) for r, _ in failed) + " exited with codes "
           + ", ".join(str(c) for _, c in failed))
    stopped = [r for r, p in enumerate(procs) if p.poll() is None and is_stopped(p.pid)]
    if stopped:
        who += (f"; {_ranks(stopped)} stopped ({STOPPED_WHY}): the others waited for it in a "
                "collective until their timeout")
    print(f"{label}: {who}; stopping the other ranks", file=sys.stderr, flush=True)
    _stop(procs, stopped, limits.grace_s)
    raise RankFailed(f"{label}: {who} (see their output above); the other ranks were "
                     "stopped", rank, code)


def _check_stopped(procs: list[subprocess.Popen], label: str, limits: _Limits,
                   since: dict[int, float]) -> None:
    """Fail the run once a rank's process has been stopped for ``limits.stall_s``."""
    now = time.monotonic()
    for r, p in enumerate(procs):
        if p.poll() is None and is_stopped(p.pid):
            since.setdefault(r, now)
        else:
            since.pop(r, None)
    late = sorted(r for r, t in since.items() if now - t >= limits.stall_s)
    if not late:
        return
    message = (f"{label}: {_ranks(late)} stopped ({STOPPED_WHY}) for {now - since[late[0]]:.0f}"
               f" s, the ranks' collective timeout ({limits.stall_s:.0f} s): the others cannot "
               "go on without it; stopping every rank")
    print(message, file=sys.stderr, flush=True)
    _stop(procs, late, limits.grace_s)
    raise RankFailed(message, late[0], None)


STOPPED_WHY = "its process is stopped: SIGSTOP, Ctrl-Z or a debugger"


def _ranks(ranks: list[int]) -> str:
    return (f"rank {ranks[0]} is" if len(ranks) == 1
            else "ranks " + ", ".join(map(str, ranks)) + " are")


def _stop(procs: list[subprocess.Popen], stopped: list[int], grace_s: float) -> None:
    """Stop every rank; a stopped one is killed at once (it cannot act on SIGTERM)."""
    for r in stopped:
        procs[r].kill()
    stop_processes(procs, grace_s)


def is_stopped(pid: int) -> bool:
    """Is process ``pid`` stopped by a signal or a tracer (Linux ``/proc`` state T or t)?
    False where that cannot be read (another system, a process gone)."""
    return process_state(pid) in ("T", "t")


def local_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """This process's environment plus torchrun's variables for local rank ``rank``; on Linux
    gloo gets loopback (``GLOO_SOCKET_IFNAME=lo``) unless the user or ``extra`` names an
    interface (the emulated link replaces it with its own)."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               **extra)
    if sys.platform == "linux":
        # Otherwise gloo listens on the address the host name resolves to, often a network
        # address, though every rank is on this host.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env
