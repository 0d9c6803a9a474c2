"""The per-token loss mask beside a token dataset: ``PREFIX_loss_mask.bin/.idx``, a Megatron
indexed dataset of uint8 (1 = the token counts for the loss) with the tokens' document lengths,
as ``domino preprocess --format chat`` writes it."""

from __future__ import annotations

import os

import numpy as np

from domino.data.indexed_dataset import IndexedDataset, data_path, index_path

SUFFIX = "_loss_mask"


def loss_mask_prefix(prefix: str | os.PathLike) -> str:
    """Where the loss mask of the dataset at ``prefix`` lives."""
    return os.fspath(prefix) + SUFFIX


def open_loss_mask(tokens: IndexedDataset) -> IndexedDataset | None:
    """The loss mask beside ``tokens`` (None when there is none); ValueError naming both files
    when it does not fit them (another dtype, other document lengths)."""
    prefix = loss_mask_prefix(tokens.prefix)
    if not (os.path.isfile(data_path(prefix)) or os.path.isfile(index_path(prefix))):
        return None
    mask = IndexedDataset(prefix)
    fix = ("re-run `domino preprocess --format chat` to write both, or remove the "
           f"{prefix}.bin/.idx left from another dataset")
    if mask.dtype != np.uint8:
        raise ValueError(f"{index_path(prefix)}: a loss mask holds uint8, not {mask.dtype}; {fix}")
    same = (np.array_equal(mask.sizes, tokens.sizes)
            and np.array_equal(mask.doc_idx, tokens.doc_idx))
    if not same:
        raise ValueError(f"{index_path(prefix)} does not fit {index_path(tokens.prefix)}: the "
                         f"mask has {mask.num_documents} documents of {mask.num_tokens} tokens, "
                         f"the tokens {tokens.num_documents} of {tokens.num_tokens} (or other "
                         f"lengths); {fix}")
    return mask
