"""Stream documents out of the files `domino preprocess` reads.

Text files (one document each), JSON Lines (plain, gzip or zstd; one document per line) and
Parquet / Arrow tables (one document per row). Everything is read incrementally: lines from a
decompressing stream, tables in record batches of the one column asked for, so memory stays
flat whatever the file size. Each document comes with the on-disk bytes consumed to reach it,
which add up to the file's size: the progress bar counts those.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

JSONL_SUFFIXES = (".jsonl", ".json")
_KINDS = (  # longest suffix first: ".jsonl.gz" must not read as plain text
    ((".jsonl.gz", ".json.gz"), "jsonl.gz"),
    ((".jsonl.zst", ".json.zst"), "jsonl.zst"),
    (JSONL_SUFFIXES, "jsonl"),
    ((".parquet",), "parquet"),
    ((".arrow",), "arrow"),
)
DATA_PATTERNS = ("*.jsonl", "*.json", "*.jsonl.gz", "*.json.gz", "*.jsonl.zst", "*.json.zst",
                 "*.parquet", "*.arrow")
# Compressed bytes per read: large enough to amortise, small enough that even a very
# compressible chunk decompresses to tens of MB, not GB.
_CHUNK = 1 << 18
_ROWS = 4096  # table rows per record batch
_NAMES = {"parquet": "Parquet", "arrow": "Arrow"}


def input_kind(path: str) -> str:
    """'jsonl', 'jsonl.gz', 'jsonl.zst', 'parquet', 'arrow' or 'text', from the file name."""
    lower = path.lower()
    for suffixes, kind in _KINDS:
        if lower.endswith(suffixes):
            return kind
    return "text"


def saved_dataset_files(folder: str) -> list[str] | None:
    """The .arrow files of a `datasets.save_to_disk` folder, in order; None for other folders."""
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(folder)
                        if os.path.isfile(os.path.join(folder, d, "state.json")))
        example = os.path.join(folder, "train" if "train" in splits or not splits else splits[0])
        raise ValueError(f"{folder} holds a DatasetDict written by datasets' save_to_disk (splits: "
                         f"{', '.join(splits) or 'none'}); pass one split's folder, e.g. {example}")
    try:
        with open(os.path.join(folder, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no state.json, or not the one datasets writes: an ordinary folder
    files = [os.path.join(folder, name) for name in names]
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: listed in {folder}/state.json but missing; "
                                    "save the dataset again")
    return files


def iter_documents(
    files: Sequence[str], json_key: str = "text"
) -> Iterator[tuple[str | None, int]]:
    """Yield (text, on-disk bytes read) per document: one per text file, JSON line or table row.

    Text is None for bytes read between documents (a compressed stream's trailer, a table's
    footer): they count for progress only.
    """
    for path in files:
        kind = input_kind(path)
        if kind == "text":
            with open(path, "rb") as f:
                raw = f.read()
            yield raw.decode("utf-8", errors="replace"), len(raw)
            continue
        reader = _iter_table(path, kind, json_key) if kind in ("parquet", "arrow") else (
            _iter_jsonl(path, kind, json_key))
        consumed = 0
        for text, pos in reader:
            yield text, pos - consumed
            consumed = pos
        if (rest := os.path.getsize(path) - consumed) > 0:
            yield None, rest


def check_inputs(files: Sequence[str], json_keys: Sequence[str]) -> None:
    """Fail fast, before any tokenizing: open every JSONL and table file and check `json_keys`.

    Tables: the file opens and each key is a string column. JSON Lines: the first record parses
    and holds each key as a string. Later rows are checked as they are read.
    """
    for path in files:
        kind = input_kind(path)
        if kind in ("parquet", "arrow"):
            with _open_table(path, kind) as (schema, _):
                for key in json_keys:
                    _column_index(path, schema, key)
        elif kind != "text":
            with contextlib.closing(_lines(path, kind)) as lines:
                for lineno, (raw, _) in enumerate(lines, start=1):
                    if line := raw.decode("utf-8", errors="replace").strip():
                        for key in json_keys:
                            _json_text(path, lineno, line, key)
                        break


# ---------------------------------------------------------------- JSON Lines


def _iter_jsonl(path: str, kind: str, json_key: str) -> Iterator[tuple[str, int]]:
    """(text, bytes consumed so far) per line; blank lines give '' (e.g. a trailing newline)."""
    for lineno, (raw, pos) in enumerate(_lines(path, kind), start=1):
        line = raw.decode("utf-8", errors="replace").strip()
        yield (_json_text(path, lineno, line, json_key) if line else ""), pos


def _json_text(path: str, lineno: int, line: str, json_key: str) -> str:
    """The string at `json_key` of one JSON line, or a ValueError naming file, line and key."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(
            f"{path}: line {lineno}: expected a JSON object, got {type(obj).__name__}"
        )
    if json_key not in obj:
        keys = ", ".join(sorted(obj)[:10]) or "none"
        raise ValueError(
            f"{path}: line {lineno}: missing key {json_key!r} (keys present: {keys}); "
            "pass json_key= / --json-keys to pick another field"
        )
    value = obj[json_key]
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise ValueError(
            f"{path}: line {lineno}: value of {json_key!r} must be a string, got {got}"
        )
    return value


def _lines(path: str, kind: str) -> Iterator[tuple[bytes, int]]:
    """(raw line, compressed bytes consumed so far) for a plain, gzip or zstd JSONL file."""
    if kind == "jsonl":
        pos = 0
        with open(path, "rb") as f:
            for raw in f:
                pos += len(raw)
                yield raw, pos
        return
    what = "gzip" if kind == "jsonl.gz" else "zstd"
    count = 0
    with open(path, "rb") as f:
        try:
            if kind == "jsonl.gz":
                with gzip.GzipFile(fileobj=f) as gz:
                    for raw in gz:
                        count += 1
                        yield raw, f.tell()
            else:
                for raw, pos in _split_lines(_zstd_chunks(f)):
                    count += 1
                    yield raw, pos
        except (OSError, EOFError, zlib.error, _ZstdError) as e:  # decoding, never the caller's
            raise ValueError(f"{path}: not readable as {what} after {count} line(s) "
                             f"({_why(e)}); the file is truncated or not {what} data: "
                             "re-download or re-compress it") from None


class _ZstdError(Exception):
    """Undecodable zstd data, or a stream that ends inside a frame (zstandard's own readers
    stop there silently)."""


def _zstd_chunks(f: Any) -> Iterator[tuple[bytes, int]]:
    """(decompressed bytes, compressed bytes consumed) across every frame of a .zst file."""
    zstandard = _require("zstandard", ".jsonl.zst")
    dctx = zstandard.ZstdDecompressor()
    dobj, in_frame, pos = dctx.decompressobj(), False, 0
    while chunk := f.read(_CHUNK):
        pos += len(chunk)
        while chunk:
            try:
                out = dobj.decompress(chunk)
            except zstandard.ZstdError as e:
                raise _ZstdError(str(e)) from None
            in_frame = True
            yield out, pos
            if not dobj.eof:
                break
            chunk, dobj, in_frame = dobj.unused_data, dctx.decompressobj(), False  # next frame
    if in_frame:
        raise _ZstdError("the stream ends inside a frame")


def _split_lines(chunks: Iterator[tuple[bytes, int]]) -> Iterator[tuple[bytes, int]]:
    """Lines (with their newline) out of byte chunks; a long line is joined once, not re-copied."""
    parts: list[bytes] = []
    pos = 0
    for data, pos in chunks:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            parts.append(data[start : end + 1])
            yield b"".join(parts), pos
            parts, start = [], end + 1
        if start < len(data):
            parts.append(data[start:])
    if parts:
        yield b"".join(parts), pos


# ---------------------------------------------------------------- Parquet and Arrow


def _iter_table(path: str, kind: str, key: str) -> Iterator[tuple[str, int]]:
    """(text, on-disk bytes read so far) per row of column `key`, one record batch at a time."""
    pa = _require("pyarrow", f".{kind}")
    row = 0
    with _open_table(path, kind, key) as (schema, batches):
        # Parquet batches hold the one column read; Arrow batches every column.
        index = _column_index(path, schema, key) if kind == "arrow" else 0
        try:
            for batch, pos in batches:
                column = batch.column(index)
                values = column.to_pylist()
                if column.null_count:
                    bad = row + values.index(None)
                    raise ValueError(f"{path}: row {bad} (0-based): value of {key!r} must be a "
                                     "string, got null; drop or fill the empty rows first")
                for text in values:  # bytes so far: the batch's first row counts them all
                    yield text, pos
                row += len(values)
        except (pa.ArrowException, OSError) as e:  # a damaged page or batch (ours: ValueError)
            raise ValueError(f"{path}: not readable as {_NAMES[kind]} after {row} row(s) "
                             f"({_why(e)}); the file is truncated or damaged: re-download or "
                             "re-create it") from None


@contextlib.contextmanager
def _open_table(
    path: str, kind: str, key: str | None = None
) -> Iterator[tuple[Any, Iterator[tuple[Any, int]]]]:
    """(schema, iterator of (record batch, on-disk bytes read so far)) of a Parquet / Arrow file.

    With `key`, Parquet batches hold that column only (no other is read). A file that does not
    open as Parquet / Arrow raises ValueError naming it.
    """
    pa = _require("pyarrow", f".{kind}")
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            source = pq.ParquetFile(path)
            schema, batches = source.schema_arrow, _parquet_batches(path, source, key)
        else:
            # Memory-mapped: batches point into the page cache, nothing is copied into RAM.
            source = pa.memory_map(path)
            is_file_format = source.read(6) == b"ARROW1"  # else the stream format (save_to_disk)
            source.seek(0)
            reader = (pa.ipc.open_file if is_file_format else pa.ipc.open_stream)(source)
            schema, batches = reader.schema, _arrow_batches(reader, source, is_file_format)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable {_NAMES[kind]} file ({_why(e)}); the file is "
                         "truncated or damaged: re-download or re-create it") from None
    try:
        yield schema, batches
    finally:
        source.close()


def _parquet_batches(path: str, source: Any, key: str | None) -> Iterator[tuple[Any, int]]:
    if key is None:
        return
    _column_index(path, source.schema_arrow, key)  # before iter_batches, whose error is vaguer
    rows, size, done = max(source.metadata.num_rows, 1), os.path.getsize(path), 0
    for batch in source.iter_batches(batch_size=_ROWS, columns=[key]):
        done += batch.num_rows
        yield batch, size * done // rows


def _arrow_batches(reader: Any, source: Any, is_file_format: bool) -> Iterator[tuple[Any, int]]:
    if is_file_format:  # random access behind a footer: progress by batch count
        n, size = reader.num_record_batches, source.size()
        for i in range(n):
            yield reader.get_batch(i), size * (i + 1) // n
    else:
        for batch in reader:
            yield batch, source.tell()


def _column_index(path: str, schema: Any, key: str) -> int:
    """The index of string column `key` in `schema`, or a ValueError that lists the columns."""
    import pyarrow as pa

    if key not in schema.names:
        shown = ", ".join(schema.names[:20]) or "none"
        raise ValueError(f"{path}: no column {key!r} (columns: {shown}); pass json_key= / "
                         "--json-keys to pick another column")
    if (count := schema.names.count(key)) > 1:
        raise ValueError(f"{path}: column {key!r} appears {count} times; rename the duplicates "
                         "in the file")
    field = schema.field(key)
    base = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
    is_text = (pa.types.is_string(base) or pa.types.is_large_string(base)
               or getattr(pa.types, "is_string_view", lambda _: False)(base))
    if not is_text:
        raise ValueError(f"{path}: column {key!r} has type {field.type}, not string; pass "
                         "json_key= / --json-keys with a text column")
    return schema.get_field_index(key)


def _why(err: BaseException) -> str:
    """An exception's text on one line (pyarrow's can span several)."""
    return " ".join(str(err).split()) or type(err).__name__


def _require(module: str, suffix: str) -> Any:
    """Import an optional reader library, or say how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"reading {suffix} files needs the {module} package, which is not "
                         f"installed: pip install {module}") from None
