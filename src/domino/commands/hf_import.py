"""``domino import HF_DIR OUT``: a ``transformers`` model folder of a family domino reads
(:data:`domino.checkpoint.families.FAMILIES`) as a domino checkpoint at any TP size, weights
only, plus an OUT/config.toml with the `domino train` settings that rebuild the model: ``domino
generate`` / ``eval`` / ``export`` use it as it is, and ``domino train --config OUT/config.toml
--load OUT --data-path ...`` fine-tunes it (a new run from its weights)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from domino.checkpoint import layout
from domino.checkpoint.hf_import import hf_file, import_hf
from domino.checkpoint.layout import CheckpointError, Meta
from domino.commands.convert import write_run_config
from domino.config import TransformerConfig
from domino.training import model_flags
from domino.training.finetune import FINE_TUNE  # (the same defaults as --finetune's)
from domino.utils import check_output_dir, removed_on_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="HF_DIR",
                        help="a transformers model folder: config.json, *.safetensors, tokenizer")
    parser.add_argument("output", metavar="OUT", help="run folder to write the checkpoint into")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="TP size of the checkpoint (it loads at any TP size either way)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT/checkpoints")




def train_settings(config: TransformerConfig, tokenizer_dir: Path, tp: int) -> dict[str, Any]:
    """`domino train` settings that fine-tune this model with this tokenizer at TP=``tp``
    (with sequence parallelism where MoE layers need it at TP > 1)."""
    return {**model_flags.train_settings(config), **FINE_TUNE, "tokenizer_type": "hf",
            "tokenizer_dir": str(tokenizer_dir.resolve()), "tensor_model_parallel_size": tp,
            "sequence_parallel": config.num_experts is not None and tp > 1}


def _fine_tune_line() -> str:
    s = FINE_TUNE
    return (f"lr {s['lr']:g} (cosine to {s['min_lr']:g}), {s['lr_warmup_iters']} warm-up steps "
            f"of {s['train_iters']}, weight decay {s['weight_decay']:g}, a "
            f"{s['sample_tokens']}-token sample at the end")


def run(ns: argparse.Namespace) -> int:
    folder, out, tp = Path(ns.source), Path(ns.output), ns.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size={tp} must be >= 1")
    if not hf_file(folder, "config.json").is_file():  # (hf_file: no link out is followed)
        raise ValueError(f"{folder} is not a transformers model folder (no config.json)")
    check_output_dir(out, "OUT")
    if (out / layout.CHECKPOINTS).exists():
        if not ns.force:
            raise ValueError(f"{out} already holds checkpoints; pass --force to replace them, "
                             "or another OUT")
        shutil.rmtree(out / layout.CHECKPOINTS)
    with removed_on_error(out):
        try:
            new = import_hf(folder, out, tp)
        except CheckpointError as err:
            raise ValueError(str(err)) from None
        meta = Meta.from_json(layout.read_json(new / layout.META, "checkpoint record"),
                              new / layout.META)
        settings = train_settings(TransformerConfig.from_dict(meta.config),
                                  new / layout.TOKENIZER_DIR, tp)
        write_run_config(out, settings, meta, tp, new)
    extra = json.loads((new / layout.META).read_text())["extra"]
    print(f"domino import: {folder} ({extra['architecture']}, {extra.get('dtype', 'float32')}) "
          f"-> {new} (TP={tp}, weights only)")
    print(f"tokenizer: {new / layout.TOKENIZER_DIR} (--tokenizer-dir takes it, {out} or "
          f"{folder}); tokenize fine-tuning data with `domino preprocess --tokenizer-type hf "
          f"--tokenizer-dir {out} ...`")
    print(f"fine-tune with `domino train --load {out} --finetune --data-path ...` (or "
          f"--config {out}/config.toml --load {out}); its settings for fine-tuning: "
          f"{_fine_tune_line()} (flags override them)")
    return 0
