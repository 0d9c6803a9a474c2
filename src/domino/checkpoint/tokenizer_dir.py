"""The tokenizer a ``--tokenizer-dir`` names (``domino train``, ``domino preprocess``): a folder
of its files, a checkpoint's own copy (a run, checkpoints or step folder: its latest
checkpoint's ``tokenizer/``, as ``domino import`` writes one), or for ``hf`` a ``transformers``
model folder (read as ``domino import`` reads it)."""

from __future__ import annotations

import os
from pathlib import Path

from domino.checkpoint import layout
from domino.checkpoint.layout import CheckpointError
from domino.checkpoint.store import load_tokenizer
from domino.data import tokenizer as tk
from domino.data.tokenizer import Tokenizer, build_tokenizer

FILES = {"hf": (tk.HF_TOKENIZER_FILE, tk.HF_SIDECAR), "bpe": (tk.VOCAB_FILE, tk.MERGES_FILE)}


def find_tokenizer(kind: str, where: str | os.PathLike,
                   flag: str = "--tokenizer-dir") -> Tokenizer:
    """The ``kind`` ("hf" or "bpe") tokenizer ``where`` holds or names; ValueError naming what
    was looked for where, and what to pass."""
    d, names = Path(where), FILES[kind]
    if not d.is_dir():
        raise ValueError(f"{flag} {d} is not a folder; pass the folder of the tokenizer files, "
                         "or a run folder (e.g. `domino import`'s OUT)")
    if all((d / n).is_file() for n in names):
        return build_tokenizer(kind, tokenizer_dir=d)
    if any((d / n).exists() for n in (layout.META, layout.CHECKPOINTS, layout.LATEST)):
        return _from_checkpoint(kind, d, flag)
    if kind == "hf" and (d / "config.json").is_file():
        from domino.checkpoint.hf_import import hf_folder_tokenizer

        return hf_folder_tokenizer(d)
    model = " or a transformers model folder (config.json + tokenizer.json)" \
        if kind == "hf" else ""
    raise ValueError(
        f"{flag} {d}: no {kind} tokenizer found: looked for {' + '.join(names)} in {d}, for "
        f"a checkpoint there ({layout.CHECKPOINTS}/{layout.LATEST}, or {layout.META} of a "
        f"step folder){model}; pass a run folder (e.g. `domino import`'s OUT), a checkpoint's "
        f"{layout.TOKENIZER_DIR}/ folder{model.replace(' or ', ', or ')}")


def _from_checkpoint(kind: str, d: Path, flag: str) -> Tokenizer:
    """The tokenizer of the checkpoint ``d`` means (its latest, for a run folder)."""
    try:
        step_dir, meta, _ = layout.open_checkpoint(d, hashes=False)
        found = (meta.tokenizer or {}).get("kind")
        if found != kind:
            raise ValueError(f"{flag} {d}: the checkpoint {step_dir} holds a {found} tokenizer, "
                             f"not {kind}; pass --tokenizer-type {found}")
        return load_tokenizer(step_dir, meta)
    except CheckpointError as err:
        raise ValueError(f"{flag} {d}: {err}") from None
