"""`domino preprocess` on compressed JSONL, Parquet and Arrow: the same bytes as plain JSONL."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import tracemalloc
import zlib

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

from domino.cli import main  # noqa: E402
from domino.data import BPETokenizer, ByteTokenizer, IndexedDataset, preprocess  # noqa: E402
from domino.data.preprocess import collect_files  # noqa: E402
from domino.data.readers import iter_documents  # noqa: E402

# Non-ASCII, quotes, tabs, newlines and empty documents: what JSON escapes and tables do not.
ROWS = [{"id": i, "title": f"title {i}",
         "text": "" if i % 37 == 5 else f"doc {i}: héllo \"wörld\" 日本 🙂\n" + "ab\tc " * (i % 9)}
        for i in range(300)]
SUFFIXES = (".bin", ".idx", ".json")


def _table(rows=ROWS):
    return pa.table({k: [r[k] for r in rows] for k in ("id", "title", "text")})


def _jsonl_bytes(rows=ROWS) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def _write_arrow(path, table, stream: bool) -> None:
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with new(str(path), table.schema) as w:
        for batch in table.to_batches(max_chunksize=64):
            w.write_batch(batch)


def _save_to_disk_folder(path, rows=ROWS, shards: int = 2) -> None:
    """The layout `datasets.Dataset.save_to_disk` writes: stream-format shards + state.json."""
    path.mkdir()
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    step = -(-len(rows) // shards)
    for i, name in enumerate(names):
        _write_arrow(path / name, _table(rows[i * step:(i + 1) * step]), stream=True)
    (path / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": None}))
    (path / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))


def _write(kind: str, folder) -> str:
    """One file (or folder) of kind `kind` holding ROWS; its path."""
    body = _jsonl_bytes()
    path = folder / f"rows.{kind}"
    if kind == "jsonl":
        path.write_bytes(body)
    elif kind == "jsonl.gz":
        path.write_bytes(gzip.compress(body))
    elif kind == "jsonl.zst":  # two frames: a stream concatenated from two writers
        half = body.index(b"\n", len(body) // 2) + 1
        z = zstandard.ZstdCompressor()
        path.write_bytes(z.compress(body[:half]) + z.compress(body[half:]))
    elif kind == "parquet":
        pq.write_table(_table(), path, row_group_size=100)
    elif kind in ("file.arrow", "stream.arrow"):
        _write_arrow(path, _table(), stream=kind == "stream.arrow")
    else:
        path = folder / "saved"
        _save_to_disk_folder(path)
    return str(path)


KINDS = ("jsonl.gz", "jsonl.zst", "parquet", "file.arrow", "stream.arrow", "save_to_disk")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The dataset of ROWS' texts through a plain .jsonl file."""
    folder = tmp_path_factory.mktemp("ref")
    stats = preprocess([_write("jsonl", folder)], folder / "ref", ByteTokenizer(), progress=False)
    assert stats.documents == sum(1 for r in ROWS if r["text"]) and stats.empty_skipped > 0
    return {s: (folder / f"ref{s}").read_bytes() for s in SUFFIXES}


@pytest.mark.parametrize("kind", KINDS)
def test_each_input_gives_the_jsonl_bytes(tmp_path, reference, kind) -> None:
    path = _write(kind, tmp_path)
    stats = preprocess([path], tmp_path / "out", ByteTokenizer(), progress=False)
    for s in SUFFIXES:
        assert (tmp_path / f"out{s}").read_bytes() == reference[s], s
    # The progress bar's total is the files' size on disk; what was read adds up to it.
    files = collect_files([path])
    assert stats.bytes == sum(os.path.getsize(f) for f in files) and stats.files == len(files)
    # ... and only ever grows: tables read in several batches count each batch once.
    steps = [size for _, size in iter_documents(files)]
    assert min(steps) >= 0 and sum(steps) == stats.bytes
    if kind in ("file.arrow", "stream.arrow"):  # 64-row batches
        assert sum(1 for s in steps if s > 0) > 1


def test_all_inputs_together_with_workers(tmp_path) -> None:
    paths = [_write(kind, tmp_path) for kind in KINDS]
    ref_files = []
    for i in range(len(paths)):
        (tmp_path / f"copy{i}.jsonl").write_bytes(_jsonl_bytes())
        ref_files.append(tmp_path / f"copy{i}.jsonl")
    preprocess(ref_files, tmp_path / "ref", ByteTokenizer(), progress=False)
    preprocess(paths, tmp_path / "par", ByteTokenizer(), workers=2, progress=True)
    for s in SUFFIXES:
        assert (tmp_path / f"par{s}").read_bytes() == (tmp_path / f"ref{s}").read_bytes(), s


def test_cli_keys_bpe_and_folders(tmp_path, capsys) -> None:
    jsonl, parquet = _write("jsonl", tmp_path), _write("parquet", tmp_path)
    # Several keys from a table: one dataset per column, as for JSONL.
    for name, src in (("j", jsonl), ("p", parquet)):
        assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / name),
                     "--json-keys", "text", "title", "--no-progress"]) == 0
    for key in ("text", "title"):
        for s in SUFFIXES:
            assert ((tmp_path / f"p_{key}_document{s}").read_bytes()
                    == (tmp_path / f"j_{key}_document{s}").read_bytes())
    # The BPE learns from the texts, not the file's bytes: the same vocabulary from both.
    for name, src in (("jb", jsonl), ("pb", parquet)):
        assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / name),
                     "--tokenizer-type", "bpe", "--train-bpe-vocab-size", "300",
                     "--no-progress"]) == 0
    hashes = {BPETokenizer.load(tmp_path / f"{n}_tokenizer").vocab_hash() for n in ("jb", "pb")}
    assert len(hashes) == 1
    assert (tmp_path / "pb.bin").read_bytes() == (tmp_path / "jb.bin").read_bytes()
    capsys.readouterr()
    # A folder walk reads a save_to_disk folder's shards in order, never its metadata .json.
    tree = tmp_path / "tree"
    tree.mkdir()
    _save_to_disk_folder(tree / "saved", shards=3)
    assert collect_files([tree]) == [str(tree / "saved" / f"data-0000{i}-of-00003.arrow")
                                     for i in range(3)]
    preprocess([tree], tmp_path / "tree_out", ByteTokenizer(), progress=False)
    assert ((tmp_path / "tree_out.bin").read_bytes()
            == (tmp_path / "j_text_document.bin").read_bytes())


def _null_row(path):
    rows = [dict(r) for r in ROWS]
    rows[123]["text"] = None
    pq.write_table(_table(rows), path)


def _damage(kind: str, keep: float):
    def make(path):
        src = _write(kind, path.parent)
        data = open(src, "rb").read()
        path.write_bytes(data[: int(len(data) * keep)])
    return make


BAD = [
    ("a.parquet", lambda p: pq.write_table(pa.table({"body": ["x"], "id": [1]}), p),
     r"a\.parquet: no column 'text' \(columns: body, id\); pass json_key= / --json-keys"),
    ("a.arrow", lambda p: _write_arrow(p, pa.table({"text": [1, 2]}), stream=True),
     r"a\.arrow: column 'text' has type int64, not string"),
    ("a.parquet", _null_row,
     r"a\.parquet: row 123 \(0-based\): value of 'text' must be a string, got null"),
    ("a.jsonl.gz", lambda p: p.write_bytes(gzip.compress(b'{"text": "a"}\n{"text": 5}\n')),
     r"a\.jsonl\.gz: line 2: value of 'text' must be a string, got int"),
    ("a.jsonl.zst", lambda p: p.write_bytes(b'{"text": "not compressed"}\n'),
     r"a\.jsonl\.zst: not readable as zstd after 0 line\(s\) \(.*Unknown frame descriptor\)"),
    ("a.jsonl.gz", _damage("jsonl.gz", 0.6),
     r"a\.jsonl\.gz: not readable as gzip after \d+ line\(s\) .*truncated"),
    ("a.jsonl.zst", _damage("jsonl.zst", 0.3),
     r"a\.jsonl\.zst: not readable as zstd after \d+ line\(s\) \(the stream ends inside a frame"),
    ("a.parquet", _damage("parquet", 0.9),
     r"a\.parquet: not a readable Parquet file \(Parquet magic bytes not found"),
    ("a.arrow", _damage("stream.arrow", 0.5),
     r"a\.arrow: not readable as Arrow after \d+ row\(s\) .*re-download"),
]


@pytest.mark.parametrize("name,make,match", BAD,
                         ids=[f"{m[0][2:]}-{i}" for i, m in enumerate(BAD)])
def test_bad_inputs_name_file_row_and_field(tmp_path, name, make, match) -> None:
    path = tmp_path / name
    make(path)
    (tmp_path / "out.bin").write_bytes(b"keep")  # an older dataset must survive a failed run
    with pytest.raises(ValueError, match=match):
        preprocess([path], tmp_path / "out", ByteTokenizer(), workers=2, progress=False)
    assert (tmp_path / "out.bin").read_bytes() == b"keep"
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_errors_come_before_any_work(tmp_path, capsys, monkeypatch) -> None:
    good = _write("parquet", tmp_path)
    bad = tmp_path / "z.parquet"
    pq.write_table(pa.table({"body": ["x"]}), bad)
    mod = importlib.import_module("domino.data.preprocess")  # the attribute is the function

    def no_pool(*args, **kwargs):
        raise AssertionError("a worker pool started before the inputs were checked")

    monkeypatch.setattr(mod.mp, "get_context", no_pool)
    with pytest.raises(ValueError, match=r"z\.parquet: no column 'text'"):
        preprocess([good, bad], tmp_path / "o", ByteTokenizer(), workers=2, progress=False)
    # Through the command: the second key is checked before the first is tokenized (or a
    # BPE trained), and nothing is left behind.
    rc = main(["preprocess", "--input", good, "--output-prefix", str(tmp_path / "x" / "y"),
               "--json-keys", "text", "body", "--tokenizer-type", "bpe",
               "--train-bpe-vocab-size", "300", "--no-progress"])
    err = capsys.readouterr()
    assert rc == 2 and "no column 'body' (columns: id, title, text)" in err.err
    assert "training" not in err.out and not (tmp_path / "x").exists()
    # A DatasetDict folder: pick a split rather than mixing them.
    dd = tmp_path / "dd"
    dd.mkdir()
    _save_to_disk_folder(dd / "train")
    (dd / "dataset_dict.json").write_text('{"splits": ["train"]}')
    rc = main(["preprocess", "--input", str(dd), "--output-prefix", str(tmp_path / "d")])
    assert rc == 2 and f"pass one split's folder, e.g. {dd / 'train'}" in capsys.readouterr().err


# ---------------------------------------------------------------- the limit on one record


def _long_line(path, kind: str, size: int, before: bytes = b"", after: bytes = b"") -> None:
    """A JSONL file whose one record holds ``size`` bytes of text, compressed as it is written
    (never held whole), between the lines ``before`` and ``after``."""
    comp = (zlib.compressobj(wbits=31) if kind == "jsonl.gz"
            else zstandard.ZstdCompressor().compressobj() if kind == "jsonl.zst" else None)
    with open(path, "wb") as f:
        put = f.write if comp is None else (lambda b: f.write(comp.compress(b)))
        put(before + b'{"text": "')
        for done in range(0, size, 1 << 20):
            put(b"a" * min(1 << 20, size - done))
        put(b'"}\n' + after)
        if comp is not None:
            f.write(comp.flush())


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "jsonl.zst"])
def test_a_record_over_the_limit_is_refused(tmp_path, capsys, kind) -> None:
    path = tmp_path / f"big.{kind}"
    _long_line(path, kind, 200 << 10, before=b'{"text": "short"}\n', after=b'{"text": "x"}\n')
    out = str(tmp_path / "out")
    rc = main(["preprocess", "--input", str(path), "--output-prefix", out,
               "--max-record-bytes", "64K", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("domino preprocess: error: ")
    assert f"{path}: line 2 holds more than 64 KiB, the limit on one record" in err
    assert "--max-record-bytes" in err and os.listdir(tmp_path) == [path.name]
    # Raised past the record, the same file reads.
    assert main(["preprocess", "--input", str(path), "--output-prefix", out,
                 "--max-record-bytes", "1M", "--no-progress"]) == 0
    assert [len(d) for d in IndexedDataset(out)] == [6, (200 << 10) + 1, 2]


def test_a_text_file_over_the_limit_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "a.txt").write_bytes(b"x" * 2048)
    rc = main(["preprocess", "--input", str(tmp_path / "a.txt"), "--output-prefix",
               str(tmp_path / "o"), "--max-record-bytes", "1024"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{tmp_path / 'a.txt'}: the file (one document) holds more than 1 KiB" in err
    assert main(["preprocess", "--input", str(tmp_path / "a.txt"), "--output-prefix",
                 str(tmp_path / "o"), "--max-record-bytes", "0"]) == 2
    assert "--max-record-bytes='0' is not a size" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["jsonl.gz", "jsonl.zst"])
def test_a_long_compressed_line_never_takes_more_memory_than_the_limit(tmp_path, kind) -> None:
    """32 MiB in one line (a few KB compressed) with a 64 KiB limit: refused, having held a few
    MiB at most (zstd: one call's output, 8 MiB at worst), never the line."""
    path = tmp_path / f"big.{kind}"
    _long_line(path, kind, 32 << 20)
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"line 1 holds more than 64 KiB"):
            for _ in iter_documents([str(path)], max_record_bytes=64 << 10):
                pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak


def test_the_default_limit_is_the_documented_one() -> None:
    import argparse
    import re
    from pathlib import Path

    from domino.commands.preprocess import _byte_count, add_arguments
    from domino.data.readers import MAX_RECORD_BYTES

    docs = (Path(__file__).resolve().parents[1] / "docs" / "train.md").read_text()
    documented = re.search(r"`--max-record-bytes`[^.]*?\(default (\d+) MiB\)", docs)
    assert documented, "docs/train.md names the default of --max-record-bytes"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = parser.parse_args(["--input", "x", "--output-prefix", "y"]).max_record_bytes
    assert _byte_count(default) == MAX_RECORD_BYTES == int(documented.group(1)) << 20
