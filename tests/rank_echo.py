"""A rank for the launcher's tests (``python -m rank_echo OUT CODE``): writes what it sees as a
process (its arguments, environment, working directory, session) to OUT/<RANK>.json,
prints a line to stdout and one to stderr, then exits with CODE (``sleep``: waits to be
stopped; ``kill``: ends itself with SIGKILL)."""

import json
import os
import signal
import sys
import time


def main() -> int:
    out, code = sys.argv[1], sys.argv[2]
    rank = os.environ["RANK"]
    seen = {"argv": sys.argv[1:], "argv0": os.path.basename(sys.argv[0]), "name": __name__,
            "rank": rank, "marker": os.environ.get("ECHO_MARKER"), "cwd": os.getcwd(),
            "session_leader": os.getsid(0) == os.getpid(), "pid": os.getpid()}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(seen, f)
    print(f"echo stdout rank {rank}", flush=True)
    print(f"echo stderr rank {rank}", file=sys.stderr, flush=True)
    if code == "sleep":
        time.sleep(600)
    if code == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return int(code) if code.lstrip("-").isdigit() else 0


if __name__ == "__main__":
    sys.exit(main())
