"""Data layer: tokenizers, MMIDIDX indexed datasets, preprocessing and GPT samples.

The torch-dependent GPT dataset is imported lazily so tokenizing (and its spawned
workers) never pays for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from domino.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype
from domino.data.preprocess import PreprocessStats, preprocess, stdlib_corpus_files
from domino.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
)

if TYPE_CHECKING:
    from domino.data.gpt_dataset import GPTDataset, build_train_valid_datasets, split_documents

_LAZY = {"GPTDataset", "build_train_valid_datasets", "split_documents"}

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "PreprocessStats",
    "Tokenizer",
    "best_dtype",
    "build_tokenizer",
    "build_train_valid_datasets",
    "preprocess",
    "split_documents",
    "stdlib_corpus_files",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from domino.data import gpt_dataset

        return getattr(gpt_dataset, name)
    raise AttributeError(f"module 'domino.data' has no attribute {name!r}")
