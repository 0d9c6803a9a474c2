"""Hugging Face ``transformers`` configs, each by its family (one module each, listed in
:data:`domino.checkpoint.families.FAMILIES`; a ``model_type`` none reads is refused naming what
stands in the way): our config from a ``config.json``, and the ``config.json`` of a model of
ours.

Written from the formats' documented ``config.json`` keys, so neither direction needs
``transformers`` installed; the weights are :mod:`domino.checkpoint.hf`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from domino.checkpoint.families import family_named, readable, unknown
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

ARCHITECTURES = readable()


def hf_config(config: TransformerConfig, arch: str, tokens: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of the model exported as ``arch`` (a model_type), with ``tokens``:
    its token keys (``bos_token_id``, ``eos_token_id`` (an id or a list), ``pad_token_id``)."""
    family = family_named(arch)
    if family is None or family.write is None:
        raise ValueError(f"{arch!r} is not a family domino writes ({', '.join(ARCHITECTURES)})")
    return {**family.write(config), **tokens}


def config_from_hf(raw: dict[str, Any], path: str | Path = "config.json",
                   ) -> tuple[str, TransformerConfig, int | None]:
    """(architecture, our config, end-of-text id) of a ``config.json`` read from ``path``;
    ValueError naming the file and the key, and what is wrong with it: missing, null or of the
    wrong type or range, or a setting we cannot represent."""
    keys = HFKeys(raw, path)
    arch = keys.text("model_type", rule=f"the architecture, one of {', '.join(ARCHITECTURES)}")
    eos = raw.get("eos_token_id")
    eod = eos[0] if isinstance(eos, list) and eos else None if isinstance(eos, list) else eos
    if eod is not None and (not isinstance(eod, int) or isinstance(eod, bool) or eod < 0):
        keys.wrong("eos_token_id", eos, "a token id (an integer >= 0), a list of them, or null")
    family = family_named(arch)
    if family is None or family.read is None:  # (named: what is missing, or the family it is)
        unknown.refuse(keys, arch, family.lacks(arch) if family and family.lacks else ())
    return arch, family.read(keys), eod
