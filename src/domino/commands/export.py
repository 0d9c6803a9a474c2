"""``domino export --format hf RUN_DIR OUT``: a checkpoint as a ``transformers`` model folder of
the first family that expresses the model (:data:`domino.checkpoint.families.FAMILIES`), in the
model's own dtype unless ``--dtype`` says otherwise."""

from __future__ import annotations

import argparse
from pathlib import Path

from domino.checkpoint.hf_export import DTYPES, export_hf, model_dtype
from domino.checkpoint.layout import open_checkpoint
from domino.utils import check_output_dir, removed_on_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("hf",), required=True,
                        help="hf: a Hugging Face transformers model folder")
    parser.add_argument("source", metavar="RUN_DIR",
                        help="run, checkpoints or step folder (default: its latest checkpoint)")
    parser.add_argument("output", metavar="OUT", help="folder to write (created; must be empty)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="dtype of the written weights; auto: the model's own (an imported "
                        "model's as it came, e.g. bfloat16; a trained run's float32 master "
                        "weights, --bf16 or not) [default: auto]")


def run(ns: argparse.Namespace) -> int:
    out = Path(ns.output)
    check_output_dir(out, "OUT")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"OUT {out} is not empty; pass a new or empty folder")
    step_dir, meta, _ = open_checkpoint(ns.source, hashes=True)
    dtype = model_dtype(meta) if ns.dtype == "auto" else ns.dtype
    with removed_on_error(out):
        arch = export_hf(step_dir, meta, out, dtype)
    print(f"domino export: {step_dir} -> {out} ({arch}, {dtype}, {len(meta.tensors)} tensors); "
          "load it with transformers.AutoModelForCausalLM.from_pretrained")
    return 0
