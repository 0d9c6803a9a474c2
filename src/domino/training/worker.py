"""Entry point of one locally launched rank: ``python -m domino.training.worker CONFIG.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from domino.training.arguments import TrainArgs
from domino.training.launch import run_worker


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m domino.training.worker RUN/config.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    args = TrainArgs(**json.loads(path.read_text(encoding="utf-8")))
    return run_worker(args, path.parent)


if __name__ == "__main__":
    sys.exit(main())
