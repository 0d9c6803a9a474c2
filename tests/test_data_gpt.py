"""Tests for domino.data.gpt_dataset: sample windows, masks, splits and determinism."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch

from domino.data import IndexedDataset, IndexedDatasetBuilder
from domino.data.gpt_dataset import (
    GPTDataset,
    build_sample,
    build_train_valid_datasets,
    split_documents,
)

EOD = 0


def _make(tmp_path, lengths, name="ds", meta=True) -> IndexedDataset:
    """Document d holds d*1000+1 .. d*1000+len, then EOD: every token says where it came from."""
    b = IndexedDatasetBuilder(tmp_path / name, np.int32)
    for d, n in enumerate(lengths):
        b.add_document(np.r_[np.arange(d * 1000 + 1, d * 1000 + n + 1), EOD])
    b.finalize(metadata={"tokenizer": {"kind": "test", "eod": EOD}} if meta else None)
    return IndexedDataset(tmp_path / name)


def _stream(ds: IndexedDataset, order) -> np.ndarray:
    return np.concatenate([ds[int(d)] for d in order]).astype(np.int64)


def test_samples_are_windows_of_shuffled_stream(tmp_path) -> None:
    ds = _make(tmp_path, [5, 9, 3, 14, 7, 2, 11])
    s = 8
    g = GPTDataset(ds, s, num_samples=30, seed=3, eod_token=EOD, split=(1, 6))
    order = g.document_order
    per_epoch = 5
    assert len(order) % per_epoch == 0 and len(order) // per_epoch == g.epochs > 1
    for e in range(g.epochs):
        assert sorted(order[e * per_epoch : (e + 1) * per_epoch]) == [1, 2, 3, 4, 5]
    stream = _stream(ds, order)
    windows = [tuple(stream[i * s : i * s + s + 1]) for i in range(30)]
    got = [tuple(g.sample_tokens(i)) for i in range(len(g))]
    assert all(len(x) == s + 1 for x in got)
    assert sorted(got) == sorted(windows)  # same multiset of windows...
    assert got != windows  # ...in shuffled sample order
    item = g[0]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}
    assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (s,)
    assert item["loss_mask"].dtype == torch.float32
    assert item["attention_mask"].dtype == torch.bool and item["attention_mask"].shape == (1, s, s)
    torch.testing.assert_close(item["tokens"][1:], item["labels"][:-1])
    torch.testing.assert_close(item["tokens"], torch.tensor(got[0][:-1]))
    torch.testing.assert_close(item["labels"], torch.tensor(got[0][1:]))


def test_epochs_argument_and_validation(tmp_path) -> None:
    ds = _make(tmp_path, [10, 10, 10])  # 33 tokens per epoch
    g = GPTDataset(ds, 4, epochs=2, eod_token=EOD)
    assert len(g) == (2 * 33 - 1) // 4 and g.epochs == 2
    with pytest.raises(ValueError, match="exactly one"):
        GPTDataset(ds, 4, 5, epochs=1, eod_token=EOD)
    with pytest.raises(ValueError, match=r"11 tokens.*seq_length \+ 1 = 21"):
        GPTDataset(ds, 20, 5, eod_token=EOD, split=(0, 1))
    with pytest.raises(IndexError):
        g[len(g)]


def test_build_sample_masks() -> None:
    e = EOD
    sample = np.array([5, 6, e, 7, 8, e, 9, 10, 11])
    plain = build_sample(sample, e)
    s = 8
    torch.testing.assert_close(plain["position_ids"], torch.arange(s))
    torch.testing.assert_close(plain["loss_mask"], torch.ones(s))
    causal = ~torch.tril(torch.ones(s, s, dtype=torch.bool))
    assert torch.equal(plain["attention_mask"][0], causal)

    out = build_sample(
        sample, e, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True
    )
    assert out["tokens"].tolist() == [5, 6, e, 7, 8, e, 9, 10]
    assert out["labels"].tolist() == [6, e, 7, 8, e, 9, 10, 11]
    # The input EOD positions are masked out of the loss.
    assert out["loss_mask"].tolist() == [1, 1, 0, 1, 1, 0, 1, 1]
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    expected = causal | (seg[:, None] != seg[None, :])
    assert torch.equal(out["attention_mask"][0], expected)
    visible = ~out["attention_mask"][0]
    assert visible[3].tolist() == [False, False, False, True, False, False, False, False]
    assert visible[2, :3].all()  # the EOD still sees its own document

    no_mask = build_sample(sample, e, create_attention_mask=False)
    assert "attention_mask" not in no_mask


def test_dataset_flags_apply(tmp_path) -> None:
    ds = _make(tmp_path, [3, 4, 2, 5])
    g = GPTDataset(ds, 6, 4, eod_token=EOD, eod_mask_loss=True, reset_position_ids=True)
    for i in range(len(g)):
        item = g[i]
        is_eod = item["tokens"] == EOD
        assert torch.equal(item["loss_mask"] == 0, is_eod)
        # Right after an EOD the position restarts at 0.
        after = torch.nonzero(is_eod[:-1]).flatten() + 1
        assert (item["position_ids"][after] == 0).all()


def test_determinism_seed_and_dp_independence(tmp_path) -> None:
    ds = _make(tmp_path, list(range(2, 40)))
    kw = dict(num_samples=64, eod_token=EOD)

    def samples(g: GPTDataset, idx) -> dict[int, list[int]]:
        return {i: g[i]["tokens"].tolist() for i in idx}

    ref = samples(GPTDataset(ds, 16, seed=7, **kw), range(64))
    assert ref == samples(GPTDataset(ds, 16, seed=7, **kw), range(64))
    assert ref != samples(GPTDataset(ds, 16, seed=8, **kw), range(64))
    for dp in (2, 4):
        merged: dict[int, list[int]] = {}
        for rank in range(dp):
            # Each rank builds its own dataset (as in a separate process) and reads its shard.
            reopened = IndexedDataset(tmp_path / "ds")
            merged.update(samples(GPTDataset(reopened, 16, seed=7, **kw), range(rank, 64, dp)))
        assert merged == ref


def test_split_documents() -> None:
    assert split_documents(100, "98,2,0") == [(0, 98), (98, 100), (100, 100)]
    assert split_documents(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_documents(10, [8, 2]) == [(0, 8), (8, 10), (10, 10)]
    assert split_documents(7, "1/1/1") == [(0, 2), (2, 5), (5, 7)]
    ranges = split_documents(37, "90,7,3")
    assert ranges[0][0] == 0 and ranges[-1][1] == 37
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    with pytest.raises(ValueError, match=r"valid split is empty.*10 document.*--split"):
        split_documents(10, "98,2,0")
    assert split_documents(10, "98,2,0", required=(True, False, False))[0] == (0, 10)
    with pytest.raises(ValueError, match="numbers"):
        split_documents(10, "a,b")
    with pytest.raises(ValueError, match="positive sum"):
        split_documents(10, "0,0,0")


def test_build_train_valid_datasets(tmp_path) -> None:
    _make(tmp_path, [6] * 20)
    train, valid = build_train_valid_datasets(tmp_path / "ds", 8, 50, 5, seed=1, splits="90,10,0")
    assert valid is not None and len(train) == 50 and len(valid) == 5
    assert set(train.documents.tolist()) == set(range(18))
    assert set(valid.documents.tolist()) == {18, 19}
    valid_tokens = {t // 1000 for i in range(5) for t in valid[i]["tokens"].tolist() if t}
    assert valid_tokens <= {18, 19}
    train2, none = build_train_valid_datasets(tmp_path / "ds", 8, 10, 0, splits="100,0,0")
    assert none is None and len(train2) == 10
    _make(tmp_path, [3, 2], name="tiny")
    with pytest.raises(ValueError, match=r"7 tokens.*seq_length \+ 1 = 9"):
        build_train_valid_datasets(tmp_path / "tiny", 8, 10, 1)
    _make(tmp_path, [9], name="nometa", meta=False)
    with pytest.raises(ValueError, match="eod_token"):
        build_train_valid_datasets(tmp_path / "nometa", 4, 10, 0)


def test_index_build_is_fast(tmp_path) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 400, size=20_000)  # ~4M tokens
    b = IndexedDatasetBuilder(tmp_path / "big", np.uint16)
    b.add_item(np.ones(int(lengths.sum()), np.uint16))  # one write, then fake the boundaries
    b.finalize()
    from domino.data.indexed_dataset import write_index

    write_index(str(tmp_path / "big.idx"), np.uint16, lengths, np.arange(len(lengths) + 1))
    ds = IndexedDataset(tmp_path / "big")
    # CPU time, not wall time: another test's ranks on the same cores do not count (a loop in
    # Python over the 60k documents would take seconds of it).
    t0 = time.process_time()
    g = GPTDataset(ds, 1024, epochs=3, eod_token=EOD)
    assert time.process_time() - t0 < 1.0
    assert len(g) > 10_000 and len(g[len(g) - 1]["tokens"]) == 1024


def test_pickle_reopens_instead_of_copying(tmp_path) -> None:
    ds = _make(tmp_path, [50] * 200)
    g = GPTDataset(ds, 32, 20, eod_token=EOD, split=np.arange(0, 200, 2))
    blob = pickle.dumps(g)
    assert len(blob) < ds.num_tokens * 4  # the .bin is not inside the pickle
    g2 = pickle.loads(blob)
    assert all(torch.equal(g[i]["tokens"], g2[i]["tokens"]) for i in range(len(g)))
    assert {t // 1000 for i in range(len(g)) for t in g[i]["tokens"].tolist()} <= set(
        range(0, 200, 2)
    )
