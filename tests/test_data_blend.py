"""Weighted dataset blends: parsing, the index's bound on every prefix, samples by global index
(DP size and resume), the checked cache, and the flags' errors before any process starts."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from domino.cli import main
from domino.data import IndexedDataset, IndexedDatasetBuilder
from domino.data.blend import (
    BlendedDataset,
    blend_index,
    check_index,
    deviation_bound,
    parse_blend,
    sample_index,
)
from domino.data.blend_cache import save_index
from domino.training import data as train_data
from domino.training.arguments import TrainArgs, add_arguments, resolve_args, to_toml
from domino.training.data import build_datasets, data_sources, rank_batches

EOD = 0


def _make(folder, name: str, base: int, docs: int, length: int = 20) -> IndexedDataset:
    """Token t of document d is base + 1000 d + t (+1): every token says its dataset and doc."""
    b = IndexedDatasetBuilder(folder / name, np.int32)
    for d in range(docs):
        b.add_document(np.r_[base + 1000 * d + np.arange(1, length + 1), EOD])
    b.finalize(metadata={"tokenizer": {"kind": "test", "eod": EOD}})
    return IndexedDataset(folder / name)


@pytest.fixture
def two(tmp_path):
    """Dataset a (40 docs, tokens < 100k) and a smaller b (8 docs, tokens >= 100k)."""
    return {"a": _make(tmp_path, "a", 0, 40), "b": _make(tmp_path, "b", 100_000, 8)}


def _args(two, **kw) -> TrainArgs:
    base = dict(data_path=["0.7", two["a"].prefix, "0.3", two["b"].prefix], seq_length=8,
                micro_batch_size=2, global_batch_size=8, train_iters=25, eval_iters=2,
                split="90,10,0", seed=5)
    return TrainArgs(**{**base, **kw})


def _build(two, consumed: int = 0, start: int = 0, **kw):
    args = _args(two, **kw)
    opened = {ds.prefix: ds for ds in two.values()}
    return build_datasets(args, opened, EOD, start_step=start, consumed_samples=consumed)


def _source(tokens: torch.Tensor) -> str:
    real = tokens[tokens != EOD]
    assert (real < 100_000).all() or (real >= 100_000).all(), "a sample mixes datasets"
    return "a" if int(real[0]) < 100_000 else "b"


def test_parse_blend_forms_and_errors() -> None:
    one = parse_blend(["data/x.bin"])
    assert one.prefixes == ("data/x",) and one.weights == (1.0,)
    assert parse_blend("data/x").describe() == "data/x"
    b = parse_blend(["7", "A", "3", "B.idx"])
    assert b.prefixes == ("A", "B") and b.weights == pytest.approx((0.7, 0.3))
    assert b.describe() == "blend of 2 datasets: 70% A, 30% B"
    assert parse_blend("1 A 1 A").weights == (0.5, 0.5)  # duplicates are fine
    assert parse_blend("0.6 A 0.2 B 0.2 C").weights == parse_blend("3 A 1 B 1 C").weights
    # A string that does not start with a weight is one prefix, spaces and all (old configs).
    assert parse_blend("/data/my corpus/a").prefixes == ("/data/my corpus/a",)
    assert TrainArgs(data_path="/data/my corpus/a").data_path == ["/data/my corpus/a"]
    assert TrainArgs(data_path="7 A 3 B").data_path == ["7", "A", "3", "B"]
    bad = {("0.7", "A", "0.3"): "even count", ("x", "A", "1", "B"): "'x'.*not a number",
           ("0", "A", "1", "B"): "weight 0 of A must be .* > 0", ("-1", "A", "1", "B"): "> 0",
           ("nan", "A", "1", "B"): "finite", ("1", "2", "1", "B"): "'2'.*is a number",
           ("0.5",): "weight needs a dataset prefix", (): "needs a dataset prefix"}
    for tokens, match in bad.items():
        with pytest.raises(ValueError, match=f"--train-data-path.*{match}"):
            parse_blend(list(tokens), "--train-data-path")


@pytest.mark.parametrize("k", [2, 3, 5, 20])
def test_blend_index_bound_holds_on_every_prefix(k: int) -> None:
    rng = np.random.default_rng(k)
    cases = [np.ones(k), np.arange(1, k + 1, dtype=float), rng.random(k) ** 3 + 1e-3,
             rng.integers(1, 4, k).astype(float)]  # equal and integer weights: exact ties
    for w in cases:
        w = w / w.sum()
        n = 4000
        index = blend_index(w, n)
        assert index.dtype == np.uint8 and index.shape == (n,)
        counts = np.cumsum(np.eye(k, dtype=np.int64)[index], axis=0)  # [n, k] per prefix
        dev = np.abs(counts - np.outer(np.arange(1, n + 1), w))
        assert (dev <= deviation_bound(w) + 1e-9).all(), (w, dev.max(axis=0))
        assert np.array_equal(blend_index(w, 1234), index[:1234])  # prefix-stable
        # Built in time windows (bounded memory): any window size gives the same order.
        assert np.array_equal(blend_index(w, n, window=7), index)
        assert check_index(index, w) is None
        j = sample_index(index, k)  # each dataset's samples in order 0, 1, 2, ...
        for d in range(k):
            assert np.array_equal(j[index == d], np.arange((index == d).sum()))
    assert (deviation_bound([0.5, 0.5]) == 0.5).all() and deviation_bound([1.0])[0] == 0
    assert (deviation_bound(np.full(4, 0.25)) < 1).all()


def test_blend_index_is_the_due_time_order_from_its_definition() -> None:
    """The order itself (a resumed run must draw the same samples whatever the version): sample
    j of dataset k is due at (j + 1/2) / w_k, taken by due time, ties to the lower k - here
    sorted by Python from that sentence, exact ties included (equal and integer weights)."""
    rng = np.random.default_rng(0)
    for raw in ([1, 1, 1], [0.7, 0.3], [1, 2, 2, 3], rng.random(6) ** 2 + 0.01, np.ones(12)):
        w = np.asarray(raw, dtype=np.float64)
        w = w / w.sum()
        n = 600
        due = sorted(((j + 0.5) / float(wk), k) for k, wk in enumerate(w)
                     for j in range(int(n * wk) + len(w)))
        expected = [k for _, k in due[:n]]
        assert blend_index(w, n).tolist() == expected, raw
        assert blend_index(w, n, window=5).tolist() == expected, raw


def test_blend_samples_split_dp_and_resume(two) -> None:
    train, valid = _build(two)
    assert isinstance(train, BlendedDataset) and len(train) == 25 * 8 and len(valid) == 16
    sources = [_source(train[i]["tokens"]) for i in range(len(train))]
    assert [train.source(i)[0] for i in range(len(train))] == [
        "ab".index(s) for s in sources]
    assert abs(sources.count("a") - 0.7 * len(train)) <= 0.5
    # b's 8 docs x 21 tokens hold ~19 samples of 8 per epoch; its 60 need several epochs.
    assert train.datasets[1].epochs > 1
    # --split cuts each dataset: validation reads only their last 10% of documents.
    for ds, split in ((valid.datasets[0], (36, 40)), (valid.datasets[1], (7, 8))):
        assert ds.documents.tolist() == list(range(*split))
    for i in range(len(train)):
        doc = {int(t) % 100_000 // 1000 for t in train[i]["tokens"] if t}
        assert doc <= set(range(36 if sources[i] == "a" else 7))
    # DP=1 and DP=2 read the same samples per step; a resumed run continues the same stream.
    step3 = rank_batches(train, 3 * 8, 8, 1, 0, 2, torch.device("cpu"))
    dp2 = [b for r in range(2) for b in rank_batches(train, 3 * 8, 8, 2, r, 2,
                                                     torch.device("cpu"))]
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(step3, dp2, strict=True))
    resumed, _ = _build(two, consumed=10 * 8, start=10)
    assert all(torch.equal(train[i]["tokens"], resumed[i]["tokens"]) for i in range(80, 200))
    # Deterministic for a seed; another seed reorders each dataset's samples.
    assert torch.equal(_build(two)[0][7]["tokens"], train[7]["tokens"])
    other, _ = _build(two, seed=6)
    assert any(not torch.equal(other[i]["tokens"], train[i]["tokens"]) for i in range(20))
    # A dataset listed twice is read in two orders, not the same samples twice in a row.
    twice, _ = _build(two, data_path=["1", two["a"].prefix, "1", two["a"].prefix])
    assert [twice.source(i) for i in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert any(not torch.equal(twice[2 * i]["tokens"], twice[2 * i + 1]["tokens"])
               for i in range(5))
    # One dataset alone stays the plain GPT dataset of earlier runs.
    single, _ = _build(two, data_path=[two["a"].prefix])
    assert not isinstance(single, BlendedDataset) and single.seed == 5


def test_separate_split_paths_use_datasets_whole(two) -> None:
    a, b = two["a"].prefix, two["b"].prefix
    train, valid = _build(two, data_path=None, train_data_path=[a],
                          valid_data_path=["1", a, "1", b])
    assert train.documents.tolist() == list(range(40))  # whole, no --split cut
    assert [ds.documents.size for ds in valid.datasets] == [40, 8]
    described = data_sources(_args(two, data_path=None, train_data_path=[a],
                                   valid_data_path=["1", a, "1", b])).describe()
    assert described == f"train {a} | valid blend of 2 datasets: 50% {a}, 50% {b}"
    assert data_sources(_args(two)).describe() == (
        f"blend of 2 datasets: 70% {a}, 30% {b} (split 90,10,0 of each)")


def test_index_cache_is_checked_not_trusted(two, tmp_path, monkeypatch) -> None:
    ref, _ = _build(two)
    folder = tmp_path / "domino_cache"  # the default: beside the first dataset
    (npy,) = folder.glob("blend_train_*.npy")
    side = npy.with_suffix(".json")
    assert json.loads(side.read_text())["counts"] == np.bincount(ref.index).tolist()
    built = []
    real = train_data.blend_index
    monkeypatch.setattr(train_data, "blend_index", lambda *a: built.append(1) or real(*a))
    assert np.array_equal(_build(two)[0].index, ref.index) and not built  # reused

    def rebuilt_after(damage) -> None:
        damage()
        built.clear()
        assert np.array_equal(_build(two)[0].index, ref.index) and built == [1]

    flipped = ref.index.copy()
    flipped[[0, 1]] = flipped[[1, 0]] if flipped[0] != flipped[1] else 1 - flipped[[0, 1]]
    rebuilt_after(lambda: np.save(npy, 1 - ref.index))  # same shape and dtype, wrong counts
    rebuilt_after(lambda: np.save(npy, flipped))  # same counts, wrong order: the hash
    rebuilt_after(lambda: np.save(npy, np.array([{"x": 1}], dtype=object), allow_pickle=True))
    rebuilt_after(lambda: np.save(npy, ref.index.astype(np.int64)))
    rebuilt_after(lambda: side.write_text("{not json"))
    record = json.loads(side.read_text())
    key = dict(record["key"])
    record["key"]["seed"] = 99
    rebuilt_after(lambda: side.write_text(json.dumps(record)))
    # A consistent file and sidecar (counts, hash) of another order: checked against the
    # weights, not taken on the sidecar's word.
    rebuilt_after(lambda: save_index(folder, key, flipped))
    assert check_index(flipped, (0.7, 0.3)) is not None
    # Other inputs get another file; --data-cache-path moves the cache.
    _build(two, seq_length=6)
    _build(two, data_cache_path=str(tmp_path / "elsewhere"))
    assert len(list(folder.glob("blend_train_*.npy"))) == 2
    assert len(list((tmp_path / "elsewhere").glob("blend_*.npy"))) == 2  # train and valid


def test_eval_reads_separate_split_data_whole() -> None:
    from domino.inference.tasks import eval_split

    assert eval_split(None, {"split": "90,10,0"}, 1) == "90,10,0"  # the run's --split
    assert eval_split(None, {}, 1) == "98,2,0"
    separate = {"split": "98,2,0", "train_data_path": ["A"], "valid_data_path": ["B"]}
    assert eval_split(None, separate, 1) == "0,1,0" and eval_split(None, separate, 2) == "0,0,1"
    assert eval_split("80,20,0", separate, 1) == "80,20,0"  # given wins


def test_cache_without_file_locks(two, tmp_path, monkeypatch) -> None:
    """A filesystem that refuses flock (Lustre without -o flock, NFS without lockd): the run
    goes on unlocked, and the index still lands in the cache."""
    import fcntl

    def refuse(*_args) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    train, _ = _build(two)
    assert np.array_equal(train.index, blend_index((0.7, 0.3), 200))
    assert len(list((tmp_path / "domino_cache").glob("blend_train_*.npy"))) == 1


def test_uncachable_default_builds_in_memory(two, tmp_path) -> None:
    (tmp_path / "domino_cache").write_text("in the way")
    folder, note = train_data.cache_folder(_args(two), data_sources(_args(two)))
    assert folder is None and "not cached" in note and "--data-cache-path" in note
    train, _ = _build(two)
    assert np.array_equal(train.index, blend_index((0.7, 0.3), 200))


def test_blend_flags_parse_and_round_trip(tmp_path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--data-path", "0.7", "A", "0.3", "B", "--seed", "3"])
    args = resolve_args(ns)
    assert args.data_path == ["0.7", "A", "0.3", "B"]
    (tmp_path / "back.toml").write_text(to_toml(args))
    assert resolve_args({"config": str(tmp_path / "back.toml")}) == args
    assert TrainArgs(**json.loads(json.dumps(args.to_dict()))) == args  # config.json
    (tmp_path / "run.toml").write_text('data_path = "0.7 A 0.3 B"\n'
                                       'train_data_path = [0.5, "A", 0.5, "B"]\n')
    loaded = resolve_args({"config": str(tmp_path / "run.toml")})
    assert loaded.data_path == args.data_path
    assert loaded.train_data_path == ["0.5", "A", "0.5", "B"]
    with pytest.raises(ValueError, match="--data-path=.*must be a list of strings"):
        TrainArgs(data_path=[True])


def _error(capsys, *argv: str) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.strip().splitlines() if ": error:" in ln]
    assert len(lines) == 1, err
    return lines[0]


def test_bad_blend_flags_fail_before_launch(byte_dataset, tmp_path, capsys) -> None:
    data = byte_dataset(60_000)
    missing = str(tmp_path / "missing")

    def train(*argv: str) -> str:
        return _error(capsys, "train", "--split", "80,20,0", "--save", str(tmp_path / "run"),
                      *argv)

    msg = train("--data-path", "0.5", data, "0.5", missing)
    assert "--data-path " + missing in msg and "missing.bin" in msg
    assert "even count" in train("--data-path", "0.5", data, "0.5")
    assert "'x' stands where a weight goes" in train("--data-path", "x", data, "1", data)
    assert "must be a finite number > 0" in train("--data-path", "-1", data, "1", data)
    msg = train("--data-path", data, "--train-data-path", data)
    assert "--data-path and --train-data-path" in msg
    assert "--valid-data-path needs --train-data-path" in train("--valid-data-path", data)
    msg = train("--train-data-path", data)
    assert "without --valid-data-path" in msg and "--eval-iters 0" in msg
    assert "--valid-data-path " + missing in train("--train-data-path", data,
                                                   "--valid-data-path", missing)
    (tmp_path / "file").write_text("")
    msg = train("--data-path", "1", data, "1", data, "--data-cache-path",
                str(tmp_path / "file" / "cache"))
    assert "--data-cache-path" in msg and "cannot be created" in msg
    msg = _error(capsys, "eval", str(tmp_path), "--data-path", "1", data, "1", data)
    assert "blend" in msg and "--eval-iters" in msg


def test_cache_links_are_never_followed(two, tmp_path, monkeypatch) -> None:
    """A link planted in the cache folder: the lock is refused by name (opening it would create
    a file where it leads), and a linked index or sidecar is rebuilt over without being read."""
    ref, _ = _build(two)
    folder = tmp_path / "domino_cache"
    (npy,) = folder.glob("blend_train_*.npy")
    side = npy.with_suffix(".json")
    outside = tmp_path / "outside"
    outside.mkdir()
    (folder / ".lock").unlink()
    (folder / ".lock").symlink_to(outside / "created")
    npy.unlink()  # (so the build takes the lock)
    with pytest.raises(ValueError, match=r"\.lock is a symbolic link .* remove it"):
        _build(two)
    assert not (outside / "created").exists()
    (folder / ".lock").unlink()
    opened: list[str] = []
    real_open = os.open

    def spy(path, *args, **kwargs):  # records the file each open really reached
        fd = real_open(path, *args, **kwargs)
        opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fd

    monkeypatch.setattr(os, "open", spy)
    for name, target in ((npy, outside / "index.npy"), (side, outside / "side.json")):
        if os.path.lexists(name):
            name.replace(target)
        else:
            np.save(target, ref.index)
        name.symlink_to(target)
    secret = {t: t.read_bytes() for t in outside.iterdir()}
    train, _ = _build(two)
    assert np.array_equal(train.index, ref.index)
    assert not [p for p in opened if p.startswith(str(outside))], opened
    assert not npy.is_symlink() and not side.is_symlink()  # replaced by regular files
    assert {t: t.read_bytes() for t in outside.iterdir()} == secret  # nothing written there


def test_a_refused_run_leaves_no_cache_folder(byte_dataset, tmp_path, capsys) -> None:
    import shutil

    data = tmp_path / "data"
    data.mkdir()
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(byte_dataset(60_000) + suffix, data / f"d{suffix}")
    d = str(data / "d")
    _error(capsys, "train", "--data-path", "1", d, "1", d, "--seq-length", "100000",
           "--save", str(tmp_path / "run"))
    _error(capsys, "eval", str(tmp_path), "--data-path", "1", d, "1", d)
    assert not (data / "domino_cache").exists()
    # The default folder a link: not cached there (its files would land where it leads).
    (tmp_path / "elsewhere").mkdir()
    (data / "domino_cache").symlink_to(tmp_path / "elsewhere")
    args = TrainArgs(data_path=["1", d, "1", d])
    folder, note = train_data.cache_folder(args, data_sources(args))
    assert folder is None and "symbolic link" in note
