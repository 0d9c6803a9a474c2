"""A Hugging Face model folder's tokens, as ``transformers`` uses them: its tokenizer with the
BOS/EOS its post-processor adds, every end-of-sequence id that stops generation, and the token
metadata (``config.json``'s token ids, ``generation_config.json``, ``tokenizer_config.json``,
``special_tokens_map.json``, ``chat_template.jinja``) that ``domino import`` keeps in the run's
``tokenizer/domino.json`` and ``domino export`` writes back unchanged.

The rule for BOS/EOS is ``transformers``' (5.x): a ``tokenizer.json``'s own post-processor
decides (``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token`` are then not read);
a folder with GPT-2's ``vocab.json`` + ``merges.txt`` instead gets the post-processor
``GPT2Tokenizer`` builds from ``add_bos_token`` / ``add_eos_token`` (both false by default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from domino.checkpoint import layout
from domino.config import TransformerConfig
from domino.data.tokenizer import EOD_TOKEN, BPETokenizer, HFTokenizer, Tokenizer

# config.json's token keys, written back as they were read.
CONFIG_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
JSON_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
TEXT_FILES = ("chat_template.jinja",)


# Every file of a model folder read here (each checked by ``hf_import.hf_file`` first).
NAMES = ("tokenizer.json", "vocab.json", "merges.txt", *JSON_FILES, *TEXT_FILES)


def read_tokenizer(folder: Path, paths: dict[str, Path], config: TransformerConfig,
                   eod: int | None, raw: dict[str, Any] | None = None) -> HFTokenizer:
    """The folder's tokenizer (tokenizer.json, or GPT-2's vocab.json + merges.txt) with its
    token metadata; ``paths``: each of :data:`NAMES` in the folder, ``eod``: config.json's
    (first) eos_token_id, ``raw``: config.json."""
    rust, built = _rust(folder, paths)
    files = _metadata(paths)
    if built:
        rust.post_processor = _gpt2_template(rust, files.get("tokenizer_config.json", {}),
                                             paths["tokenizer_config.json"])
    raw = raw or {}
    stop = (_ids(files.get("generation_config.json", {}), "eos_token_id",
                 paths["generation_config.json"])
            or _ids(raw, "eos_token_id", folder / "config.json"))
    if eod is None:
        eod = stop[0] if stop else rust.token_to_id(EOD_TOKEN)
    if eod is None:
        raise ValueError(f"{folder}/config.json sets no eos_token_id and the tokenizer has no "
                         f"{EOD_TOKEN}; add eos_token_id to config.json")
    size = rust.get_vocab_size(with_added_tokens=True)
    if size > config.vocab_size:
        raise ValueError(f"{folder}: the tokenizer has {size} tokens but the model's vocabulary "
                         f"is {config.vocab_size}")
    hf = {**files, "config.json": {k: raw[k] for k in CONFIG_KEYS if k in raw}}
    return HFTokenizer(rust, eod, config.vocab_size, stop, hf)


def _rust(folder: Path, paths: dict[str, Path]) -> tuple[Any, bool]:
    """The folder's ``tokenizers.Tokenizer``, and whether it was built from vocab + merges."""
    from tokenizers import Tokenizer as RustTokenizer

    tokenizer_json, vocab, merges = (paths[n] for n in ("tokenizer.json", "vocab.json",
                                                        "merges.txt"))
    if tokenizer_json.is_file():
        try:
            return RustTokenizer.from_file(str(tokenizer_json)), False
        except Exception as err:
            raise ValueError(f"{tokenizer_json}: not a tokenizers file ({err})") from None
    if vocab.is_file() and merges.is_file():
        return BPETokenizer.from_files(vocab, merges)._tok, True
    raise ValueError(f"{folder} has no tokenizer (tokenizer.json, or vocab.json + "
                     "merges.txt); generate, eval and training need one")


def _metadata(paths: dict[str, Path]) -> dict[str, Any]:
    """The folder's token files that exist: JSON ones as objects, text ones as text."""
    out: dict[str, Any] = {}
    for name in JSON_FILES + TEXT_FILES:
        path = paths[name]
        if not path.is_file():
            continue
        if name in TEXT_FILES:
            out[name] = path.read_text(encoding="utf-8")
        else:
            out[name] = layout.read_json(path, name.removesuffix(".json").replace("_", " "),
                                         follow=True)
    return out


def _ids(raw: dict[str, Any], key: str, path: Path) -> list[int]:
    """``raw[key]`` as a list of token ids (an id, a list of them, or null/absent: none)."""
    value = raw.get(key)
    items = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ValueError(f"{path}: {key}={json.dumps(value)} is not a token id (an integer "
                         ">= 0), a list of them, or null; correct it in that file")
    return list(items)


def _token_text(value: Any) -> str | None:
    """A tokenizer_config.json token: a string, or an AddedToken's JSON (its ``content``)."""
    return value.get("content") if isinstance(value, dict) else value


def _gpt2_template(rust: Any, tokenizer_config: dict[str, Any], path: Path) -> Any:
    """The post-processor ``transformers`` gives a vocab + merges tokenizer: BOS before and EOS
    after each text where ``add_bos_token`` / ``add_eos_token`` say (None: neither)."""
    from tokenizers import processors

    parts: dict[str, str | None] = {}
    for side in ("bos", "eos"):  # (GPT2Tokenizer's default for both: <|endoftext|>)
        token = _token_text(tokenizer_config.get(f"{side}_token", EOD_TOKEN))
        parts[side] = token if tokenizer_config.get(f"add_{side}_token", False) else None
    special = []
    for side, token in parts.items():
        if token is None:
            continue
        if rust.token_to_id(token) is None:
            raise ValueError(f"{path}: add_{side}_token is true but {side}_token {token!r} is "
                             "not a token of vocab.json; name a token of the vocabulary")
        special.append((token, rust.token_to_id(token)))
    if not special:
        return None
    bos, eos = parts["bos"], parts["eos"]

    def around(seq: str, kind: int) -> str:
        return (f"{bos}:{kind} " if bos else "") + f"${seq}:{kind}" + (
            f" {eos}:{kind}" if eos else "")

    return processors.TemplateProcessing(single=around("A", 0),
                                         pair=f"{around('A', 0)} {around('B', 1)}",
                                         special_tokens=special)


# ---- export -----------------------------------------------------------------------------------


def config_tokens(tokenizer: Tokenizer) -> dict[str, Any]:
    """config.json's token keys: an imported model's own, else BOS = EOS = EOD."""
    kept = getattr(tokenizer, "hf", {}).get("config.json")
    if kept:
        return dict(kept)
    return {"bos_token_id": tokenizer.eod, "eos_token_id": tokenizer.eod}


def write_token_files(out: Path, tokenizer: Tokenizer, rust: Any, max_positions: int) -> None:
    """generation_config.json, tokenizer_config.json and special_tokens_map.json (and a chat
    template) into ``out``: an imported model's own files as they were; for a model trained
    here, or a file the imported folder lacked, BOS and EOS from config.json's token ids."""
    kept: dict[str, Any] = dict(getattr(tokenizer, "hf", {}))
    tokens = config_tokens(tokenizer)
    if "generation_config.json" not in kept:
        kept["generation_config.json"] = {k: tokens[k] for k in CONFIG_KEYS if k in tokens}
    if "tokenizer_config.json" not in kept:
        bos, eos = (_first(tokens.get(k)) for k in ("bos_token_id", "eos_token_id"))
        text = {side: rust.id_to_token(i) if i is not None else None
                for side, i in (("bos_token", bos), ("eos_token", eos))}
        kept["tokenizer_config.json"] = {
            "tokenizer_class": "PreTrainedTokenizerFast", **text, "unk_token": None,
            "add_prefix_space": False, "clean_up_tokenization_spaces": False,
            "model_max_length": max_positions}
        kept.setdefault("special_tokens_map.json",
                        {k: v for k, v in text.items() if v is not None})
    for name in JSON_FILES:
        if name in kept:
            (out / name).write_text(json.dumps(kept[name], indent=2) + "\n", encoding="utf-8")
    for name in TEXT_FILES:
        if name in kept:
            (out / name).write_text(kept[name], encoding="utf-8")


def _first(value: Any) -> int | None:
    return value[0] if isinstance(value, list) and value else value if isinstance(
        value, int) else None
