"""Opening a dataset with errors that name the flag, and checking it against a tokenizer
(shared by `domino train` and `domino eval`)."""

from __future__ import annotations

import os

import numpy as np

from domino.data.indexed_dataset import IndexedDataset, data_path, index_path
from domino.data.loss_mask import open_loss_mask
from domino.data.tokenizer import Tokenizer


def normalize_prefix(path: str) -> str:
    """Accept PREFIX, PREFIX.bin or PREFIX.idx."""
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def open_dataset(prefix: str, flag: str = "--data-path") -> IndexedDataset:
    """Open the dataset with errors that name the flag."""
    missing = [p for p in (data_path(prefix), index_path(prefix)) if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"{flag} {prefix}: {' and '.join(missing)} not found; create the "
                         f"dataset with `domino preprocess --output-prefix {prefix} ...`")
    ds = IndexedDataset(prefix)
    if ds.num_tokens == 0 or ds.num_documents == 0:
        raise ValueError(f"{flag} {prefix}: the dataset is empty (0 tokens); preprocess "
                         "some non-empty text into it")
    try:
        open_loss_mask(ds)  # a loss mask beside it must fit it: refused here, naming the flag
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"{flag} {prefix}: {err}") from None
    return ds


def check_tokenizer(ds: IndexedDataset, tokenizer: Tokenizer, flag: str = "--data-path") -> None:
    """The tokenizer must be the one the dataset was made with (or at least cover its ids)."""
    info = ds.tokenizer_info
    mine = tokenizer.describe()
    if info is not None:
        if info.get("vocab_hash") != mine["vocab_hash"] or info.get("vocab_size") != mine[
                "vocab_size"]:
            raise ValueError(
                f"{flag} {ds.prefix} was made with a {info.get('kind')} tokenizer of "
                f"{info.get('vocab_size')} tokens (hash {info.get('vocab_hash')}) but this run "
                f"uses a {mine['kind']} tokenizer of {mine['vocab_size']} tokens (hash "
                f"{mine['vocab_hash']}); pass the matching --tokenizer-type/--vocab-file/"
                "--merge-file or re-run `domino preprocess`")
        if mine.get("bos") and info.get("bos") != mine["bos"]:
            raise ValueError(
                f"{flag} {ds.prefix} was made without the BOS id(s) {mine['bos']} this tokenizer "
                "puts before every document (by a domino older than that rule), so it is not the "
                "text the model reads; re-run `domino preprocess` with this tokenizer")
        return
    # No sidecar (e.g. a dataset made by Megatron): the ids must at least fit the vocabulary.
    # Big files are spot-checked in 16 evenly spaced 1M-token chunks, not scanned whole.
    tokens = np.memmap(data_path(ds.prefix), dtype=ds.dtype, mode="r")
    chunk = 1 << 20
    starts = [0] if tokens.size <= 16 * chunk else np.linspace(0, tokens.size - chunk, 16)
    top = max((int(tokens[int(a):int(a) + chunk].max()) for a in starts), default=0)
    if top >= tokenizer.vocab_size:
        raise ValueError(f"{flag} {ds.prefix} holds token id {top}, outside the "
                         f"{tokenizer.vocab_size}-token vocabulary of the {tokenizer.name} "
                         "tokenizer; pass the tokenizer the data was made with")


def eod_of(ds: IndexedDataset, tokenizer: Tokenizer) -> int:
    info = ds.tokenizer_info
    return int(info["eod"]) if info and "eod" in info else tokenizer.eod
