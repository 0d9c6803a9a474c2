"""A rank that stops responding without exiting (SIGSTOP: Ctrl-Z, a debugger, a frozen host)
brings the whole `domino train` run down within the collective timeout plus a stated bound,
over the shared-memory transport and over gloo alone, with a message naming the stopped rank
and what its peer was doing."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from test_durable_cli import FLAGS, _start, _stderr, _wait_for, data_flags
from test_train_cli import _workers_of

from domino.supervisor import is_stopped
from domino.training.launch import STALL_MARGIN_S
from domino.training.progress import Progress, is_collective_timeout, timeout_report

TIMEOUT_MIN = 0.25  # --distributed-timeout-minutes of the runs: 15 s
BOUND_S = 30.0  # all processes are down within the timeout plus this (docs/errors.md)


def _rank_pid(run: Path, rank: int) -> int:
    for pid in _workers_of(run / "config.json"):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no process of rank {rank} for {run}")


def _steps_logged(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def test_a_stopped_rank_stops_the_run(tmp_path: Path, byte_dataset) -> None:
    # Both transports at once: the two runs' waits overlap, so the test costs one timeout.
    flags = [*FLAGS, *data_flags(byte_dataset), "--train-iters", "100000",
             "--distributed-timeout-minutes", str(TIMEOUT_MIN), "--save-interval", "0"]
    runs = {"shm": tmp_path / "shm", "gloo": tmp_path / "gloo"}
    procs = {"shm": _start([*flags, "--save", str(runs["shm"])]),
             "gloo": _start([*flags, "--save", str(runs["gloo"]), "--no-shared-memory-comm"])}
    workers = {}
    try:
        for name, proc in procs.items():
            _wait_for(lambda r=runs[name]: _steps_logged(r) >= 2, proc, "two logged steps")
        stopped_at = {}
        for name in procs:
            workers[name] = _workers_of(runs[name] / "config.json")
            pid = _rank_pid(runs[name], 1)
            os.kill(pid, signal.SIGSTOP)
            stopped_at[name] = time.monotonic()
            while not is_stopped(pid):  # the signal takes effect when the kernel next runs it
                assert time.monotonic() - stopped_at[name] < 5, "SIGSTOP did not take effect"
                time.sleep(0.01)
        limit = TIMEOUT_MIN * 60 + BOUND_S
        for name, proc in procs.items():
            proc.wait(timeout=limit + 5)
            took = time.monotonic() - stopped_at[name]
            assert took <= limit, f"{name}: down {took:.0f} s after the stop"
            alive = [p for p in workers[name] if Path(f"/proc/{p}").exists()
                     and not Path(f"/proc/{p}/stat").read_text().split(") ")[-1].startswith("Z")]
            assert not alive, f"{name}: ranks {alive} outlived the launcher"
            err = _stderr(proc)
            assert proc.returncode == 1, err
            assert "rank 1 is stopped (its process is stopped: SIGSTOP" in err, err
            # The peer's own timeout fired first (the launcher's watchdog is the backstop):
            # it says what it was doing and which timeout ran out.
            assert "[rank 0] step " in err and (
                "a collective timed out after --distributed-timeout-minutes 0.25" in err), err
            assert "Traceback" not in err, err
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for pids in workers.values():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_the_launcher_stops_a_run_whose_rank_stays_stopped(tmp_path: Path) -> None:
    """The watchdog alone (no collective to time out): a rank stopped for ``stall_s`` fails
    the run, named, and every rank is gone."""
    import sys

    from domino.supervisor import RankFailed, run_ranks

    sleeper = [sys.executable, "-c", "import os, signal, time; "
               "os.kill(os.getpid(), signal.SIGSTOP) if os.environ['RANK'] == '1' else None; "
               "time.sleep(60)"]
    envs = [dict(os.environ, RANK=str(r)) for r in range(2)]
    t0 = time.monotonic()
    try:
        run_ranks([sleeper] * 2, envs, label="t", stall_s=1.0)
    except RankFailed as err:
        assert err.rank == 1 and "rank 1 is stopped" in str(err) and "for 1 s" in str(err)
    else:
        raise AssertionError("a stopped rank went unnoticed")
    assert time.monotonic() - t0 < 15


def test_what_a_timed_out_rank_reports() -> None:
    progress = Progress()
    gloo = RuntimeError("[pair.cc:534] Timed out waiting 15000ms for recv operation to complete")
    assert is_collective_timeout(gloo)
    # gloo's other words for it, when the timeout fires inside a transfer (seen in a run)
    assert is_collective_timeout(RuntimeError("Application timeout caused pair closure"))
    wrapped = RuntimeError("shared-memory collective of the tp group: ...")
    wrapped.__cause__ = RuntimeError("rank(s) 1 of the group did not join a collective within "
                                     "the process group's timeout (15 s)")
    assert is_collective_timeout(wrapped)
    assert not is_collective_timeout(ValueError("bad input"))
    assert timeout_report(gloo, progress, 1.0).startswith("setting up: a collective timed out "
                                                          "after --distributed-timeout-minutes 1")
    progress.at(7, "evaluation")
    assert str(progress) == "step 7, evaluation"
    assert STALL_MARGIN_S < BOUND_S  # the launcher's backstop fires inside the stated bound
