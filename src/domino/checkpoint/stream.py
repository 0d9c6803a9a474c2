"""A safetensors file written tensor by tensor, in any order (safetensors has no such writer).

A sharded run's checkpoint gathers each tensor from the data-parallel ranks one bucket at a
time; holding the whole file's tensors in memory first, as ``safetensors.torch.save_file``
needs, is what a sharded run cannot afford. The format is the documented one: an 8-byte
little-endian header length, a JSON header (``__metadata__`` first if any, then every tensor's
``dtype``, ``shape`` and ``data_offsets`` in the order of the data), padded with spaces to a
multiple of 8 bytes, then the tensors' raw little-endian bytes. Since every tensor's shape and
dtype are known beforehand, the header and each tensor's place are fixed when the file is
opened, and each tensor is written at its place when it arrives.

The data is ordered as safetensors orders it (by dtype, widest first, then by name), so for
the same tensors the file is byte for byte what ``save_file`` writes (tested against the
installed library; ``__metadata__`` with two or more keys excepted: the library writes a hash
map's order, this writer the keys sorted).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import torch

# Widest first, as safetensors orders the data section (its Dtype's ordering, reversed).
_ORDER = [
    (torch.uint64, "U64"), (torch.int64, "I64"), (torch.float64, "F64"),
    (torch.complex64, "C64"), (torch.float32, "F32"), (torch.uint32, "U32"),
    (torch.int32, "I32"), (torch.bfloat16, "BF16"), (torch.float16, "F16"),
    (torch.uint16, "U16"), (torch.int16, "I16"), (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.float8_e5m2, "F8_E5M2"), (torch.int8, "I8"), (torch.uint8, "U8"),
    (torch.bool, "BOOL")]
_NAME = {d: name for d, name in _ORDER}
_RANK = {d: i for i, (d, _) in enumerate(_ORDER)}


class StreamWriter:
    """One safetensors file whose tensors (``layout``: name -> (shape, dtype)) are written one
    at a time with :meth:`write`, in any order; :meth:`close` checks that every one was.
    Use as a context manager (a failure leaves a partial file: the caller removes it)."""

    def __init__(self, path: Path | str, layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        if sys.byteorder != "little":
            raise NotImplementedError("StreamWriter writes the host's bytes: it needs a "
                                      "little-endian host (use safetensors.torch.save_file)")
        for name, (_, dtype) in layout.items():
            if dtype not in _NAME:
                raise ValueError(f"tensor {name}: dtype {dtype} has no safetensors name here; "
                                 f"supported: {', '.join(str(d) for d in _NAME)}")
        names = sorted(layout, key=lambda n: (_RANK[layout[n][1]], n))
        header: dict[str, Any] = {}
        if metadata is not None:
            header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
        self._places: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        for name in names:
            shape, dtype = tuple(int(s) for s in layout[name][0]), layout[name][1]
            size = _numel(shape) * _itemsize(dtype)
            header[name] = {"dtype": _NAME[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self._places[name] = (offset, size, shape, dtype)
            offset += size
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        self._start = 8 + len(text)
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._file.truncate(self._start + offset)  # every tensor's place, zeros until written
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write tensor ``name`` (its shape and dtype as declared) at its place."""
        if name not in self._places:
            raise KeyError(f"{self.path}: tensor {name!r} was not declared when it was opened")
        if name in self._written:
            raise ValueError(f"{self.path}: tensor {name!r} written twice")
        offset, size, shape, dtype = self._places[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{self.path}: tensor {name!r} is {tuple(tensor.shape)} "
                             f"{tensor.dtype}, declared {shape} {dtype}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if size:
            self._file.seek(self._start + offset)
            self._file.write(flat.view(torch.uint8).numpy().data)  # no copy of the bytes
        self._written.add(name)

    def missing(self) -> list[str]:
        """Declared tensors not written yet."""
        return sorted(set(self._places) - self._written)

    def close(self) -> None:
        """Finish the file; every declared tensor must have been written."""
        if self._file.closed:
            return
        self._file.close()
        if self.missing():
            raise ValueError(f"{self.path}: tensors {self.missing()[:5]} declared but never "
                             "written")

    def abort(self) -> None:
        """Close without the check or a failure (a failed save: the file is incomplete and
        removed with its folder)."""
        try:
            self._file.close()
        except OSError:  # (flushing the rest onto the full disk that failed the save)
            pass

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def save_streamed(tensors: dict[str, torch.Tensor], path: Path | str,
                  metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` through :class:`StreamWriter` (the same bytes)."""
    layout = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    with StreamWriter(path, layout, metadata) as writer:
        for name, value in tensors.items():
            writer.write(name, value)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
