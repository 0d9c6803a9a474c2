"""``domino train --load RUN --finetune``: a new run from RUN's weights only (Megatron's
meaning: not its optimizer, step, data position, scheduler or RNG), whose model and tokenizer
come from RUN's checkpoint, with fine-tuning defaults under the user's settings.

Precedence: TrainArgs' defaults < the checkpoint's model and tokenizer and :data:`FINE_TUNE`
< ``--config`` < flags. A config or flag that contradicts the checkpoint's model is then
refused by the resume checks (``resume.check_compatible``) before any process starts."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from domino.checkpoint import layout
from domino.checkpoint.layout import CheckpointError, open_checkpoint
from domino.config import TransformerConfig
from domino.training import arguments, model_flags

# Fine-tuning, not pre-training from scratch (TrainArgs' defaults): a learning rate about a
# hundredth of theirs, a short warm-up and run, no weight decay pulling the weights towards
# zero, a tenth of the documents held out (fine-tuning sets are small: 98,2,0 would leave a
# few conversations to evaluate on) and a short sample at the end. `domino import` writes
# these into config.toml too.
FINE_TUNE: dict[str, Any] = {"lr": 2e-5, "min_lr": 2e-6, "lr_warmup_iters": 10,
                             "train_iters": 100, "weight_decay": 0.0, "split": "90,10,0",
                             "sample_tokens": 32}

# How the start-up line names each default.
_SHOWN = {"lr": "--lr {lr:g}", "min_lr": "--min-lr {min_lr:g}",
          "lr_warmup_iters": "--lr-warmup-iters {lr_warmup_iters}",
          "train_iters": "--train-iters {train_iters}",
          "weight_decay": "--weight-decay {weight_decay:g}",
          "split": "--split {split} (train,valid,test shares of the documents: {valid} held "
                   "out for evaluation)",
          "sample_tokens": "--sample-tokens {sample_tokens}"}


def checkpoint_settings(load: str) -> dict[str, Any]:
    """The settings that rebuild the ``--load`` checkpoint's model with its own tokenizer."""
    try:
        step_dir, meta, _ = open_checkpoint(load, hashes=False)  # (prepare_run hashes it)
        config = TransformerConfig.from_dict(meta.config)
    except CheckpointError as err:
        raise ValueError(f"--load {load}: {err}") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"--load {load}: its model config is unusable ({err})") from None
    kind = (meta.tokenizer or {}).get("kind")
    if kind not in ("byte", "bpe", "hf"):
        raise ValueError(f"--load {step_dir}: no tokenizer record ({meta.tokenizer!r}), so "
                         "--finetune cannot take the tokenizer from it; pass --tokenizer-type "
                         "and --tokenizer-dir")
    tokenizer: dict[str, Any] = {"tokenizer_type": kind, "vocab_file": None, "merge_file": None,
                                 "tokenizer_dir": None}
    if kind != "byte":
        tokenizer["tokenizer_dir"] = str((step_dir / layout.TOKENIZER_DIR).resolve())
    return {**model_flags.train_settings(config), **tokenizer}


def wanted(ns: argparse.Namespace) -> bool:
    """``--finetune`` is on: given as a flag, else in the ``--config`` file."""
    given = vars(ns)
    if "finetune" in given:
        return bool(given["finetune"])
    return "config" in given and bool(arguments.load_toml(given["config"]).get("finetune"))


def resolve(ns: argparse.Namespace) -> tuple[arguments.TrainArgs, list[str]]:
    """The run's settings with ``--finetune`` (the checkpoint's model and tokenizer, then
    :data:`FINE_TUNE`, under ``--config`` and flags) and the start-up lines saying so."""
    given = dict(vars(ns))
    toml = arguments.load_toml(given["config"]) if "config" in given else {}
    load = given.get("load", toml.get("load"))
    if not load:
        raise ValueError("--finetune starts from a model's weights: pass --load RUN (a run or "
                         "checkpoint folder, e.g. one `domino import` wrote)")
    own = set(given) | set(toml)
    base = {**checkpoint_settings(load), **FINE_TUNE}
    args = arguments.resolve_args(ns, base=base)
    return args, _lines(args, own)


def _lines(args: arguments.TrainArgs, own: set[str]) -> list[str]:
    taken = [n for n in FINE_TUNE if n not in own]
    lines = [f"--finetune: the model and tokenizer of {args.load}, its weights only (the "
             "optimizer, step, data position, learning-rate schedule and RNG start afresh: "
             "step 0)"]
    if taken:
        values = {n: getattr(args, n) for n in FINE_TUNE}
        shown = [_SHOWN[n].format(valid=_valid_share(args.split), **values) for n in taken]
        lines.append("fine-tuning defaults (docs/finetune.md; flags or --config override "
                     "them): " + ", ".join(shown))
    return lines


def _valid_share(split: str) -> str:
    """The share of documents ``split`` holds out for validation (e.g. "10%")."""
    try:
        shares = [float(x) for x in re.split(r"[,/]", split)]
    except ValueError:
        return "?"  # (the data checks name the malformed --split)
    return f"{shares[1] / sum(shares):.0%}" if len(shares) > 1 and sum(shares) > 0 else "none"



def resume_toml(args: arguments.TrainArgs) -> str:
    """The fine-tune's config.toml: its settings with ``finetune = false`` and no ``load``, so
    that ``--config RUN/config.toml --load RUN`` resumes the fine-tune (its optimizer, step and
    data position) instead of starting over from the base; a comment names the base."""
    text = arguments.to_toml(dataclasses.replace(args, finetune=False, load=None))
    return (f"# fine-tuned (--finetune) from the weights of {args.load}\n"
            f"# resume it with: domino train --config THIS_FILE --load RUN --save RUN\n" + text)
