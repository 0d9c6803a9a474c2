"""A rank for the launcher's tests (``python -m rank_echo OUT CODE``): writes what it sees as a
process (its arguments, environment, working directory, session) to OUT/<RANK>.json,
prints a line to stdout and one to stderr, then exits with CODE (``sleep``: waits to be
stopped; ``linger``: the same, taking 1.5 s to stop on SIGTERM; ``kill``: ends itself with
SIGKILL)."""

import json
import os
import signal
import sys
import time


def _inheritable() -> list[int]:
    """Descriptors past stdio that a process this one starts would inherit."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if int(name) > 2 and os.get_inheritable(int(name)):
                fds.append(int(name))
        except OSError:  # the listing's own descriptor
            pass
    return fds


def main() -> int:
    out, code = sys.argv[1], sys.argv[2]
    rank = os.environ["RANK"]
    seen = {"argv": sys.argv[1:], "argv0": os.path.basename(sys.argv[0]), "name": __name__,
            "rank": rank, "marker": os.environ.get("ECHO_MARKER"), "cwd": os.getcwd(),
            "session_leader": os.getsid(0) == os.getpid(), "pid": os.getpid(),
            "stdin_fd": sys.stdin.fileno(), "inheritable": _inheritable(),
            "extra_path": os.environ.get("ECHO_EXTRA") in sys.path}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(seen, f)
    print(f"echo stdout rank {rank}", flush=True)
    print(f"echo stderr rank {rank}", file=sys.stderr, flush=True)
    if code == "linger":  # SIGTERM: take a while to stop (a trainer's checkpoint), then say so
        def stop(*_):
            time.sleep(1.5)
            open(os.path.join(out, f"{rank}.done"), "w").close()
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
    if code in ("sleep", "linger"):
        time.sleep(600)
    if code == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return int(code) if code.lstrip("-").isdigit() else 0


if __name__ == "__main__":
    sys.exit(main())
