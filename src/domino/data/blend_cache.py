"""The blend index on disk: ``blend_<split>_<hash>.npy`` plus a JSON sidecar, reused only after
checking.

The file name's hash covers everything the run's blend is made from (the datasets' paths, the
sizes and modification times of their .bin/.idx, the weights, seed, split, sequence length and
number of samples), so a changed input never finds an old file. On reuse the sidecar must
repeat that key, and the array must have the recorded dtype, shape, value range, per-dataset
counts and SHA-256, and the order itself is checked against the weights (its head rebuilt,
samples of each dataset probed at their due positions: a file from another version of the
algorithm is not taken for this one); anything else is rebuilt. Arrays are read with
``allow_pickle=False``, so a cache file can never run code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from domino.data.blend import check_index
from domino.data.indexed_dataset import data_path, index_path

CACHE_VERSION = 1


def _stamp(prefix: str) -> list[Any]:
    """A dataset's identity: its absolute path and its files' sizes and modification times."""
    out: list[Any] = [os.path.abspath(prefix)]
    for path in (index_path(prefix), data_path(prefix)):
        st = os.stat(path)
        out += [st.st_size, st.st_mtime_ns]
    return out


def cache_key(prefixes: Sequence[str], weights: Sequence[float], *, split_name: str,
              split: str | None, seed: int, seq_length: int, num_samples: int) -> dict[str, Any]:
    """What a cached blend index stands for (JSON-able)."""
    return {"version": CACHE_VERSION, "split_name": split_name, "split": split,
            "datasets": [_stamp(p) for p in prefixes], "weights": [float(w) for w in weights],
            "seed": int(seed), "seq_length": int(seq_length), "num_samples": int(num_samples)}


def _paths(folder: Path, key: dict[str, Any]) -> tuple[Path, Path]:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    stem = f"blend_{key['split_name']}_{digest}"
    return folder / f"{stem}.npy", folder / f"{stem}.json"


def _sha(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def load_index(folder: Path, key: dict[str, Any], dtype: np.dtype) -> tuple[np.ndarray | None,
                                                                           str]:
    """The cached index for ``key``, or (None, why it is not usable)."""
    npy, side = _paths(folder, key)
    if not (npy.is_file() and side.is_file()):
        return None, "not cached yet"
    try:
        record = json.loads(side.read_text(encoding="utf-8"))
        index = np.load(npy, allow_pickle=False)
    except (OSError, ValueError) as err:
        return None, f"unreadable ({err})"
    n, k = key["num_samples"], len(key["datasets"])
    if not isinstance(record, dict) or record.get("key") != key:
        return None, "its sidecar describes other inputs"
    if index.dtype != dtype or index.shape != (n,):
        return None, f"{index.dtype}{list(index.shape)} where {np.dtype(dtype)}[{n}] is due"
    if n and int(index.max()) >= k:
        return None, f"dataset number {int(index.max())} in a blend of {k}"
    if np.bincount(index, minlength=k).tolist() != record.get("counts"):
        return None, "its per-dataset counts differ from the sidecar's"
    if _sha(index) != record.get("sha256"):
        return None, "its SHA-256 differs from the sidecar's"
    if (wrong := check_index(index, key["weights"])) is not None:
        return None, f"it is not this blend's order ({wrong})"
    return index, "reused"


def save_index(folder: Path, key: dict[str, Any], index: np.ndarray) -> Path:
    """Write the index and its sidecar, each by an atomic rename: a reader sees a whole file or
    none, so concurrent writers of the same (deterministic) index are harmless."""
    npy, side = _paths(folder, key)
    record = {"key": key, "dtype": str(index.dtype), "shape": list(index.shape),
              "counts": np.bincount(index, minlength=len(key["datasets"])).tolist(),
              "sha256": _sha(index)}
    _atomic(npy, lambda f: np.save(f, index, allow_pickle=False))
    _atomic(side, lambda f: f.write(json.dumps(record, indent=1).encode()))
    return npy


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes owner-only files: the other users of a shared data folder's cache
        # could then never read the index, only rebuild and replace it, in turn.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
