"""One rank of ``domino generate`` / ``domino eval``: ``python -m domino.inference.worker
SPEC.json`` (started by :func:`domino.inference.session.launch`)."""

from __future__ import annotations

import json
import sys

from domino.inference.session import run_rank

if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m domino.inference.worker SPEC.json", file=sys.stderr)
        sys.exit(2)
    with open(sys.argv[1], encoding="utf-8") as f:
        sys.exit(run_rank(json.load(f)))
