"""`domino preprocess` reads only inside what it is given and never loses data: a save_to_disk
folder's state.json cannot lead it outside the folder, an existing dataset is replaced only with
--overwrite and never when it is an input, and a refused or failed run leaves nothing behind."""

from __future__ import annotations

import builtins
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from domino.cli import main
from domino.data import ByteTokenizer, IndexedDataset

SUFFIXES = (".bin", ".idx", ".json")


def _refused(capsys) -> str:
    """The one line a refusal prints (exit 2 is checked by the caller)."""
    err = capsys.readouterr().err
    assert err.startswith("domino preprocess: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def _preprocess(*args: str) -> int:
    return main(["preprocess", *args, "--no-progress"])


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target, a folder's marker."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, folder)] = (
                "link:" + os.readlink(path) if os.path.islink(path)
                else "dir" if os.path.isdir(path) else Path(path).read_bytes())
    return out


# ---------------------------------------------------------------- state.json names (fault 1)


@pytest.fixture
def touched(monkeypatch) -> list[tuple[str, str]]:
    """(function, absolute normalised path) of every open, stat and lstat from now on, and of
    pyarrow's memory_map / ParquetFile when pyarrow is installed."""
    seen: list[tuple[str, str]] = []

    def spy(name: str, real: Callable) -> Callable:
        def wrapper(path, *args, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)):
                seen.append((name, os.path.normpath(os.path.abspath(os.fsdecode(path)))))
            return real(path, *args, **kwargs)
        return wrapper

    owners: list[tuple[object, str]] = [(builtins, "open"), (os, "open"), (os, "stat"),
                                        (os, "lstat")]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        owners += [(pa, "memory_map"), (pq, "ParquetFile")]
    except ImportError:
        pass
    for owner, name in owners:
        monkeypatch.setattr(owner, name, spy(name, getattr(owner, name)))
    return seen


def _saved_folder(tmp_path: Path, entries: list) -> Path:
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": e} for e in entries], "_fingerprint": "0", "_split": None}))
    return saved


OUTSIDE_NOTES = object()  # stands for the absolute path of outside/notes.txt
ESCAPES = [
    ("../outside/notes.txt", "is not a plain file name"),
    (OUTSIDE_NOTES, "is not a plain file name"),
    ("sub/../../outside/notes.txt", "is not a plain file name"),
    ("..\\outside\\notes.txt", "is not a plain file name"),
    ("notes.txt\x00.arrow", "is not a plain file name"),
    ("..", "is not a plain file name"),
    (5, "is not a plain file name"),
    ("data-00000-of-00001.arrow", "is a symbolic link"),  # planted below: a link to outside
]


@pytest.mark.parametrize("entry,rule", ESCAPES,
                         ids=["dotdot", "absolute", "sub-dotdot", "backslash", "nul", "parent",
                              "not-str", "symlink"])
def test_state_json_cannot_lead_outside_the_folder(tmp_path, capsys, touched, entry,
                                                   rule) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("secret notes\n")
    entry = str(outside / "notes.txt") if entry is OUTSIDE_NOTES else entry
    saved = _saved_folder(tmp_path, ["data-00000-of-00002.arrow", entry])
    (saved / "data-00000-of-00002.arrow").write_bytes(b"")  # the one honest entry
    link = saved / "data-00000-of-00001.arrow"
    if entry == link.name:
        link.symlink_to(outside / "notes.txt")
    touched.clear()

    rc = _preprocess("--input", str(saved), "--output-prefix", str(tmp_path / "out"))

    err = _refused(capsys)
    assert rc == 2
    assert f"{saved / 'state.json'}: _data_files entry {entry!r} {rule}" in err
    forbidden = os.path.abspath(outside)
    assert [p for _, p in touched if p == forbidden or p.startswith(forbidden + os.sep)] == []
    assert [fn for fn, p in touched if p == str(link) and fn != "lstat"] == []  # not followed
    assert sorted(os.listdir(tmp_path)) == ["outside", "saved"]  # no output


def test_state_json_plain_names_still_read(tmp_path, capsys) -> None:
    pytest.importorskip("pyarrow")
    from test_preprocess_inputs import _save_to_disk_folder

    _save_to_disk_folder(tmp_path / "saved", rows=[{"id": 1, "title": "t", "text": "hello"}],
                         shards=1)
    assert _preprocess("--input", str(tmp_path / "saved"), "--output-prefix",
                       str(tmp_path / "out")) == 0
    tok = ByteTokenizer()
    assert IndexedDataset(tmp_path / "out").get(0).tolist() == [*tok.encode("hello"), tok.eod]


# ---------------------------------------------------------------- existing outputs (fault 2)


def test_existing_dataset_is_replaced_only_with_overwrite(tmp_path, capsys) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text("first version\n")
    ds = tmp_path / "ds"
    assert _preprocess("--input", str(src), "--output-prefix", str(ds)) == 0
    before = _snapshot(tmp_path)
    src.write_text("second version\n")

    assert _preprocess("--input", str(src), "--output-prefix", str(ds)) == 2
    err = _refused(capsys)
    assert f"--output-prefix: {ds}.bin exists already" in err and "pass --overwrite" in err
    assert _snapshot(tmp_path) == {**before, "corpus.txt": b"second version\n"}

    assert _preprocess("--input", str(src), "--output-prefix", str(ds), "--overwrite") == 0
    tok = ByteTokenizer()
    assert IndexedDataset(ds).get(0).tolist() == [*tok.encode("second version\n"), tok.eod]


def test_every_output_of_the_prefix_counts(tmp_path, capsys) -> None:
    """Per-key datasets and a trained tokenizer's files need --overwrite too, each on its own."""
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"text": "alpha beta " * 50, "body": "gamma"}) + "\n")
    (tmp_path / "m_body_document.idx").write_bytes(b"keep")
    rc = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "m"),
                     "--json-keys", "text", "body")
    assert rc == 2 and f"{tmp_path / 'm_body_document.idx'} exists already" in _refused(capsys)

    (tmp_path / "b_tokenizer").mkdir()
    (tmp_path / "b_tokenizer" / "merges.txt").write_text("keep")
    rc = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "b"),
                     "--tokenizer-type", "bpe", "--train-bpe-vocab-size", "300")
    err = _refused(capsys)
    assert rc == 2 and f"--tokenizer-dir: {tmp_path / 'b_tokenizer' / 'merges.txt'}" in err
    assert sorted(os.listdir(tmp_path)) == ["b_tokenizer", "c.jsonl", "m_body_document.idx"]
    assert (tmp_path / "m_body_document.idx").read_bytes() == b"keep"
    assert os.listdir(tmp_path / "b_tokenizer") == ["merges.txt"]


def test_an_output_that_is_an_input_is_refused_even_with_overwrite(tmp_path, capsys) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some text\n")
    ds = tmp_path / "ds"
    assert _preprocess("--input", str(data), "--output-prefix", str(ds)) == 0
    os.symlink(ds.with_suffix(".idx"), tmp_path / "link.txt")
    os.link(ds.with_suffix(".json"), tmp_path / "hard.txt")
    os.symlink(data / "a.txt", tmp_path / "ds2.bin")  # an output name that leads to an input
    # An input folder that holds the output: the second run would read corpus.json, its own.
    assert _preprocess("--input", str(data), "--output-prefix", str(data / "corpus")) == 0
    before = _snapshot(tmp_path)
    cases = [  # (--input, --output-prefix, the output named, the input named)
        (ds.with_suffix(".bin"), ds, f"{ds}.bin is also an input", ""),  # its own bytes
        (tmp_path / "link.txt", ds, f"{ds}.idx is also an input", "link.txt"),
        (tmp_path / "hard.txt", ds, f"{ds}.json is also an input", "hard.txt"),
        (data / "a.txt", tmp_path / "ds2", f"{tmp_path / 'ds2'}.bin is also an input", "a.txt"),
        (data, data / "corpus", f"{data / 'corpus'}.json is also an input", ""),
    ]
    for inp, prefix, output, named in cases:
        rc = _preprocess("--input", str(inp), "--output-prefix", str(prefix), "--overwrite")
        err = _refused(capsys)
        assert rc == 2 and output in err and "even with --overwrite" in err, err
        assert named in err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("make", ["new", "existing"])
def test_a_folder_prefix_is_refused(tmp_path, capsys, make) -> None:
    src = tmp_path / "a.txt"
    src.write_text("text\n")
    folder = tmp_path / "dir"
    if make == "existing":
        folder.mkdir()
    prefixes = [str(folder) + os.sep, f"{folder}{os.sep}.", *([str(folder)] * (make == "existing"))]
    for prefix in prefixes:
        rc = _preprocess("--input", str(src), "--output-prefix", prefix, "--overwrite")
        err = _refused(capsys)
        assert rc == 2 and "names a folder, not a file-name prefix" in err
        assert f"like {os.path.join(prefix, 'corpus')}" in err
        assert sorted(os.listdir(tmp_path)) == ["a.txt", *(["dir"] * (make == "existing"))]
    assert not make == "existing" or os.listdir(folder) == []


def test_links_at_output_names_are_replaced_never_written_through(tmp_path, capsys) -> None:
    src = tmp_path / "a.txt"
    src.write_text("text\n")
    (tmp_path / "outside").mkdir()
    target = tmp_path / "outside" / "target"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / "ds.bin")
    os.symlink(tmp_path / "outside" / "missing", tmp_path / "ds.idx")  # dangling: still there
    rc = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "ds"))
    assert rc == 2 and "ds.bin exists already" in _refused(capsys)
    assert _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "ds"),
                       "--overwrite") == 0
    assert target.read_bytes() == b"keep" and os.listdir(tmp_path / "outside") == ["target"]
    assert not any(os.path.islink(tmp_path / f"ds{s}") for s in SUFFIXES)
    assert IndexedDataset(tmp_path / "ds").num_documents == 1


# ---------------------------------------------------------------- failed runs (fault 4)


def test_a_failed_run_leaves_no_output(tmp_path, capsys) -> None:
    """The second key is missing on line 2, found only after the first key's dataset is done."""
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "old", "body": "old body"}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a " * 200, "body": "b"}) + "\n"
                   + json.dumps({"text": "c"}) + "\n")
    m = str(tmp_path / "m")  # in an existing folder: nothing removes it wholesale
    for extra in ([], ["--tokenizer-type", "bpe", "--train-bpe-vocab-size", "300"]):
        rc = _preprocess("--input", str(bad), "--output-prefix", m, "--json-keys", "text",
                         "body", *extra)
        assert rc == 2 and f"{bad}: line 2: missing key 'body'" in _refused(capsys)
        assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "good.jsonl"]
    # Over an older dataset (--overwrite): it is left as it was, and no staging file is left.
    assert _preprocess("--input", str(good), "--output-prefix", m, "--json-keys", "text",
                       "body") == 0
    capsys.readouterr()
    before = _snapshot(tmp_path)
    rc = _preprocess("--input", str(bad), "--output-prefix", m, "--json-keys", "text", "body",
                     "--overwrite", "--workers", "2")
    assert rc == 2 and "line 2: missing key 'body'" in _refused(capsys)
    assert _snapshot(tmp_path) == before
