"""GPT pre-training samples: fixed-length windows over a seeded, shuffled document stream."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from domino.data.indexed_dataset import IndexedDataset
from domino.data.loss_mask import open_loss_mask

SPLIT_NAMES = ("train", "valid", "test")


def split_documents(
    num_docs: int,
    splits: str | Sequence[float] = "98,2,0",
    required: Sequence[bool] | None = None,
) -> list[tuple[int, int]]:
    """Cut `num_docs` documents into contiguous [start, end) train/valid/test ranges.

    `splits` are relative weights ("969,30,1", "98/2/0" or a sequence; missing ones are 0).
    A split is required when its weight is > 0, unless `required` says otherwise; a required
    split that gets no documents raises ValueError.
    """
    text = splits if isinstance(splits, str) else ",".join(map(str, splits))
    try:
        weights = [float(w) for w in re.split(r"[,/]", text)]
    except ValueError:
        raise ValueError(f"split {text!r} must be comma-separated numbers, e.g. '98,2,0'") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split {text!r} needs 1-3 non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    bounds = np.rint(np.cumsum(weights) / sum(weights) * num_docs).astype(np.int64)
    bounds[-1] = num_docs  # rounding must never drop or invent documents
    starts = [0, int(bounds[0]), int(bounds[1])]
    ranges = [(s, max(s, int(e))) for s, e in zip(starts, bounds, strict=True)]
    need = [w > 0 for w in weights] if required is None else list(required)
    for name, (s, e), needed in zip(SPLIT_NAMES, ranges, need, strict=False):
        if needed and e <= s:
            raise ValueError(
                f"the {name} split is empty: the dataset has {num_docs} document(s) and split "
                f"{text!r} gives {name} none; add data or change --split"
            )
    return ranges


class GPTDataset(Dataset):
    """Samples of `seq_length` inputs (+1 for labels) from a document-shuffled token stream.

    Each epoch concatenates the split's documents in a fresh seeded order; sample i covers
    stream tokens [i*s, (i+1)*s] so consecutive samples share one boundary token, as in
    Megatron. Sample order is then shuffled by the seed. Nothing depends on data-parallel
    rank or size: shard by global sample index.

    `split` is a (start_doc, end_doc) tuple, an array of document indices, or None (all).
    `loss_mask`: the per-token mask dataset (``"auto"``: ``PREFIX_loss_mask`` beside the
    tokens when it exists); the mask of token t+1 decides whether predicting it counts.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        seq_length: int,
        num_samples: int | None = None,
        *,
        epochs: int | None = None,
        seed: int = 1234,
        eod_token: int,
        split: tuple[int, int] | npt.ArrayLike | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        create_attention_mask: bool = True,
        loss_mask: IndexedDataset | None | str = "auto",
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if (num_samples is None) == (epochs is None):
            raise ValueError("pass exactly one of num_samples or epochs")
        self.indexed_dataset = indexed_dataset
        self.loss_mask = open_loss_mask(indexed_dataset) if loss_mask == "auto" else loss_mask
        self.seq_length = seq_length
        self.seed = seed
        self.eod_token = eod_token
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.eod_mask_loss = eod_mask_loss
        self.create_attention_mask = create_attention_mask

        n_docs = indexed_dataset.num_documents
        if split is None:
            documents = np.arange(n_docs, dtype=np.int64)
        elif isinstance(split, tuple) and len(split) == 2:
            start, end = int(split[0]), int(split[1])
            if not 0 <= start <= end <= n_docs:
                raise ValueError(f"split ({start}, {end}) outside the dataset's {n_docs} documents")
            documents = np.arange(start, end, dtype=np.int64)
        else:
            documents = np.asarray(split, dtype=np.int64).reshape(-1)
            if documents.size and (documents.min() < 0 or documents.max() >= n_docs):
                raise ValueError(f"document indices must lie in [0, {n_docs})")
        self.documents = documents

        doc_idx = np.asarray(indexed_dataset.doc_idx, dtype=np.int64)
        sizes = np.asarray(indexed_dataset.sizes, dtype=np.int64)
        first, count = doc_idx[documents], doc_idx[documents + 1] - doc_idx[documents]
        self.tokens_per_epoch = int(sizes[_expand(first, count)].sum())
        need = seq_length + 1
        if self.tokens_per_epoch < need:
            raise ValueError(
                f"the {len(documents)} selected document(s) hold {self.tokens_per_epoch} tokens, "
                f"fewer than one sample needs (seq_length + 1 = {need}); add data or shorten "
                "--seq-length"
            )
        if num_samples is None:
            assert epochs is not None
            num_samples = (epochs * self.tokens_per_epoch - 1) // seq_length
        self.num_samples = int(num_samples)
        n_epochs = max(1, -(-(self.num_samples * seq_length + 1) // self.tokens_per_epoch))
        self.epochs = n_epochs

        rng = np.random.default_rng(seed)
        # Independent document order per epoch, drawn in sequence so it is fixed by the seed.
        order = np.concatenate([rng.permutation(documents) for _ in range(n_epochs)])
        self.document_order = order  # the stream, in documents; public for inspection/tests
        starts, counts = doc_idx[order], doc_idx[order + 1] - doc_idx[order]
        self._seq_order = _expand(starts, counts)
        self._seq_start = np.zeros(len(self._seq_order) + 1, dtype=np.int64)
        np.cumsum(sizes[self._seq_order], out=self._seq_start[1:])
        idx_dtype = np.int32 if self.num_samples < 2**31 else np.int64
        self._shuffle = rng.permutation(self.num_samples).astype(idx_dtype)

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, i: int) -> np.ndarray:
        """The raw seq_length+1 tokens of (shuffled) sample `i`, as int64."""
        return self._window(self.indexed_dataset, i)

    def _window(self, source: IndexedDataset, i: int) -> np.ndarray:
        """Sample `i`'s seq_length+1 entries of ``source`` (the tokens, or their loss mask)."""
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        pos = int(self._shuffle[i]) * self.seq_length
        need = self.seq_length + 1
        k = int(np.searchsorted(self._seq_start, pos, side="right")) - 1
        offset = pos - int(self._seq_start[k])
        parts = []
        while need > 0:
            seq = int(self._seq_order[k])
            take = min(need, int(self._seq_start[k + 1] - self._seq_start[k]) - offset)
            if take > 0:
                parts.append(source.get(seq, offset, take))
                need -= take
            k, offset = k + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = self.sample_tokens(i)
        out = build_sample(
            sample,
            self.eod_token,
            reset_position_ids=self.reset_position_ids,
            reset_attention_mask=self.reset_attention_mask,
            eod_mask_loss=self.eod_mask_loss,
            create_attention_mask=self.create_attention_mask,
        )
        if self.loss_mask is not None:  # labels are tokens 1..s: their mask entries decide
            counts = self._window(self.loss_mask, i)[1:].astype(np.float32)
            out["loss_mask"] = out["loss_mask"] * torch.from_numpy(counts)
        return out


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate ranges [starts[j], starts[j]+counts[j]) without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    run_begin = np.cumsum(counts) - counts
    return np.repeat(starts - run_begin, counts) + np.arange(total, dtype=np.int64)


def build_sample(
    sample: np.ndarray,
    eod_token: int,
    *,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
) -> dict[str, torch.Tensor]:
    """Turn seq_length+1 tokens into model inputs.

    loss_mask is 0 where the *input* token is EOD (when eod_mask_loss), as in Megatron.
    attention_mask is [1, s, s] bool with True = masked out; with reset_attention_mask a
    token after an EOD cannot attend to anything up to and including that EOD.
    """
    tokens = np.ascontiguousarray(sample[:-1], dtype=np.int64)
    labels = np.ascontiguousarray(sample[1:], dtype=np.int64)
    s = len(tokens)
    is_eod = tokens == eod_token
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    # Document segment of each position: number of EODs strictly before it.
    segment = np.concatenate(([0], np.cumsum(is_eod[:-1]))) if s else np.zeros(0, np.int64)
    positions = np.arange(s, dtype=np.int64)
    if reset_position_ids:
        seg_start = np.zeros(s, dtype=np.int64)
        after = np.flatnonzero(is_eod[:-1]) + 1
        seg_start[after] = after
        positions = positions - np.maximum.accumulate(seg_start)
    out: dict[str, torch.Tensor] = {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(positions),
    }
    if create_attention_mask:
        mask = ~np.tri(s, dtype=bool)
        if reset_attention_mask:
            mask |= segment[:, None] != segment[None, :]
        out["attention_mask"] = torch.from_numpy(mask[None])
    return out


def build_train_valid_datasets(
    prefix: str | os.PathLike,
    seq_length: int,
    train_samples: int,
    valid_samples: int,
    seed: int = 1234,
    splits: str | Sequence[float] = "98,2,0",
    eod_token: int | None = None,
    **kwargs: Any,
) -> tuple[GPTDataset, GPTDataset | None]:
    """Open `prefix`, split its documents and build (train, valid); valid is None if 0 samples.

    `eod_token` defaults to the one recorded in the dataset's tokenizer sidecar; extra
    kwargs (reset_position_ids, ...) go to GPTDataset.
    """
    ds = IndexedDataset(prefix)
    if eod_token is None:
        info = ds.tokenizer_info
        if info is None or "eod" not in info:
            raise ValueError(
                f"{os.fspath(prefix)}.json records no tokenizer; pass eod_token= explicitly"
            )
        eod_token = int(info["eod"])
    need = seq_length + 1
    if ds.num_tokens < need:
        raise ValueError(
            f"dataset {os.fspath(prefix)} has {ds.num_tokens} tokens, fewer than one sample "
            f"needs (seq_length + 1 = {need}); add data or shorten --seq-length"
        )
    ranges = split_documents(
        ds.num_documents, splits, required=(train_samples > 0, valid_samples > 0, False)
    )
    train = GPTDataset(
        ds, seq_length, train_samples, seed=seed, eod_token=eod_token, split=ranges[0], **kwargs
    )
    valid = None
    if valid_samples > 0:
        valid = GPTDataset(
            ds, seq_length, valid_samples, seed=seed, eod_token=eod_token, split=ranges[1], **kwargs
        )
    return train, valid
