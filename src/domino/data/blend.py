"""Weighted blends of datasets (Megatron's ``--data-path 0.7 A 0.3 B``).

A blend is a list of prefixes with weights. Its samples are placed by :func:`blend_index`, a
deterministic interleaving whose every prefix holds each dataset in its weight's proportion
within a stated bound; sample j of dataset k is that dataset's own sample j (its own seeded
shuffle, wrapping to further epochs when its share outgrows it). The blend is indexed by global
sample, so it does not depend on the data-parallel size, and a run resumed at ``consumed``
samples reads the same continuation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from torch.utils.data import Dataset

from domino.data.checks import normalize_prefix


@dataclass(frozen=True)
class Blend:
    """Datasets and their weights (normalised to sum to 1; duplicates allowed)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.prefixes)

    def describe(self) -> str:
        """``data/A`` or ``blend of 2 datasets: 70% data/A, 30% data/B``."""
        if len(self) == 1:
            return self.prefixes[0]
        parts = ", ".join(f"{_percent(w)} {p}" for p, w in zip(self.prefixes, self.weights,
                                                                strict=True))
        return f"blend of {len(self)} datasets: {parts}"


def _percent(w: float) -> str:
    text = f"{100 * w:.1f}".rstrip("0").rstrip(".")
    return f"{text}%"


def parse_blend(tokens: str | Sequence[str], flag: str = "--data-path") -> Blend:
    """Megatron's forms: ``PREFIX`` alone, or ``W1 PREFIX1 W2 PREFIX2 ...`` (weights positive,
    normalised). A string is split on whitespace when it starts with a weight
    (:func:`blend_tokens`). ValueError names the flag, value and fix."""
    items = blend_tokens(tokens) if isinstance(tokens, str) else [str(t) for t in tokens]
    shown = " ".join(items)
    if not items:
        raise ValueError(f"{flag} needs a dataset prefix, or weight/prefix pairs such as "
                         f"'{flag} 0.7 data/a 0.3 data/b'")
    if len(items) == 1:
        if _number(items[0]) is not None:
            raise ValueError(f"{flag} {shown}: a weight needs a dataset prefix after it; pass "
                             f"'{flag} PREFIX' or weight/prefix pairs")
        return Blend((normalize_prefix(items[0]),), (1.0,))
    if len(items) % 2:
        raise ValueError(f"{flag} {shown}: {len(items)} values, but a blend is weight/prefix "
                         f"pairs (an even count), e.g. '{flag} 0.7 data/a 0.3 data/b'; a prefix "
                         "without a weight is only allowed alone")
    weights, prefixes = [], []
    for w_text, prefix in zip(items[::2], items[1::2], strict=True):
        w = _number(w_text)
        if w is None:
            raise ValueError(f"{flag} {shown}: {w_text!r} stands where a weight goes but is not "
                             f"a number; write weight/prefix pairs, e.g. '{flag} 0.7 data/a 0.3 "
                             "data/b'")
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"{flag} {shown}: weight {w_text} of {prefix} must be a finite "
                             "number > 0; drop the dataset instead of weighting it 0")
        if _number(prefix) is not None:
            raise ValueError(f"{flag} {shown}: {prefix!r} stands where a prefix goes but is a "
                             "number; write weight/prefix pairs")
        # Exact rationals: "7 A 3 B" and "0.7 A 0.3 B" normalise to the very same floats, so
        # they give the same blend index (a float division could differ in the last bit).
        weights.append(Fraction(w_text) if _rational(w_text) else Fraction(w))
        prefixes.append(normalize_prefix(prefix))
    total = sum(weights)
    return Blend(tuple(prefixes), tuple(float(w / total) for w in weights))


def blend_tokens(text: str) -> list[str]:
    """One string as the flag's values: ``"0.7 A 0.3 B"`` (it starts with a weight) split on
    whitespace, anything else one prefix, so a config written before blends, with a path that
    holds a space (``"/data/my corpus/text"``), still names that one dataset."""
    items = text.split()
    return items if len(items) > 1 and _number(items[0]) is not None else [text.strip()]


def _rational(text: str) -> bool:
    try:
        Fraction(text)
    except ValueError:
        return False
    return True


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def deviation_bound(weights: Sequence[float]) -> np.ndarray:
    """Per dataset, the most its count in any prefix of :func:`blend_index` can differ from
    weight x prefix length: ``(1 + (K - 2) w_k) / 2`` for K datasets (0 for one, 1/2 for two,
    always below ``(K - 1) / 2`` and below 1 for K <= 3)."""
    w = np.asarray(weights, dtype=np.float64)
    return (1.0 + (len(w) - 2) * w) / 2.0 if len(w) > 1 else np.zeros(1)


def blend_dtype(num_datasets: int) -> np.dtype:
    """The smallest unsigned dtype that numbers ``num_datasets`` datasets."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if num_datasets - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"a blend of {num_datasets} datasets is too many")


def blend_index(weights: Sequence[float], num_samples: int,
                window: int = 1 << 20) -> np.ndarray:
    """Which dataset each of the blend's ``num_samples`` samples comes from.

    Sample j of dataset k is due at time (j + 1/2) / w_k; the blend takes the samples in order
    of due time (ties: lower k first). In every prefix of n samples dataset k then holds
    c_k(n) with |c_k(n) - w_k n| <= (1 + (K - 2) w_k) / 2 (:func:`deviation_bound`): each
    count is within 1/2 of w_k T at the due time T of the n-th sample, and n itself is the sum
    of the counts. The order is a prefix of one infinite sequence: a longer run only appends.
    Built a time ``window`` (about that many samples) at a time, so the memory beyond the
    result stays a few tens of MB however long the run (what it costs: docs/train.md,
    "Blends").
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    dtype = blend_dtype(len(w))
    index = np.zeros(num_samples, dtype=dtype)
    if len(w) == 1:
        return index
    done, t0 = 0, 0.0
    first = np.zeros(len(w), dtype=np.int64)  # per dataset: its first sample due at >= t0
    while done < num_samples:
        # Every sample due in [t0, t1) comes after every one due before t0 and before every one
        # due at or after t1, whatever its dataset: the windows' merges concatenate exactly.
        t1 = t0 + float(min(window, num_samples - done + len(w)))  # no more than is left
        last = _due_before(w, t1)
        due = [(np.arange(a, b, dtype=np.float64) + 0.5) / wk
               for a, b, wk in zip(first, last, w, strict=True)]
        # A stable sort of the runs laid end to end in dataset order: by due time, ties to the
        # lower k. numpy's stable sort merges sorted runs (timsort): 1M samples of 10 datasets
        # in 0.02 s, where searching each run in every other took 0.35 s (K^2 searches).
        order = np.argsort(np.concatenate(due), kind="stable")
        which = np.repeat(np.arange(len(w), dtype=dtype), [len(d) for d in due])
        took = min(len(order), num_samples - done)
        index[done:done + took] = which[order[:took]]
        done += len(order)
        first, t0 = last, t1
    return index


def _due_before(w: np.ndarray, t: float) -> np.ndarray:
    """Per dataset k, how many of its samples are due strictly before time ``t``: the least c
    with (c + 1/2) / w_k >= t, in the very float arithmetic :func:`blend_index` compares."""

    def due(c: np.ndarray) -> np.ndarray:
        return (c.astype(np.float64) + 0.5) / w

    with np.errstate(over="ignore", divide="ignore"):
        c = np.maximum(np.ceil(t * w - 0.5), 0).astype(np.int64)  # right up to rounding
        while (low := (c > 0) & (due(c - 1) >= t)).any():
            c -= low
        while (high := due(c) < t).any():
            c += high
    return c


def check_index(index: np.ndarray, weights: Sequence[float], probes: int = 64) -> str | None:
    """None when ``index`` looks like :func:`blend_index` of ``weights``, else what differs.

    A cheap check for an index read back from disk: its head is rebuilt and compared, and
    ``probes`` samples of each dataset, spread over its share, must sit at the position their
    due time gives (the count of every dataset's samples due before it)."""
    n, k = index.size, len(weights)
    probes = max(2, min(probes, 4096 // k))  # O(k) each: bounded work for big blends too
    head = min(n, 4096)
    if not np.array_equal(index[:head], blend_index(weights, head)):
        return f"its first {head} samples are not the blend's"
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    counts = np.bincount(index, minlength=k)
    if counts.size != k:
        return f"it names dataset {counts.size - 1} of a blend of {k}"
    for d in range(k):
        spread = np.linspace(0, counts[d] - 1, probes) if counts[d] else []
        for j in np.unique(np.asarray(spread, dtype=np.int64)):
            t = (float(j) + 0.5) / w[d]
            # Before sample j of d: its own j, the lower-numbered datasets' samples due at or
            # before t (ties go to them) and the higher-numbered ones' due strictly before.
            before = _due_before(w, t)
            with np.errstate(over="ignore", divide="ignore"):
                tie = (before.astype(np.float64) + 0.5) / w == t
            pos = j + int(before[:d].sum() + tie[:d].sum() + before[d + 1:].sum())
            if pos >= n or index[pos] != d:
                return f"sample {j} of dataset {d} is not at position {pos}"
    return None


def sample_index(index: np.ndarray, num_datasets: int) -> np.ndarray:
    """For each blended sample, its sample number inside its own dataset (0, 1, ... per
    dataset, in blend order)."""
    dtype = np.int32 if index.size < 2**31 else np.int64
    out = np.empty(index.size, dtype=dtype)
    if num_datasets <= 16:  # one pass per dataset: 0.1 s CPU for 10M samples of 3
        for k in range(num_datasets):
            mine = index == k
            out[mine] = np.arange(np.count_nonzero(mine), dtype=dtype)
        return out
    counts = np.bincount(index, minlength=num_datasets)
    order = np.argsort(index, kind="stable")  # a radix sort of small integers: linear
    out[order] = np.arange(index.size, dtype=dtype) - np.repeat(
        (np.cumsum(counts) - counts).astype(dtype), counts)
    return out


class BlendedDataset(Dataset):
    """Samples of several datasets, placed by a blend index (see :func:`blend_index`).

    ``datasets[k]`` must hold at least as many samples as ``index`` gives it; sample i is
    ``datasets[index[i]][sample_index[i]]``.
    """

    def __init__(self, datasets: Sequence[Dataset], index: np.ndarray,
                 description: str = "") -> None:
        self.datasets = list(datasets)
        self.index = index
        self.sample_index = sample_index(index, len(self.datasets))
        self.description = description
        counts = np.bincount(index, minlength=len(self.datasets))
        for k, (ds, need) in enumerate(zip(self.datasets, counts, strict=True)):
            held = len(ds)  # type: ignore[arg-type]
            if held < need:
                raise ValueError(f"dataset {k} of the blend holds {held} samples, the blend "
                                 f"needs {need}")

    def __len__(self) -> int:
        return int(self.index.size)

    def source(self, i: int) -> tuple[int, int]:
        """(dataset, its sample) of blended sample ``i``."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        return int(self.index[i]), int(self.sample_index[i])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, j = self.source(i)
        return self.datasets[k][j]


def build_blended(weights: Sequence[float], num_samples: int,
                  make: Callable[[int, int], Dataset], index: np.ndarray | None = None,
                  description: str = "") -> BlendedDataset:
    """The blend of ``num_samples``: ``make(k, count)`` builds dataset k holding ``count``
    samples (its share); ``index`` is a ready :func:`blend_index` (e.g. from the cache)."""
    if index is None:
        index = blend_index(weights, num_samples)
    counts = np.bincount(index, minlength=len(weights))
    return BlendedDataset([make(k, int(c)) for k, c in enumerate(counts)], index, description)


def component_seed(seed: int, k: int) -> int:
    """The shuffle seed of a blend's dataset k: distinct per position, so a prefix listed twice
    (``0.5 A 0.5 A``) is read in two different orders rather than the same one twice."""
    return int(np.random.SeedSequence([seed, k]).generate_state(1)[0])

