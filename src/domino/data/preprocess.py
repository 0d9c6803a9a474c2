"""Turn text files, folders, JSONL, Parquet and Arrow into an MMIDIDX token dataset."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fnmatch
import glob
import multiprocessing as mp
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from domino.data.indexed_dataset import (
    IndexedDatasetBuilder,
    best_dtype,
    data_path,
    index_path,
    meta_path,
)
from domino.data.readers import (
    DATA_PATTERNS,
    MAX_RECORD_BYTES,
    check_inputs,
    iter_documents,
    saved_dataset_files,
)
from domino.data.tokenizer import Tokenizer

DEFAULT_PATTERNS: tuple[str, ...] = ("*.txt", "*.md", "*.rst", "*.py", *DATA_PATTERNS)
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}
_BATCH_BYTES = 1 << 20  # ~1 MB of text per tokenizer call: big enough to amortise, small for RAM


@dataclass
class PreprocessStats:
    """What `preprocess` wrote."""

    output_prefix: str
    files: int
    documents: int
    tokens: int
    bytes: int
    empty_skipped: int


def collect_files(
    inputs: Sequence[str | os.PathLike], patterns: Sequence[str] | None = None
) -> list[str]:
    """Expand files, folders (recursive, filtered by `patterns`) and globs into a file list.

    Explicit files are always kept; folder contents must match one of `patterns`
    (default `DEFAULT_PATTERNS`). Hidden entries and `__pycache__` are skipped. A folder written
    by `datasets`' `save_to_disk` gives its .arrow files in the order its state.json lists.
    """
    pats = tuple(patterns) if patterns else DEFAULT_PATTERNS
    out: list[str] = []
    for item in inputs:
        path = os.fspath(item)
        if os.path.isfile(path):
            out.append(path)
        elif os.path.isdir(path):
            out.extend(_walk(path, pats))
        elif glob.has_magic(path):
            for hit in sorted(glob.glob(path, recursive=True)):
                out.extend([hit] if os.path.isfile(hit) else _walk(hit, pats))
        else:
            raise FileNotFoundError(f"input path does not exist: {path}")
    return list(dict.fromkeys(out))  # drop duplicates, keep order


def _walk(root: str, patterns: Sequence[str], skip: set[str] = _SKIP_DIRS) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending; sorting makes output deterministic.
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        if "state.json" in filenames or "dataset_dict.json" in filenames:
            saved = saved_dataset_files(dirpath)
            if saved is not None:  # its .json files are metadata, not documents
                found.extend(f for f in saved
                             if any(fnmatch.fnmatch(os.path.basename(f), p) for p in patterns))
                dirnames[:] = []
                continue
        for name in sorted(filenames):
            if not name.startswith(".") and any(fnmatch.fnmatch(name, p) for p in patterns):
                found.append(os.path.join(dirpath, name))
    return found


def _batches(docs: Iterator[tuple[str | None, int]]) -> Iterator[tuple[list[str], int, int]]:
    """Group documents into (non-empty texts, bytes, empty count) batches of ~_BATCH_BYTES."""
    texts: list[str] = []
    nbytes = empty = 0
    for text, size in docs:
        nbytes += size
        if text:
            texts.append(text)
        elif text is not None:  # None: bytes between documents (e.g. a compressed trailer)
            empty += 1
        if nbytes >= _BATCH_BYTES or len(texts) >= 4096:
            yield texts, nbytes, empty
            texts, nbytes, empty = [], 0, 0
    if texts or nbytes or empty:
        yield texts, nbytes, empty


# Set once in each pool worker process by its initializer: a Pool hands work functions only their
# arguments, and shipping the tokenizer with every batch would re-pickle it per call.
_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    # Processes already give the parallelism; a Rust thread pool per worker would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = tokenizer


def _encode_in_worker(texts: list[str]) -> list[list[int]]:
    assert _WORKER_TOKENIZER is not None
    return _WORKER_TOKENIZER.encode_batch(texts)


def preprocess(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    tokenizer: Tokenizer,
    json_key: str = "text",
    append_eod: bool = True,
    workers: int = 1,
    progress: bool = True,
    patterns: Sequence[str] | None = None,
    checked: bool = False,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> PreprocessStats:
    """Tokenize `inputs` into `output_prefix.{bin,idx,json}`, replacing a dataset there.

    One document per text file, JSON line (.jsonl/.json, also gzip- or zstd-compressed) or
    Parquet/Arrow row; `json_key` names the field or column. Every JSONL and table file is
    checked for it before tokenizing starts (``checked``: the caller already ran
    :func:`~domino.data.readers.check_inputs` on these files). A line or text file over
    ``max_record_bytes`` is refused. An output that is one of the inputs is refused. Writes
    into a staging folder first, so a failed run never clobbers an existing dataset.
    """
    files = collect_files(inputs, patterns)
    if not files:
        shown = ", ".join(map(os.fspath, inputs)) or "(nothing)"
        pats = ", ".join(patterns or DEFAULT_PATTERNS)
        raise ValueError(f"no input files found in {shown} (folder patterns: {pats})")
    prefix = os.fspath(output_prefix)
    check_not_inputs(files, dataset_files(prefix))
    if not checked:
        check_inputs(files, [json_key], max_record_bytes)
    folder = os.path.dirname(prefix) or "."
    os.makedirs(folder, exist_ok=True)
    with staging(folder) as tmp:
        staged = os.path.join(tmp, "dataset")
        stats = write_dataset(files, staged, tokenizer, json_key, append_eod=append_eod,
                              workers=workers, progress=progress,
                              max_record_bytes=max_record_bytes)
        commit(list(zip(dataset_files(staged), dataset_files(prefix))))
    return dataclasses.replace(stats, output_prefix=prefix)


def dataset_files(prefix: str | os.PathLike) -> list[str]:
    """The files of the dataset at ``prefix``: .bin, .idx and the .json sidecar."""
    return [path_of(prefix) for path_of in (data_path, index_path, meta_path)]


def check_not_inputs(inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """Refuse to write an output that is one of ``inputs``: the same file however reached (a
    link, a hard link, a folder's walk), which writing it would destroy."""
    existing = [out for out in outputs if os.path.lexists(out)]
    if not existing:
        return
    ids: dict[tuple[int, int], str] = {}
    for path in inputs:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            ids.setdefault((st.st_dev, st.st_ino), path)
    for out in existing:
        try:
            st = os.stat(out)
        except OSError:  # a dangling link: no input behind it
            continue
        if (src := ids.get((st.st_dev, st.st_ino))) is not None:
            same = "" if os.path.abspath(src) == os.path.abspath(out) else f" (as {src})"
            raise ValueError(f"{out} is also an input{same}: writing it would destroy what the "
                             "dataset is made from, so it is refused even with --overwrite; "
                             "write the dataset outside its inputs (another --output-prefix)")


@contextlib.contextmanager
def staging(folder: str | os.PathLike) -> Iterator[str]:
    """A new private folder in ``folder`` for outputs until all of them are written; removed with
    whatever is left in it. mkdtemp makes it exclusively (mode 0700): no name in it is a link."""
    tmp = tempfile.mkdtemp(prefix=".domino-preprocess-", dir=folder)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def commit(moves: Sequence[tuple[str, str]], overwrite: bool = True) -> None:
    """Rename each staged (source, destination) into place: a rename replaces a link at the
    destination, never writes through it. Without ``overwrite``, an existing destination (one
    made while this run worked) fails the whole commit before anything moves."""
    if not overwrite:
        for _, dst in moves:
            if os.path.lexists(dst):
                raise ValueError(f"{dst} appeared while the dataset was written; pass "
                                 "--overwrite to replace it, or another --output-prefix")
    for src, dst in moves:
        os.replace(src, dst)


def write_dataset(
    files: Sequence[str],
    prefix: str,
    tokenizer: Tokenizer,
    json_key: str = "text",
    *,
    append_eod: bool = True,
    workers: int = 1,
    progress: bool = True,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> PreprocessStats:
    """Tokenize the (checked) ``files`` into new files ``prefix.{bin,idx,json}`` (created with
    O_EXCL: meant for a :func:`staging` folder, which the caller removes on failure)."""
    total_bytes = sum(os.path.getsize(f) for f in files)
    docs = tokens = nbytes = empty = 0
    bar = tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress
    )
    pool = None
    # EOD after each document, unless the tokenizer's own encoding ends with it already.
    tail = [tokenizer.eod] if append_eod and not tokenizer.appends_eod else []
    with IndexedDatasetBuilder(prefix, best_dtype(tokenizer.vocab_size), exclusive=True) as out:
        try:
            batches = _batches(iter_documents(files, json_key, max_record_bytes))
            if workers > 1:
                # spawn: safe with threaded parents (torch, tokenizers' rayon pool) on every OS.
                pool = mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer,))
                encoded = _ordered_parallel(pool, batches, 2 * workers)
            else:
                encoded = ((tokenizer.encode_batch(t), b, e) for t, b, e in batches)
            for ids_list, size, n_empty in encoded:
                for ids in ids_list:
                    ids = [*ids, *tail]
                    if not ids:
                        n_empty += 1
                        continue
                    out.add_document(np.asarray(ids, dtype=np.int64))
                    docs += 1
                    tokens += len(ids)
                nbytes += size
                empty += n_empty
                bar.update(size)
                bar.set_postfix(docs=docs, tokens=tokens, refresh=False)
        finally:
            bar.close()
            if pool is not None:
                pool.terminate()
        if docs == 0:
            raise ValueError(
                f"all {empty} documents in {len(files)} input file(s) are empty; nothing to write"
            )
        out.finalize(metadata={"format": "MMIDIDX", "tokenizer": tokenizer.describe(),
                               "documents": docs, "tokens": tokens, "append_eod": append_eod})
    return PreprocessStats(prefix, len(files), docs, tokens, nbytes, empty)


def _ordered_parallel(
    pool: mp.pool.Pool, batches: Iterator[tuple[list[str], int, int]], max_pending: int
) -> Iterator[tuple[list[list[int]], int, int]]:
    """Encode batches in `pool`, yielding in input order with bounded memory.

    The input iterator is consumed here, in the caller's thread, so malformed-input
    errors surface directly instead of from inside the pool.
    """
    pending: collections.deque = collections.deque()
    for texts, size, empty in batches:
        pending.append((pool.apply_async(_encode_in_worker, (texts,)), size, empty))
        if len(pending) >= max_pending:
            res, s, e = pending.popleft()
            yield res.get(), s, e
    while pending:
        res, s, e = pending.popleft()
        yield res.get(), s, e


def stdlib_corpus_files(limit_bytes: int | None = None) -> list[str]:
    """The Python standard library's own .py files: a corpus present on every machine.

    Skips site-packages, test folders and `__pycache__`; sorted for determinism. With
    `limit_bytes`, keeps the longest sorted prefix whose total size fits the limit.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = _walk(root, ("*.py",), skip=_SKIP_DIRS | {"test", "tests", "idle_test"})
    files.sort(key=lambda p: os.path.relpath(p, root))
    if limit_bytes is None:
        return files
    out: list[str] = []
    total = 0
    for path in files:
        size = os.path.getsize(path)
        if total + size > limit_bytes:
            break
        out.append(path)
        total += size
    return out
