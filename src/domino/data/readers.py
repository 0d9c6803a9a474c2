"""Stream documents out of the files `domino preprocess` reads.

Text files (one document each), JSON Lines (plain, gzip or zstd; one document per line) and
Parquet / Arrow tables (one document per row). Everything is read incrementally: lines from a
decompressing stream, tables in record batches of the one column asked for, so memory stays
flat whatever the file size. One record (a JSON line, a text file) may hold at most
``max_record_bytes`` (default ``MAX_RECORD_BYTES``, 256 MiB): a longer one is refused rather than
read into memory. Each document comes with the on-disk bytes consumed to reach it, which add up
to the file's size: the progress bar counts those.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import stat
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
_CHUNK = 1 << 18  # compressed bytes per read from disk
# Compressed bytes per zstd call: a zstd block of 4 bytes can expand to 128 KiB, so 256 bytes
# never give more than 8 MiB at once, whatever the data (the extra calls cost little: the
# figure is in docs/train.md).
_ZSTD_STEP = 256
MAX_RECORD_BYTES = 256 << 20  # one JSON line or text file; --max-record-bytes raises it
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
    return [_listed_file(folder, name) for name in names]


def _listed_file(folder: str, name: Any) -> str:
    """``folder/name`` for a `_data_files` entry of state.json that is a plain name of a regular
    file in ``folder``: anything else (a path that leads out, a link) is refused unopened."""
    state = os.path.join(folder, "state.json")
    plain = (isinstance(name, str) and name not in ("", ".", "..")
             and not any(c in name for c in ("/", "\\", "\0", os.sep)))
    if not plain:
        raise ValueError(f"{state}: _data_files entry {name!r} is not a plain file name in the "
                         "folder (no '..', absolute path, path separator or NUL), so it is not "
                         "read: save the dataset again with save_to_disk")
    path = os.path.join(folder, name)
    try:
        mode = os.lstat(path).st_mode  # lstat: a link is refused, never followed
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: listed in {state} but missing; save the dataset "
                                "again") from None
    if stat.S_ISLNK(mode) or not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise ValueError(f"{state}: _data_files entry {name!r} is {what}; only regular files "
                         "in the folder are read: put the file itself there or save the dataset "
                         "again with save_to_disk")
    return path


def iter_documents(
    files: Sequence[str], json_key: str = "text", max_record_bytes: int = MAX_RECORD_BYTES
) -> Iterator[tuple[str | None, int]]:
    """Yield (text, on-disk bytes read) per document: one per text file, JSON line or table row.

    Text is None for bytes read between documents (a compressed stream's trailer, a table's
    footer): they count for progress only. A JSON line or text file over ``max_record_bytes``
    raises ValueError naming it.
    """
    for path in files:
        kind = input_kind(path)
        if kind == "text":
            with open(path, "rb") as f:
                _check_text_size(path, os.fstat(f.fileno()).st_size, max_record_bytes)
                raw = f.read(max_record_bytes + 1)  # bounded even if the file grew since
            _check_text_size(path, len(raw), max_record_bytes)
            yield raw.decode("utf-8", errors="replace"), len(raw)
            continue
        reader = _iter_table(path, kind, json_key) if kind in ("parquet", "arrow") else (
            _iter_jsonl(path, kind, json_key, max_record_bytes))
        consumed = 0
        for text, pos in reader:
            yield text, pos - consumed
            consumed = pos
        if (rest := os.path.getsize(path) - consumed) > 0:
            yield None, rest


def check_inputs(
    files: Sequence[str], json_keys: Sequence[str], max_record_bytes: int = MAX_RECORD_BYTES
) -> None:
    """Fail fast, before any tokenizing: open every JSONL and table file and check `json_keys`.

    Tables: the file opens and each key is a string column. JSON Lines: the first record parses
    and holds each key as a string. Text files: the size fits ``max_record_bytes``. Later rows
    are checked as they are read.
    """
    for path in files:
        kind = input_kind(path)
        if kind == "text":
            _check_text_size(path, os.path.getsize(path), max_record_bytes)
        elif kind in ("parquet", "arrow"):
            with _open_table(path, kind) as (schema, _):
                for key in json_keys:
                    _column_index(path, schema, key)
        else:
            with contextlib.closing(_lines(path, kind, max_record_bytes)) as lines:
                for lineno, (raw, _) in enumerate(lines, start=1):
                    if line := raw.decode("utf-8", errors="replace").strip():
                        for key in json_keys:
                            _json_text(path, lineno, line, key)
                        break


def size_text(n: int) -> str:
    """``n`` bytes as people read it: '256 MiB', '1 GiB', '1000 bytes'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _too_long(path: str, where: str, limit: int) -> ValueError:
    return ValueError(f"{path}: {where} holds more than {size_text(limit)}, the limit on one "
                      "record; if it is one document, raise the limit with --max-record-bytes "
                      "(max_record_bytes= in Python), else split it")


def _check_text_size(path: str, size: int, limit: int) -> None:
    if size > limit:
        raise _too_long(path, "the file (one document)", limit)


# ---------------------------------------------------------------- JSON Lines


def _iter_jsonl(path: str, kind: str, json_key: str, limit: int) -> Iterator[tuple[str, int]]:
    """(text, bytes consumed so far) per line; blank lines give '' (e.g. a trailing newline)."""
    for lineno, (raw, pos) in enumerate(_lines(path, kind, limit), start=1):
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


def _lines(path: str, kind: str, limit: int = MAX_RECORD_BYTES) -> Iterator[tuple[bytes, int]]:
    """(raw line, compressed bytes consumed so far) for a plain, gzip or zstd JSONL file.

    No line longer than ``limit`` bytes (its newline aside) is ever held: ValueError instead."""
    if kind == "jsonl":
        pos = 0
        with open(path, "rb") as f:
            for raw in _bounded_lines(f, path, limit):
                pos += len(raw)
                yield raw, pos
        return
    what = "gzip" if kind == "jsonl.gz" else "zstd"
    count = 0
    with open(path, "rb") as f:
        try:
            if kind == "jsonl.gz":
                with gzip.GzipFile(fileobj=f) as gz:
                    for raw in _bounded_lines(gz, path, limit):
                        count += 1
                        yield raw, f.tell()
            else:
                for raw, pos in _split_lines(_zstd_chunks(f), path, limit):
                    count += 1
                    yield raw, pos
        except (OSError, EOFError, zlib.error, _ZstdError) as e:  # decoding, never the caller's
            raise ValueError(f"{path}: not readable as {what} after {count} line(s) "
                             f"({_why(e)}); the file is truncated or not {what} data: "
                             "re-download or re-compress it") from None


def _bounded_lines(stream: Any, path: str, limit: int) -> Iterator[bytes]:
    """The lines of a binary stream, each read with readline(limit + 1): never more in memory."""
    lineno = 0
    while raw := stream.readline(limit + 1):
        lineno += 1
        if len(raw) - raw.endswith(b"\n") > limit:
            raise _too_long(path, f"line {lineno}", limit)
        yield raw


class _ZstdError(Exception):
    """Undecodable zstd data, or a stream that ends inside a frame (zstandard's own readers
    stop there silently)."""


def _zstd_chunks(f: Any) -> Iterator[tuple[bytes, int]]:
    """(decompressed bytes, compressed bytes consumed) across every frame of a .zst file."""
    zstandard = _require("zstandard", ".jsonl.zst")
    dctx = zstandard.ZstdDecompressor()
    dobj, in_frame, pos = dctx.decompressobj(), False, 0
    while chunk := f.read(_CHUNK):
        view = memoryview(chunk)
        for start in range(0, len(view), _ZSTD_STEP):  # small steps: bounded output per call
            piece = view[start : start + _ZSTD_STEP]
            done = pos + start + len(piece)
            while piece:
                try:
                    out = dobj.decompress(piece)
                except zstandard.ZstdError as e:
                    raise _ZstdError(str(e)) from None
                in_frame = True
                yield out, done
                if not dobj.eof:
                    break
                piece, dobj, in_frame = dobj.unused_data, dctx.decompressobj(), False  # next
        pos += len(chunk)
    if in_frame:
        raise _ZstdError("the stream ends inside a frame")


def _split_lines(
    chunks: Iterator[tuple[bytes, int]], path: str, limit: int
) -> Iterator[tuple[bytes, int]]:
    """Lines (with their newline) out of byte chunks; a long line is joined once, not re-copied,
    and one over ``limit`` bytes is refused as soon as its held part passes the limit."""
    parts: list[bytes] = []
    pos = held = lineno = 0
    for data, pos in chunks:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            lineno += 1
            if held + end - start > limit:
                raise _too_long(path, f"line {lineno}", limit)
            parts.append(data[start : end + 1])
            yield b"".join(parts), pos
            parts, held, start = [], 0, end + 1
        if start < len(data):
            held += len(data) - start
            if held > limit:
                raise _too_long(path, f"line {lineno + 1}", limit)
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
