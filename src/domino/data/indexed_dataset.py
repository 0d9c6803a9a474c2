"""Memory-mapped token datasets in Megatron-LM's MMIDIDX `.bin`/`.idx` layout.

Index file (little-endian): magic b"MMIDIDX\\x00\\x00", version u64 (=1), dtype code u8,
sequence count u64, document count u64, int32 sizes[seq], int64 byte pointers[seq],
int64 doc_idx[doc]. The `.bin` is the concatenated token arrays. An optional `prefix.json`
sidecar (ignored by Megatron) records the tokenizer that produced the tokens.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def data_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".bin"


def index_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".idx"


def meta_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".json"


def _dtype_code(dtype: npt.DTypeLike) -> int:
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ValueError(f"unsupported token dtype {dt}; use one of {sorted(map(str, _CODE_OF))}")
    return _CODE_OF[dt]


class IndexedDatasetBuilder:
    """Streams token sequences into `prefix.bin`; `finalize()` writes `prefix.idx` (+ sidecar).

    With ``exclusive`` every file is created new (O_EXCL): an existing file or link at a name
    fails the write instead of being written through.
    """

    def __init__(
        self, prefix: str | os.PathLike, dtype: npt.DTypeLike = np.uint16, exclusive: bool = False
    ) -> None:
        self.prefix = os.fspath(prefix)
        self._mode = "x" if exclusive else "w"
        self.dtype = np.dtype(dtype)
        _dtype_code(self.dtype)  # reject a dtype the index cannot record, before writing
        parent = os.path.dirname(self.prefix)
        if parent:
            os.makedirs(parent, exist_ok=True)
        # Kept open across add_* calls so tokens stream to disk; closed in finalize().
        self._bin = open(data_path(self.prefix), self._mode + "b")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._range = None

    def add_item(self, tokens: npt.ArrayLike) -> None:
        """Append one sequence (call `end_document()` after a document's last sequence)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if self._range is not None and arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._range[0] or hi > self._range[1]:
                raise ValueError(
                    f"token ids span [{lo}, {hi}] but dtype {self.dtype} holds "
                    f"[{self._range[0]}, {self._range[1]}]; use a wider dtype"
                )
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens: npt.ArrayLike) -> None:
        """Our convention: one sequence per document."""
        self.add_item(tokens)
        self.end_document()

    @property
    def num_sequences(self) -> int:
        return len(self._sizes)

    @property
    def num_tokens(self) -> int:
        return int(sum(self._sizes))

    def finalize(self, metadata: dict[str, Any] | None = None) -> None:
        """Close `.bin`, write `.idx`, and `prefix.json` when `metadata` is given."""
        if self._doc_idx[-1] != len(self._sizes):
            self.end_document()  # never leave trailing sequences outside a document
        self._bin.close()
        write_index(index_path(self.prefix), self.dtype, self._sizes, self._doc_idx,
                    exclusive=self._mode == "x")
        if metadata is not None:
            with open(meta_path(self.prefix), self._mode, encoding="utf-8") as f:
                json.dump(metadata, f, indent=2, sort_keys=True)
                f.write("\n")

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._bin.closed:
            self._bin.close()


def write_index(
    path: str, dtype: npt.DTypeLike, sizes: Sequence[int] | np.ndarray, doc_idx: Sequence[int],
    exclusive: bool = False,
) -> None:
    """Write an MMIDIDX index for sequences of `sizes` tokens stored back to back (``exclusive``:
    as a new file, O_EXCL)."""
    dt = np.dtype(dtype)
    sizes_arr = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes_arr), dtype=np.int64)
    if len(sizes_arr) > 1:
        np.cumsum(sizes_arr[:-1].astype(np.int64) * dt.itemsize, out=pointers[1:])
    docs = np.asarray(doc_idx, dtype=np.int64)
    with open(path, "xb" if exclusive else "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(dt), len(sizes_arr), len(docs)))
        f.write(sizes_arr.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(docs.astype("<i8").tobytes())


class IndexedDataset:
    """Read-only view of `prefix.bin`/`prefix.idx`; items are numpy views into a memmap."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx_file, bin_file = index_path(self.prefix), data_path(self.prefix)
        for path in (idx_file, bin_file):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"indexed dataset file not found: {path}; run `domino preprocess` with "
                    f"--output-prefix {self.prefix} to create it"
                )
        idx_size = os.path.getsize(idx_file)
        with open(idx_file, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[: len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx_file} is not an MMIDIDX index (bad magic header)")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(f"{idx_file}: unsupported index version {version} (expected 1)")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_file}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if idx_size < expected:
            raise ValueError(
                f"{idx_file} is truncated: {idx_size} bytes, header promises {expected}"
            )
        self._idx_map = np.memmap(idx_file, dtype=np.uint8, mode="r")
        buf = self._idx_map
        off = _HEADER.size
        self._sizes = np.frombuffer(buf, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self._pointers = np.frombuffer(buf, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self._doc_idx = np.frombuffer(buf, dtype="<i8", count=n_doc, offset=off)

        itemsize = self.dtype.itemsize
        total_bytes = int(self._sizes.sum(dtype=np.int64)) * itemsize
        bin_size = os.path.getsize(bin_file)
        if bin_size != total_bytes:
            raise ValueError(
                f"{bin_file} has {bin_size} bytes but {idx_file} describes {total_bytes} "
                f"({n_seq} sequences of {self.dtype}); the files are truncated or mismatched, "
                "re-run `domino preprocess`"
            )
        if (
            n_seq
            and int((self._pointers + self._sizes.astype(np.int64) * itemsize).max()) > bin_size
        ):
            raise ValueError(f"{idx_file}: sequence pointers run past the end of {bin_file}")
        if n_doc and (self._doc_idx[0] != 0 or self._doc_idx[-1] > n_seq):
            raise ValueError(f"{idx_file}: document index must start at 0 and stay <= {n_seq}")
        # mmap refuses empty files, and an empty dataset needs no mapping.
        if bin_size:
            self._tokens: np.ndarray = np.memmap(
                bin_file, dtype=self.dtype.newbyteorder("<"), mode="r"
            )
        else:
            self._tokens = np.empty(0, dtype=self.dtype)
        self._meta: dict[str, Any] | None = None
        if os.path.isfile(meta_path(self.prefix)):
            self._meta = _read_sidecar(meta_path(self.prefix))

    def __getstate__(self) -> dict[str, str]:
        # Reopen by path in the receiving process: pickling a memmap would copy the whole file.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["prefix"])  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self._sizes)

    def _check(self, i: int) -> int:
        n = len(self._sizes)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for dataset of {n} sequences")
        return i + n if i < 0 else i

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `i` (to its end when length is None)."""
        i = self._check(int(i))
        size = int(self._sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {i} of {size}")
        start = int(self._pointers[i]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self.get(j) for j in range(*i.indices(len(self)))]
        return self.get(i)

    @property
    def sizes(self) -> np.ndarray:
        """Token count of every sequence (int32)."""
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of every sequence in `.bin` (int64)."""
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """Document boundaries in sequences: doc d is sequences doc_idx[d]:doc_idx[d+1]."""
        return self._doc_idx

    @property
    def num_documents(self) -> int:
        return max(len(self._doc_idx) - 1, 0)

    @property
    def num_tokens(self) -> int:
        return int(self._sizes.sum(dtype=np.int64))

    @property
    def metadata(self) -> dict[str, Any] | None:
        """Contents of the `prefix.json` sidecar, if any."""
        return self._meta

    @property
    def tokenizer_info(self) -> dict[str, Any] | None:
        """The recorded `Tokenizer.describe()`, if the sidecar has one."""
        return None if self._meta is None else self._meta.get("tokenizer")

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sequences={len(self)}, "
            f"documents={self.num_documents}, dtype={self.dtype})"
        )


def _read_sidecar(path: str) -> dict[str, Any]:
    """The ``prefix.json`` sidecar; ValueError naming the file when it is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: the dataset's sidecar is not valid JSON ({err}); restore it "
                         "or re-run `domino preprocess` (or delete it: the dataset is then read "
                         "without its tokenizer record)") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("tokenizer", {}), dict | None):
        raise ValueError(f"{path}: the dataset's sidecar must be a JSON object (with a "
                         "'tokenizer' object); restore it or re-run `domino preprocess`")
    return meta

