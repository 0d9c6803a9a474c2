"""The blend index on disk: ``blend_<split>_<hash>.npy`` plus a JSON sidecar, reused only after
checking.

The file name's hash covers everything the run's blend is made from (the datasets' paths, the
sizes and modification times of their .bin/.idx, the weights, seed, split, sequence length and
number of samples), so a changed input never finds an old file. On reuse the sidecar must
repeat that key, and the array must have the recorded dtype, shape, value range, per-dataset
counts and SHA-256, and the order itself is checked against the weights (its head rebuilt,
samples of each dataset probed at their due positions: a file from another version of the
algorithm is not taken for this one); anything else is rebuilt. Arrays are read with
``allow_pickle=False``, so a cache file can never run code, and never through a link: a link
(or any other non-file) at a cache name is rebuilt over, never read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from domino.data.blend import check_index
from domino.data.indexed_dataset import data_path, index_path
from domino.safe_files import NotAFileError, open_regular, read_regular, write_atomic

CACHE_VERSION = 1
_MAX_SIDECAR_BYTES = 64 << 20  # a key and counts: kilobytes for any real blend


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
    if not (os.path.lexists(npy) and os.path.lexists(side)):
        return None, "not cached yet"
    try:
        record = json.loads(read_regular(side, _MAX_SIDECAR_BYTES))
        with open_regular(npy) as f:
            index = np.load(f, allow_pickle=False)
    except NotAFileError as err:
        return None, f"{err.strerror}: rebuilt"
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
    buffer = io.BytesIO()
    np.save(buffer, index, allow_pickle=False)
    # Readable by all (the other users of a shared data folder's cache must be able to read
    # the index, not only rebuild and replace it in turn).
    write_atomic(npy, buffer.getvalue(), mode=0o644)
    write_atomic(side, json.dumps(record, indent=1), mode=0o644)
    return npy
