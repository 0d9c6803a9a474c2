"""The launcher's two ways to start local ranks (``DOMINO_RANK_START``): fresh interpreters
(``exec``, the default) and forks of a pre-imported server (``fork``, which the rest of the suite
uses) give a rank the same process: arguments, environment, working directory, its own session,
the launcher's stdout and stderr, exit codes, and death with the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from domino import rank_fork
from domino.supervisor import RankFailed, local_env, run_ranks

TESTS = str(Path(__file__).parent)
ECHO = [sys.executable, "-m", "rank_echo"]  # tests/rank_echo.py


def _envs(n: int, extra: str = "/nonexistent-extra") -> list[dict[str, str]]:
    path = os.pathsep.join(p for p in (TESTS, extra, os.environ.get("PYTHONPATH")) if p)
    return [local_env(r, n, 0, ECHO_MARKER=f"m{r}", PYTHONPATH=path, ECHO_EXTRA=extra)
            for r in range(n)]


@pytest.mark.parametrize("mode", ["exec", "fork"])
def test_a_rank_is_the_same_process_either_way(mode, tmp_path, capfd, monkeypatch) -> None:
    monkeypatch.setenv(rank_fork.ENV, mode)
    monkeypatch.chdir(tmp_path)
    run_ranks([[*ECHO, str(tmp_path), "0"]] * 2, _envs(2, str(tmp_path / "extra")),
              label="echo")
    out, err = capfd.readouterr()
    for r in range(2):
        seen = json.loads((tmp_path / f"{r}.json").read_text())
        # Also: the rank's PYTHONPATH on its sys.path, its stdin on fd 0, no descriptor past
        # stdio that a process it starts would inherit (Popen closes them).
        assert seen == {"argv": [str(tmp_path), "0"], "argv0": "rank_echo.py", "name": "__main__",
                        "rank": str(r), "marker": f"m{r}", "cwd": str(tmp_path),
                        "session_leader": True, "pid": seen["pid"], "stdin_fd": 0,
                        "inheritable": [], "extra_path": True}, seen
        assert f"echo stdout rank {r}" in out and f"echo stderr rank {r}" in err
        assert seen["pid"] != os.getpid()
    # Exit codes, as Popen gives them: a code, or minus the signal that ended the rank.
    for code, reported in (("3", 3), ("kill", -signal.SIGKILL)):
        with pytest.raises(RankFailed) as failed:
            run_ranks([[*ECHO, str(tmp_path), code], [*ECHO, str(tmp_path), "sleep"]],
                      _envs(2), label="echo", grace_s=2.0)
        assert (failed.value.rank, failed.value.code) == (0, reported)
        assert f"rank 0 exited with code {reported}" in str(failed.value)
    if mode == "fork":  # the supervisor alone waits for its ranks: multiprocessing's exit
        import multiprocessing  # hook would join one left running, hanging the launcher

        rank = rank_fork.ForkedRank([*ECHO, str(tmp_path), "sleep"], _envs(1)[0])
        try:
            assert rank.poll() is None and multiprocessing.active_children() == []
        finally:
            rank.kill()
        assert rank.wait(timeout=10) == -signal.SIGKILL


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state == "Z"  # exited, not yet reaped


def _launcher(tmp_path: Path, code: str, mode: str, run_args: str,
              **popen) -> subprocess.Popen:
    """A launcher process running ``run_ranks`` (``run_args`` added to its call) over two
    ``rank_echo CODE`` ranks, exiting with ``Interrupted``'s code; returns once both ranks
    have written what they see."""
    script = ("import json, sys\n"
              "from domino.supervisor import Interrupted, run_ranks\n"
              "argv, envs = json.loads(sys.argv[1])\n"
              "try:\n"
              f"    run_ranks([argv] * len(envs), envs, label='echo', {run_args})\n"
              "except Interrupted as err:\n"
              "    sys.exit(err.exit_code)\n")
    envs = _envs(2)
    launcher = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps([[*ECHO, str(tmp_path), code], envs])],
        env=dict(os.environ, **{rank_fork.ENV: mode}, PYTHONPATH=envs[0]["PYTHONPATH"]),
        **popen)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{r}.json").exists() for r in range(2)):
            assert launcher.poll() is None and time.monotonic() < deadline, "no rank started"
            time.sleep(0.1)
        time.sleep(0.3)  # the files are closed, a rank's SIGTERM handler is in place
    except BaseException:
        launcher.kill()
        raise
    return launcher


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize(("how", "mode"), [(signal.SIGINT, "fork"), (signal.SIGKILL, "fork"),
                                           (signal.SIGKILL, "exec")],
                         ids=["ctrl_c-fork", "killed-fork", "killed-exec"])
def test_ranks_end_with_the_launcher(how, mode, tmp_path) -> None:
    """Ctrl-C: the launcher stops its ranks and exits 130 (with fresh interpreters:
    test_train_cli's Ctrl-C test). SIGKILL: the launcher can do nothing; a rank it started gets
    SIGTERM from the kernel, a forked one from its thread watching the launcher."""
    # As from a terminal: a test run started in the background has SIGINT ignored.
    launcher = _launcher(tmp_path, "sleep", mode, "grace_s=2.0",
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        pids = [json.loads((tmp_path / f"{r}.json").read_text())["pid"] for r in range(2)]
        assert not any(_gone(p) for p in pids)
        launcher.send_signal(how)
        assert launcher.wait(timeout=30) == (130 if how == signal.SIGINT else -signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in pids if not _gone(p)]
        for p in alive:
            os.kill(p, signal.SIGKILL)
        assert not alive, f"ranks {alive} outlived their launcher ({mode})"
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.skipif(sys.platform != "linux", reason="forked ranks are Linux's")
def test_a_signal_to_the_launchers_group_keeps_the_wind_down(tmp_path) -> None:
    """SIGTERM to the launcher's process group (`timeout`, `kill -TERM -PGID`) also ends the
    fork server; the ranks, in their own sessions, still get the wind-down: the launcher exits
    only after each has stopped in its own time."""
    launcher = _launcher(tmp_path, "linger", "fork", "wind_down_s=30", start_new_session=True)
    try:
        os.killpg(launcher.pid, signal.SIGTERM)  # the launcher and the server
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
        done = [(tmp_path / f"{r}.done").exists() for r in range(2)]
        assert done == [True, True], "the launcher exited before its ranks had stopped"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_the_setting_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(rank_fork.ENV, "spawn")
    with pytest.raises(ValueError, match=r"DOMINO_RANK_START='spawn': must be 'exec'.*'fork'"):
        run_ranks([[*ECHO, "/nonexistent", "0"]], _envs(1), label="echo")
    monkeypatch.delenv(rank_fork.ENV)
    assert not rank_fork.forking()  # the default: fresh interpreters
    assert rank_fork.module_of([sys.executable, "-m", "x", "a"]) == "x"
    assert rank_fork.module_of(["ip", "netns", "exec", "h0", sys.executable, "-m", "x"]) is None
