"""``domino convert RUN_DIR OUT --tensor-model-parallel-size N``: a resharded copy of a
checkpoint (N=1: one consolidated file set), optimizer state included, and an OUT/config.toml
that rebuilds the run's model (``domino train --config OUT/config.toml --load OUT``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from domino.checkpoint import layout
from domino.checkpoint.layout import Meta, open_checkpoint
from domino.checkpoint.reshard import reshard
from domino.utils import check_output_dir, removed_on_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="RUN_DIR",
                        help="run, checkpoints or step folder (default: its latest checkpoint)")
    parser.add_argument("output", metavar="OUT", help="run folder to write the copy into")
    parser.add_argument("--tensor-model-parallel-size", type=int, required=True,
                        help="TP size of the copy (1: one consolidated file set)")
    parser.add_argument("--force", action="store_true",
                        help="replace a checkpoint of the same step already in OUT")


def run(ns: argparse.Namespace) -> int:
    tp = ns.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size={tp} must be >= 1")
    out = Path(ns.output)
    check_output_dir(out, "OUT")
    step_dir, meta, _ = open_checkpoint(ns.source, hashes=True)
    if out.resolve() == step_dir.parent.parent.resolve():
        raise ValueError(f"OUT {out} is the source run; write the copy elsewhere")
    target = out / layout.CHECKPOINTS / step_dir.name
    if target.exists() and not ns.force:
        raise ValueError(f"{target} exists; pass --force to replace it, or another OUT")
    with removed_on_error(out):
        new = reshard(step_dir, meta, out, tp)
        write_run_config(out, meta.args, meta, tp, new)
    size = sum(f.stat().st_size for f in new.rglob("*") if f.is_file())
    print(f"domino convert: {step_dir} (TP={meta.layout['tp']}) -> {new} (TP={tp}), "
          f"{len(meta.tensors)} tensors, {size / 2**20:.1f} MiB")
    return 0


def write_run_config(out: Path, settings: dict[str, Any] | None, meta: Meta, tp: int,
                     step_dir: Path) -> None:
    """``OUT/config.toml`` with the checkpoint's settings (its tokenizer: the copy in
    ``step_dir``), so ``domino train --config OUT/config.toml --load OUT`` builds the same
    model."""
    if settings is None:
        return
    from domino.training.arguments import TrainArgs, to_toml

    values = {k: v for k, v in settings.items() if k in TrainArgs.__dataclass_fields__}
    values.update(tensor_model_parallel_size=tp, load=None, save=None, overwrite=False)
    if (meta.tokenizer or {}).get("kind") == "bpe":
        values.update(tokenizer_dir=str((step_dir / layout.TOKENIZER_DIR).resolve()),
                      vocab_file=None, merge_file=None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(to_toml(TrainArgs(**values)), encoding="utf-8")
