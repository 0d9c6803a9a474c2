"""`domino preprocess` through the real command-line entry point."""

from __future__ import annotations

import json
import struct

import numpy as np

from domino.cli import main
from domino.data import BPETokenizer, ByteTokenizer, IndexedDataset


def _docs(ds: IndexedDataset) -> list[list[int]]:
    return [ds.get(i).tolist() for i in range(len(ds))]


def test_text_folder_and_jsonl_round_trip(tmp_path, capsys) -> None:
    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("héllo wörld\n", encoding="utf-8")
    (folder / "sub" / "b.py").write_text("def f():\n    return 1\n")
    (folder / "skip.bin").write_bytes(b"\x00\x01")  # not matched by the folder patterns
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": "from json", "body": "other"}) + "\n\n"
                     + json.dumps({"text": "second", "body": "x"}) + "\n")
    prefix = tmp_path / "out" / "ds"
    rc = main(["preprocess", "--input", str(folder), str(jsonl), "--output-prefix", str(prefix),
               "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "wrote" in out and f"--data-path {prefix}" in out
    ds = IndexedDataset(prefix)
    tok = ByteTokenizer()
    texts = ["héllo wörld\n", "def f():\n    return 1\n", "from json", "second"]
    assert _docs(ds) == [[*tok.encode(t), tok.eod] for t in texts]
    assert ds.tokenizer_info == tok.describe()

    # Several keys: one dataset per key with Megatron's naming; --no-append-eod.
    rc = main(["preprocess", "--input", str(jsonl), "--output-prefix", str(tmp_path / "m"),
               "--json-keys", "text", "body", "--no-append-eod", "--no-progress"])
    assert rc == 0
    assert _docs(IndexedDataset(tmp_path / "m_body_document")) == [
        tok.encode("other"), tok.encode("x")]
    assert _docs(IndexedDataset(tmp_path / "m_text_document"))[1] == tok.encode("second")


def test_bpe_training_and_reuse(tmp_path, capsys) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text("alpha beta gamma delta\n" * 200 + "def return lambda\n" * 100)
    prefix = tmp_path / "bpe"
    rc = main(["preprocess", "--input", str(src), "--output-prefix", str(prefix),
               "--tokenizer-type", "bpe", "--train-bpe-vocab-size", "300", "--no-progress"])
    assert rc == 0
    tok_dir = tmp_path / "bpe_tokenizer"
    assert "--tokenizer-dir" in capsys.readouterr().out
    tok = BPETokenizer.load(tok_dir)
    ds = IndexedDataset(prefix)
    assert ds.tokenizer_info["vocab_hash"] == tok.vocab_hash()
    ids = ds.get(0).tolist()
    assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == src.read_text()
    # Reuse the saved vocab.json + merges.txt with Megatron's flag names.
    rc = main(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "again"),
               "--tokenizer-type", "bpe", "--vocab-file", str(tok_dir / "vocab.json"),
               "--merge-file", str(tok_dir / "merges.txt"), "--no-progress"])
    assert rc == 0
    assert _docs(IndexedDataset(tmp_path / "again")) == _docs(ds)


def test_bad_inputs_give_one_line_errors(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken}\n')
    rc = main(["preprocess", "--input", str(bad), "--output-prefix", str(tmp_path / "x"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{bad}: line 2: invalid JSON" in err
    assert not (tmp_path / "x.bin").exists()  # nothing half-written

    rc = main(["preprocess", "--input", str(bad), "--output-prefix", str(tmp_path / "x"),
               "--json-keys", "content", "--no-progress"])
    assert rc == 2 and "line 1: missing key 'content'" in capsys.readouterr().err

    rc = main(["preprocess", "--input", str(tmp_path / "nope"), "--output-prefix",
               str(tmp_path / "x")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err

    rc = main(["preprocess", "--input", str(bad), "--output-prefix", str(tmp_path / "x"),
               "--tokenizer-type", "bpe"])
    assert rc == 2 and "vocab" in capsys.readouterr().err


def test_reads_megatron_layout_written_by_hand(tmp_path) -> None:
    """A .bin/.idx written to Megatron's documented MMIDIDX layout (no sidecar) loads."""
    docs = [[5, 6, 7, 256], [1, 2, 256], [9, 256]]
    tokens = np.concatenate([np.asarray(d, dtype=np.uint16) for d in docs])
    sizes = [len(d) for d in docs]
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1] * 2]).astype(np.int64)
    doc_idx = [0, 1, 2, 3]
    head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(sizes), len(doc_idx))
    body = (struct.pack(f"<{len(sizes)}i", *sizes) + pointers.astype("<i8").tobytes()
            + struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    (tmp_path / "meg.idx").write_bytes(head + body)
    (tmp_path / "meg.bin").write_bytes(tokens.astype("<u2").tobytes())
    ds = IndexedDataset(tmp_path / "meg")
    assert ds.tokenizer_info is None and ds.num_documents == 3
    assert _docs(ds) == docs
