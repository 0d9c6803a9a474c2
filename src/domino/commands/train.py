"""`domino train`: validate, print and save the config, then run the ranks.

With no arguments it trains the built-in default: a small GPT on the Python standard library's
own source at TP=2 with Domino, on 2 local CPU processes, in a few minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from domino.training import arguments, finetune
from domino.training.prepare import default_run_dir, prepare_run, under_torchrun

EPILOG = """examples:
  domino train                                   # built-in default (stdlib corpus, TP=2, CPU)
  domino train --config run.toml --train-iters 1000
  domino train --load runs/imported --finetune --data-path data/chats --pack-documents
  domino train --data-path data/my_text_document --tokenizer-type bpe \\
      --vocab-file vocab.json --merge-file merges.txt --nproc 4 --tensor-model-parallel-size 2
  torchrun --nproc-per-node 8 -m domino.cli train --tensor-model-parallel-size 4 ...
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arguments.add_arguments(parser)
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def run(ns: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    notes: list[str] = []
    if finetune.wanted(ns):
        args, notes = finetune.resolve(ns)  # the checkpoint's model, fine-tuning defaults
    else:
        args = arguments.resolve_args(ns)
    torchrun = under_torchrun()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    run_dir = None if torchrun else Path(args.save) if args.save else default_run_dir()
    if torchrun and rank0 and "--nproc" in sys.argv:
        print("domino train: under torchrun the world comes from torchrun; --nproc is ignored",
              file=sys.stderr)
    if rank0:
        for line in notes:
            print(f"domino train: {line}")
    run = prepare_run(args, progress=rank0, run_dir=run_dir)  # raises before any spawn
    from domino.training.launch import launch_local, write_config

    if rank0:
        where = f"{args.save}/config.toml" if args.save else "config.toml in the run folder"
        print(f"domino train: effective configuration (saved to {where})")
        print(arguments.to_toml(args).split("\n", 1)[1].strip())
        sys.stdout.flush()
    if torchrun:
        from domino.training.worker import exit_now, run_worker

        exit_now(run_worker(run))  # as a locally launched rank ends (see training.worker.exit_now)
    assert run_dir is not None
    config_path = write_config(run_dir, args)
    code = launch_local(config_path, args.nproc or 1, args.device or "cpu", args.emulate_link,
                        args.emulate_hosts, timeout_s=args.distributed_timeout_minutes * 60.0)
    if code == 0:
        print(f"domino train: done in {time.perf_counter() - t0:.1f} s (including start-up); "
              f"outputs in {run_dir}")
    return code
