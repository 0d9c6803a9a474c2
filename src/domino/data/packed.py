"""Packed samples: whole documents (conversations) several to a sample, never split, each
attending only to itself with positions restarting at 0 (``--pack-documents``).

The rule is greedy in order (next-fit): each epoch the split's documents are shuffled by the
seed and laid into samples of ``seq_length + 1`` token slots one after another; a document that
does not fit in what is left of the current sample starts the next one, and the slots left over
are padding. Boundaries come from the dataset's document index, not from EOD tokens, so chat
data (written without EODs) packs as well as text.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from domino.data.indexed_dataset import IndexedDataset
from domino.data.loss_mask import open_loss_mask


def next_fit(lengths: npt.ArrayLike, capacity: int) -> np.ndarray:
    """Sample boundaries of greedy in-order packing: ``starts`` with sample k holding the
    documents ``starts[k] .. starts[k+1] - 1`` (every length must be <= ``capacity``)."""
    sizes = np.asarray(lengths, dtype=np.int64).tolist()
    starts, used = [0], 0
    for j, n in enumerate(sizes):
        if used + n > capacity and used:
            starts.append(j)
            used = 0
        used += n
    if sizes:
        starts.append(len(sizes))
    return np.asarray(starts, dtype=np.int64)


class PackedDataset(Dataset):
    """Samples of ``seq_length`` inputs packed from whole documents (module docstring: the
    rule). Keys as :class:`~domino.data.gpt_dataset.GPTDataset`'s: ``tokens``, ``labels``,
    ``loss_mask`` (0 on padding, on each document's last token, whose label would be the next
    document's, and where the chat loss mask says 0), ``position_ids`` (0 at each document's
    start) and ``attention_mask`` ([1, s, s] bool, True = masked: causal within a document;
    the padding is one more document of its own). ``split`` as GPTDataset's (a (start, end)
    range of documents, indices, or None); a document longer than ``seq_length + 1`` is
    refused (ValueError: shorten it with ``domino preprocess --max-tokens``)."""

    def __init__(self, indexed_dataset: IndexedDataset, seq_length: int,
                 num_samples: int | None = None, *, epochs: int | None = None,
                 seed: int = 1234, split: tuple[int, int] | npt.ArrayLike | None = None,
                 pad_token: int = 0, create_attention_mask: bool = True,
                 loss_mask: IndexedDataset | None | str = "auto", **_ignored: Any) -> None:
        # **_ignored: GPTDataset's EOD options, meaningless here (boundaries are documents).
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if (num_samples is None) == (epochs is None):
            raise ValueError("pass exactly one of num_samples or epochs")
        self.indexed_dataset = indexed_dataset
        self.loss_mask = open_loss_mask(indexed_dataset) if loss_mask == "auto" else loss_mask
        self.seq_length, self.seed, self.pad_token = seq_length, seed, pad_token
        self.create_attention_mask = create_attention_mask
        self.documents = _documents(indexed_dataset, split)
        doc_idx = np.asarray(indexed_dataset.doc_idx, dtype=np.int64)
        sizes = np.asarray(indexed_dataset.sizes, dtype=np.int64)
        seq_end = np.concatenate(([0], np.cumsum(sizes)))
        self._doc_lengths = seq_end[doc_idx[1:]] - seq_end[doc_idx[:-1]]  # every document
        lengths = self._doc_lengths[self.documents]
        capacity = seq_length + 1
        long = lengths > capacity
        if long.any():
            raise ValueError(
                f"--pack-documents never splits a document, but {int(long.sum())} of the "
                f"{len(lengths)} selected documents are longer than --seq-length + 1 = "
                f"{capacity} tokens (the longest {int(lengths.max())}); re-run `domino "
                f"preprocess` with --max-tokens {capacity} (and --truncate to keep their "
                "start), or raise --seq-length")
        if not lengths.size or not lengths.sum():
            raise ValueError(f"the {len(lengths)} selected document(s) hold no token to pack; "
                             "add data or change --split")
        rng = np.random.default_rng(seed)
        orders, bounds, total = [], [np.zeros(1, np.int64)], 0
        want = num_samples
        for epoch in range(epochs if epochs is not None else 2**62):
            if want is not None and total >= want and orders:
                break
            order = rng.permutation(self.documents)
            starts = next_fit(self._doc_lengths[order], capacity)
            base = sum(len(o) for o in orders)
            orders.append(order)
            bounds.append(starts[1:] + base)
            total += len(starts) - 1
            if epoch == 0:  # every epoch packs alike on average: the first one is reported
                self.samples_per_epoch = len(starts) - 1
                self.tokens_per_epoch = int(lengths.sum())
        self.document_order = np.concatenate(orders)
        self._bounds = np.concatenate(bounds)
        self.num_samples = int(total if num_samples is None else num_samples)
        self.epochs = len(orders)
        idx_dtype = np.int32 if self.num_samples < 2**31 else np.int64
        self._shuffle = rng.permutation(self.num_samples).astype(idx_dtype)

    @property
    def efficiency(self) -> float:
        """Real tokens / token slots of an epoch's samples (the rest is padding)."""
        return self.tokens_per_epoch / (self.samples_per_epoch * (self.seq_length + 1))

    def describe(self) -> str:
        """The start-up line's account of the packing."""
        return (f"{len(self.documents):,} documents packed into {self.samples_per_epoch:,} "
                f"samples of {self.seq_length + 1} token slots per epoch (greedy in order): "
                f"efficiency {100 * self.efficiency:.1f}% (real tokens / slots)")

    def __len__(self) -> int:
        return self.num_samples

    def sample_documents(self, i: int) -> np.ndarray:
        """The documents (dataset indices) packed into (shuffled) sample ``i``, in order."""
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        k = int(self._shuffle[i])
        return self.document_order[self._bounds[k]:self._bounds[k + 1]]

    def _document(self, source: IndexedDataset, doc: int) -> np.ndarray:
        doc_idx = source.doc_idx
        parts = [source.get(j) for j in range(int(doc_idx[doc]), int(doc_idx[doc + 1]))]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        docs = self.sample_documents(i)
        tokens = [self._document(self.indexed_dataset, d) for d in docs]
        counts = None if self.loss_mask is None else \
            [self._document(self.loss_mask, d) for d in docs]
        return build_packed_sample(tokens, self.seq_length, pad_token=self.pad_token,
                                   loss_masks=counts,
                                   create_attention_mask=self.create_attention_mask)


def _documents(ds: IndexedDataset, split: tuple[int, int] | npt.ArrayLike | None) -> np.ndarray:
    n_docs = ds.num_documents
    if split is None:
        return np.arange(n_docs, dtype=np.int64)
    if isinstance(split, tuple) and len(split) == 2:
        start, end = int(split[0]), int(split[1])
        if not 0 <= start <= end <= n_docs:
            raise ValueError(f"split ({start}, {end}) outside the dataset's {n_docs} documents")
        return np.arange(start, end, dtype=np.int64)
    documents = np.asarray(split, dtype=np.int64).reshape(-1)
    if documents.size and (documents.min() < 0 or documents.max() >= n_docs):
        raise ValueError(f"document indices must lie in [0, {n_docs})")
    return documents


def build_packed_sample(documents: list[np.ndarray], seq_length: int, *, pad_token: int = 0,
                        loss_masks: list[np.ndarray] | None = None,
                        create_attention_mask: bool = True) -> dict[str, torch.Tensor]:
    """Model inputs of whole ``documents`` laid one after another into ``seq_length + 1``
    slots (PackedDataset's keys and rules); ``loss_masks``: each document's per-token mask
    (the entry of token t+1 decides whether predicting it counts)."""
    lengths = [len(d) for d in documents]
    used = sum(lengths)
    if used > seq_length + 1:
        raise ValueError(f"{used} tokens of {len(documents)} documents do not fit "
                         f"{seq_length + 1} slots")
    slots = seq_length + 1
    raw = np.full(slots, pad_token, dtype=np.int64)
    counts = np.zeros(slots, dtype=np.float32)  # 0 on padding
    segment = np.full(slots, len(documents), dtype=np.int64)  # padding: a document of its own
    position = np.zeros(slots, dtype=np.int64)
    at = 0
    for j, doc in enumerate(documents):
        n = len(doc)
        raw[at:at + n] = doc
        counts[at:at + n] = 1.0 if loss_masks is None else loss_masks[j]
        segment[at:at + n] = j
        position[at:at + n] = np.arange(n)
        at += n
    position[at:] = np.arange(slots - at)
    s = seq_length
    # Position p predicts token p+1: it counts only inside one document (a document's last
    # token predicts nothing) and where the mask of token p+1 says so.
    loss_mask = counts[1:] * (segment[:-1] == segment[1:]) * (segment[1:] < len(documents))
    out: dict[str, torch.Tensor] = {
        "tokens": torch.from_numpy(raw[:s].copy()),
        "labels": torch.from_numpy(raw[1:].copy()),
        "loss_mask": torch.from_numpy(loss_mask.astype(np.float32)),
        "position_ids": torch.from_numpy(position[:s].copy()),
    }
    if create_attention_mask:
        seg = segment[:s]
        mask = ~np.tri(s, dtype=bool) | (seg[:, None] != seg[None, :])
        out["attention_mask"] = torch.from_numpy(mask[None])
    return out


def packing_text(dataset: Any) -> str | None:
    """The start-up line of a run's packed training data (a PackedDataset or a blend of
    them; None when nothing is packed): documents, samples and efficiency per epoch."""
    parts = [d for d in getattr(dataset, "datasets", [dataset]) if isinstance(d, PackedDataset)]
    if not parts:
        return None
    if len(parts) == 1:
        return f"packing: {parts[0].describe()}"
    tokens = sum(p.tokens_per_epoch for p in parts)
    slots = sum(p.samples_per_epoch * (p.seq_length + 1) for p in parts)
    return (f"packing: {len(parts)} datasets, {sum(len(p.documents) for p in parts):,} "
            f"documents into {sum(p.samples_per_epoch for p in parts):,} samples per epoch "
            f"(greedy in order): efficiency {100 * tokens / slots:.1f}% (real tokens / slots)")
