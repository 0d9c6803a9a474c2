"""Tests for domino.data: tokenizers, MMIDIDX files and preprocessing."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from domino.data import (
    BPETokenizer,
    ByteTokenizer,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    build_tokenizer,
    preprocess,
    stdlib_corpus_files,
)

# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld — 日本語 🙂\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eod]) == text  # EOD is ignored
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised
    assert (tok.vocab_size, tok.eod) == (257, 256)
    d = tok.describe()
    assert d["kind"] == "byte" and d["vocab_size"] == 257 and d["eod"] == 256
    assert d == ByteTokenizer().describe()
    json.dumps(d)


def _corpus(n: int = 300) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "über", "naïve", "def", "return", "x = 1"]
    return [" ".join(rng.choice(words, size=12)) + "\n" for _ in range(n)]


def test_bpe_train_save_reload(tmp_path) -> None:
    tok = BPETokenizer.train(_corpus(), vocab_size=300)
    assert tok.vocab_size <= 300 and tok.encode("<|endoftext|>") == [tok.eod]
    text = "alpha beta über naïve  unseen-wörd 🙂\n\tdef"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges actually compress
    assert tok.decode(ids) == text
    paths = tok.save(tmp_path / "tok")
    assert sorted(os.path.basename(p) for p in paths) == ["merges.txt", "vocab.json"]
    again = BPETokenizer.load(tmp_path / "tok")
    assert again.encode(text) == ids and again.decode(ids) == text
    assert again.describe() == tok.describe()
    via_factory = build_tokenizer("bpe", tokenizer_dir=tmp_path / "tok")
    assert via_factory.describe() == tok.describe()
    # Training from files gives a tokenizer too; a different vocab hashes differently.
    f = tmp_path / "c.txt"
    f.write_text("".join(_corpus(50)))
    other = BPETokenizer.train([str(f)], vocab_size=280)
    assert other.decode(other.encode(text)) == text
    assert other.describe()["vocab_hash"] != tok.describe()["vocab_hash"]


def test_bpe_from_gpt2_style_files(tmp_path) -> None:
    vocab = {"<|endoftext|>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "Ġ": 5, "w": 6, "r": 7, "d": 8}
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
    for m in merges:
        vocab[m.replace(" ", "")] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = BPETokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    ids = tok.encode("hello world")
    assert ids == [vocab["hello"], vocab["Ġwor"], vocab["l"], vocab["d"]]
    assert tok.decode(ids) == "hello world"
    assert tok.eod == 0 and tok.vocab_size == len(vocab)


def test_build_tokenizer_errors(tmp_path) -> None:
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer kind 'wordpiece'"):
        build_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="vocab_file"):
        build_tokenizer("bpe")
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match="nope.json"):
        build_tokenizer("bpe", vocab_file=missing, merges_file=tmp_path / "m.txt")


# ---------------------------------------------------------------- indexed dataset


@pytest.mark.parametrize("vocab,dtype", [(257, np.uint16), (100_000, np.int32)])
def test_indexed_round_trip(tmp_path, vocab, dtype) -> None:
    assert best_dtype(vocab) == np.dtype(dtype)
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, vocab, size=n) for n in (5, 0, 17, 1, 300)]
    prefix = str(tmp_path / "sub" / "ds")
    b = IndexedDatasetBuilder(prefix, best_dtype(vocab))
    for d in docs:
        b.add_document(d)
    b.add_item([1, 2])  # one document of two sequences
    b.add_item([3])
    b.end_document()
    b.finalize(metadata={"tokenizer": {"kind": "x", "eod": 7}})
    ds = IndexedDataset(prefix)
    assert len(ds) == 7 and ds.dtype == np.dtype(dtype) and ds.num_documents == 6
    assert list(ds.sizes) == [5, 0, 17, 1, 300, 2, 1]
    assert list(ds.doc_idx) == [0, 1, 2, 3, 4, 5, 7]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds[-1], [3])
    np.testing.assert_array_equal(ds.get(4, 10, 5), docs[4][10:15])
    assert [len(x) for x in ds[5:7]] == [2, 1]
    assert isinstance(ds._tokens, np.memmap)
    assert ds.tokenizer_info == {"kind": "x", "eod": 7}
    with pytest.raises(IndexError):
        ds[7]
    with pytest.raises(IndexError):
        ds.get(0, 3, 5)


def test_builder_rejects_out_of_range_ids(tmp_path) -> None:
    b = IndexedDatasetBuilder(tmp_path / "x", np.uint16)
    with pytest.raises(ValueError, match="wider dtype"):
        b.add_document([70_000])


def test_reads_independently_written_files(tmp_path) -> None:
    # Written with raw struct/numpy, following the MMIDIDX layout only.
    seqs = [
        np.array([10, 11, 12], np.int32),
        np.array([70000], np.int32),
        np.array([5, 6], np.int32),
    ]
    prefix = tmp_path / "raw"
    (tmp_path / "raw.bin").write_bytes(b"".join(s.astype("<i4").tobytes() for s in seqs))
    sizes = [3, 1, 2]
    pointers = [0, 12, 16]
    doc_idx = [0, 2, 3]  # doc 0 = sequences 0-1, doc 1 = sequence 2
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 3, 3)
    idx += struct.pack("<3i", *sizes) + struct.pack("<3q", *pointers) + struct.pack("<3q", *doc_idx)
    (tmp_path / "raw.idx").write_bytes(idx)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and len(ds) == 3 and list(ds.doc_idx) == doc_idx
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
    assert ds.metadata is None


def test_our_index_parses_with_struct(tmp_path) -> None:
    b = IndexedDatasetBuilder(tmp_path / "ours", np.uint16)
    b.add_document([1, 2, 3])
    b.add_item([4])
    b.add_item([5, 6, 7, 8])
    b.end_document()
    b.finalize()
    raw = (tmp_path / "ours.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, code, n_seq, n_doc) == (1, 8, 3, 3)
    off = 9 + 8 + 1 + 8 + 8
    assert struct.unpack_from("<3i", raw, off) == (3, 1, 4)
    assert struct.unpack_from("<3q", raw, off + 12) == (0, 6, 8)  # byte pointers
    assert struct.unpack_from("<3q", raw, off + 36) == (0, 1, 3)
    assert len(raw) == off + 12 + 24 + 24
    assert (tmp_path / "ours.bin").read_bytes() == np.arange(1, 9, dtype="<u2").tobytes()
    assert not (tmp_path / "ours.json").exists()


def test_indexed_dataset_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.idx.*domino preprocess"):
        IndexedDataset(tmp_path / "missing")
    b = IndexedDatasetBuilder(tmp_path / "d", np.uint16)
    b.add_document(list(range(10)))
    b.finalize()
    good = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(b"NOTMAGIC!" + good[9:])
    with pytest.raises(ValueError, match="magic"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(good[:9] + struct.pack("<Q", 2) + good[17:])
    with pytest.raises(ValueError, match="version"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(good[:-4])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(good)
    binf = tmp_path / "d.bin"
    binf.write_bytes(binf.read_bytes()[:-2])
    with pytest.raises(ValueError, match="18 bytes.*20"):
        IndexedDataset(tmp_path / "d")
    os.remove(binf)
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        IndexedDataset(tmp_path / "d")


# ---------------------------------------------------------------- preprocessing


def _docs(ds: IndexedDataset, tok) -> list[str]:
    return [tok.decode(ds[i].tolist()) for i in range(len(ds))]


def test_preprocess_folder(tmp_path) -> None:
    src = tmp_path / "src"
    (src / "deep" / "__pycache__").mkdir(parents=True)
    (src / "a.txt").write_text("first doc ü")
    (src / "deep" / "b.py").write_text("print('hi')\n")
    (src / "deep" / "c.bin").write_bytes(b"\x00ignored")
    (src / "deep" / "__pycache__" / "d.py").write_text("skipped")
    (src / "empty.txt").write_text("")
    tok = ByteTokenizer()
    stats = preprocess([str(src)], tmp_path / "out", tok, progress=False)
    assert (stats.documents, stats.empty_skipped, stats.files) == (2, 1, 3)
    ds = IndexedDataset(tmp_path / "out")
    assert _docs(ds, tok) == ["first doc ü", "print('hi')\n"]
    assert ds[0][-1] == tok.eod and ds.dtype == np.uint16
    assert stats.tokens == ds.num_tokens == len("first doc ü".encode()) + 1 + 12 + 1
    assert ds.tokenizer_info == tok.describe()
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.idx", "out.json", "src"]
    only_py = preprocess(
        [src], tmp_path / "py", tok, patterns=["*.py"], append_eod=False, progress=False
    )
    assert only_py.documents == 1 and IndexedDataset(tmp_path / "py")[0][-1] != tok.eod


def test_preprocess_jsonl_custom_key_and_workers(tmp_path) -> None:
    f = tmp_path / "d.jsonl"
    rows = [{"body": f"document number {i} ✓", "id": i} for i in range(40)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tok = BPETokenizer.train(_corpus(100), vocab_size=280)
    one = preprocess([f], tmp_path / "one", tok, json_key="body", progress=False)
    assert one.documents == 40
    ds = IndexedDataset(tmp_path / "one")
    assert _docs(ds, tok) == [r["body"] for r in rows]
    two = preprocess([f], tmp_path / "two", tok, json_key="body", workers=2, progress=False)
    assert two.tokens == one.tokens
    assert (tmp_path / "two.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()


@pytest.mark.parametrize(
    "line3,match",
    [
        ('{"text": "ok"', r"bad\.jsonl: line 3: invalid JSON"),
        ('{"body": "x"}', r"bad\.jsonl: line 3: missing key 'text'"),
        ('{"text": 5}', r"bad\.jsonl: line 3: .*must be a string, got int"),
        ("[1, 2]", r"bad\.jsonl: line 3: expected a JSON object"),
    ],
)
def test_preprocess_malformed_jsonl(tmp_path, line3, match) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "a"}\n{"text": "b"}\n' + line3 + "\n")
    (tmp_path / "out.bin").write_bytes(b"keep")  # an older dataset must survive a failed run
    with pytest.raises(ValueError, match=match):
        preprocess([f], tmp_path / "out", ByteTokenizer(), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "out.bin"]
    assert (tmp_path / "out.bin").read_bytes() == b"keep"


def test_preprocess_empty_inputs(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no input files"):
        preprocess([tmp_path / "empty"], tmp_path / "o", ByteTokenizer(), progress=False)
    with pytest.raises(ValueError, match="no input files"):
        preprocess([], tmp_path / "o", ByteTokenizer(), progress=False)
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="empty"):
        preprocess([tmp_path / "empty"], tmp_path / "o", ByteTokenizer(), progress=False)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        preprocess([tmp_path / "nowhere"], tmp_path / "o", ByteTokenizer(), progress=False)


def test_stdlib_corpus_files(tmp_path) -> None:
    files = stdlib_corpus_files()
    assert len(files) > 200 and all(f.endswith(".py") for f in files)
    parts = {p for f in files for p in f.split(os.sep)}
    assert not parts & {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    assert files == stdlib_corpus_files()
    assert any(f.endswith(os.sep + "json" + os.sep + "decoder.py") for f in files)
    small = stdlib_corpus_files(limit_bytes=100_000)
    assert small and small == files[: len(small)]
    assert sum(os.path.getsize(f) for f in small) <= 100_000
    stats = preprocess(small, tmp_path / "std", ByteTokenizer(), progress=False)
    assert stats.files == len(small) and stats.documents >= len(small) - 5
