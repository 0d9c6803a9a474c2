"""``domino eval RUN_DIR --data-path PREFIX``: loss and perplexity of a saved model on one split
of a dataset (or, with ``--eval-iters``, of a weighted blend), at any TP x DP size.

By default the whole split once, in the sample order of the run's seed. With ``--eval-iters N``
it reads, like training's validation, the first N global batches (``--global-batch-size``,
default the run's), so the numbers equal the ones the run logged.
"""

from __future__ import annotations

import argparse

from domino.checkpoint.layout import open_checkpoint
from domino.config import TransformerConfig
from domino.data.blend import parse_blend
from domino.data.checks import open_dataset
from domino.inference.session import add_launch_arguments, launch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--data-path", required=True, metavar="PREFIX", nargs="+",
                        help="dataset prefix (PREFIX.bin/.idx, made with the model's tokenizer), "
                        "or a blend of weight/prefix pairs as in training (needs --eval-iters)")
    parser.add_argument("--split", default=None,
                        help="train/valid/test document weights [default: the run's, or 98,2,0; "
                        "the whole dataset after a run with --train-data-path]")
    parser.add_argument("--split-name", choices=("train", "valid", "test"), default="valid")
    parser.add_argument("--eval-iters", type=int, default=None,
                        help="only the first N global batches (as training's validation)")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="with --eval-iters [default: the run's]")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="samples per forward on each DP rank [default: the run's, or 8]")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="sample length [default: the run's]")
    parser.add_argument("--seed", type=int, default=None,
                        help="sample order [default: the run's]")


def run(ns: argparse.Namespace) -> int:
    for name in ("eval_iters", "global_batch_size", "micro_batch_size", "seq_length"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be >= 1")
    blend = parse_blend(ns.data_path)
    if len(blend) > 1 and ns.eval_iters is None:
        raise ValueError(f"--data-path is a {blend.describe()}: a blend is evaluated as "
                         "training's validation reads it, so pass --eval-iters N (the whole split "
                         "once has no mix to keep); or evaluate each dataset alone")
    for prefix in blend.prefixes:
        open_dataset(prefix)  # a missing or empty dataset fails here
    if ns.seq_length is not None:
        _check_positions(ns.checkpoint, ns.seq_length)
    spec = {k: getattr(ns, k) for k in ("data_path", "split", "split_name", "eval_iters",
                                         "global_batch_size", "micro_batch_size", "seq_length",
                                         "seed")}
    return launch("eval", ns, spec)


def _check_positions(checkpoint: str, seq_length: int) -> None:
    """A --seq-length the model has positions for (a learned table has max_position_embeddings
    rows; RoPE has no table)."""
    _, meta, _ = open_checkpoint(checkpoint, hashes=False)  # (launch hashes it)
    config = TransformerConfig.from_dict(meta.config)
    table = config.max_position_embeddings
    if config.position_embedding_type == "learned_absolute" and seq_length > table:
        raise ValueError(f"--seq-length={seq_length} is longer than the checkpoint's "
                         f"max_position_embeddings={table} (its learned position table has no "
                         f"rows past {table}); pass --seq-length {table} or less, or leave it "
                         f"out (the run's {config.seq_length})")
