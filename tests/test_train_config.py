"""`domino train` settings and pre-launch validation: every bad input fails with one clear line
(exit 2) before any process starts. All in-process, no spawning."""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest

from domino.cli import main
from domino.config import TransformerConfig
from domino.data import BPETokenizer, ByteTokenizer, IndexedDatasetBuilder, preprocess
from domino.data.preprocess import stdlib_corpus_files
from domino.runtime import SEED_SPELLING
from domino.training import arguments
from domino.training.arguments import TrainArgs, resolve_args, to_toml
from domino.training.optim import learning_rate


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("data")
    files = stdlib_corpus_files(limit_bytes=200_000)
    preprocess(files, folder / "small", ByteTokenizer(), progress=False)
    return str(folder / "small")


def _error(capsys, *argv: str) -> str:
    rc = main(["train", "--split", "80,20,0", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("domino train: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_bad_inputs(tmp_path, data, capsys) -> None:
    msg = _error(capsys, "--data-path", str(tmp_path / "missing"))
    assert "missing.bin" in msg and "domino preprocess" in msg

    with IndexedDatasetBuilder(tmp_path / "empty") as b:
        b.finalize(metadata={"tokenizer": ByteTokenizer().describe()})
    assert "empty" in _error(capsys, "--data-path", str(tmp_path / "empty"))

    bpe = BPETokenizer.train(["alpha beta gamma " * 50] * 20, vocab_size=300)
    preprocess(stdlib_corpus_files(limit_bytes=50_000), tmp_path / "bpe", bpe, progress=False)
    msg = _error(capsys, "--data-path", str(tmp_path / "bpe"))
    assert "was made with a bpe tokenizer" in msg and "byte tokenizer" in msg

    msg = _error(capsys, "--data-path", data, "--num-attention-heads", "3", "--hidden-size", "96")
    # (the config names its fields; `domino train` prints the flags that set them)
    assert "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2" in msg
    assert "world size 3 is not divisible" in _error(capsys, "--data-path", data, "--nproc", "3")
    msg = _error(capsys, "--data-path", data, "--seq-length", "256",
                 "--max-position-embeddings", "128")
    assert "--seq-length 256 is longer than --max-position-embeddings 128" in msg
    assert "--fp16 needs a CUDA device" in _error(capsys, "--data-path", data, "--fp16",
                                                  "--device", "cpu")
    msg = _error(capsys, "--data-path", data, "--micro-batch-size", "4",
                 "--global-batch-size", "6")
    assert "not a positive multiple" in msg
    msg = _error(capsys, "--data-path", data, "--micro-batch-size", "1")
    assert "--domino-micro-batches=2 is larger than --micro-batch-size=1" in msg
    assert "valid split is empty" in _error(capsys, "--data-path", data, "--split", "100,0,0",
                                            "--eval-iters", "2")
    assert "no checkpoint found" in _error(capsys, "--data-path", data, "--load",
                                           str(tmp_path))
    msg = _error(capsys, "--data-path", data, "--sequence-parallel", "--seq-length", "33")
    assert "--seq-length=33 is not divisible by --tensor-model-parallel-size=2" in msg


def test_megatron_dataset_without_sidecar(tmp_path, data, capsys) -> None:
    """No tokenizer record: ids must fit the vocabulary (checked on the tokens)."""
    def write(prefix, tokens):
        tokens = np.asarray(tokens, dtype=np.uint16)
        head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 1, 2)
        body = struct.pack("<i", len(tokens)) + struct.pack("<q", 0) + struct.pack("<2q", 0, 1)
        (tmp_path / f"{prefix}.idx").write_bytes(head + body)
        (tmp_path / f"{prefix}.bin").write_bytes(tokens.tobytes())

    write("big", [300] * 50)
    msg = _error(capsys, "--data-path", str(tmp_path / "big"))
    assert "token id 300, outside the 257-token vocabulary" in msg


def test_config_layering_and_round_trip(tmp_path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nnum-layers = 3\nhidden_size = 96\nswiglu = true\n'
                    '[training]\nlr = 1\n')
    ns = {"config": str(toml), "hidden_size": 64}
    args = resolve_args(ns)
    assert (args.num_layers, args.hidden_size, args.swiglu, args.lr) == (3, 64, True, 1.0)
    assert args.seq_length == TrainArgs().seq_length  # untouched: built-in default
    (tmp_path / "back.toml").write_text(to_toml(args))
    assert resolve_args({"config": str(tmp_path / "back.toml")}) == args
    toml.write_text("num_layer = 3\n")
    with pytest.raises(ValueError, match="unknown setting 'num_layer'.*num-layers"):
        resolve_args({"config": str(toml)})
    with pytest.raises(ValueError, match="--lr='x' must be a float"):
        resolve_args({"lr": "x"})


def test_help_comes_from_config_metadata() -> None:
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(TransformerConfig)}
    helps.update((name, text) for name, (_, text) in SEED_SPELLING.items())  # domino_* & co
    for name in ("num_layers", "hidden_size", "domino_overlap", "hidden_dropout"):
        assert arguments.help_text(name) == helps[name]
    import argparse

    parser = argparse.ArgumentParser()
    arguments.add_arguments(parser)
    assert helps["num_layers"] in parser.format_help()
    assert vars(parser.parse_args(["--no-swiglu", "--lr", "0.1"])) == {"swiglu": False, "lr": 0.1}


def test_precision_flags_make_the_runtime_and_the_reduction() -> None:
    """--bf16 / --fp16 are the runtime's compute dtype (no autocast); --grad-reduce-in-bf16 the
    DP reduction's dtype."""
    import torch

    assert TrainArgs().runtime().compute_dtype is None and TrainArgs().grad_reduce_dtype() is None
    assert TrainArgs(bf16=True).runtime().compute_dtype == torch.bfloat16
    assert TrainArgs(fp16=True).runtime().compute_dtype == torch.float16
    assert TrainArgs(grad_reduce_in_bf16=True).grad_reduce_dtype() == torch.bfloat16
    assert resolve_args({"grad_reduce_in_bf16": True, "bf16": True}).grad_reduce_in_bf16


def test_lr_schedule() -> None:
    args = TrainArgs(lr=1.0, min_lr=0.1, lr_warmup_iters=10, train_iters=110)
    assert learning_rate(5, args) == pytest.approx(0.5)
    assert learning_rate(10, args) == pytest.approx(1.0)
    assert learning_rate(60, args) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert learning_rate(110, args) == pytest.approx(0.1)
    assert learning_rate(500, args) == pytest.approx(0.1)
    args.lr_decay_style = "linear"
    assert learning_rate(60, args) == pytest.approx(0.55)


def test_default_corpus_is_prepared_once(tmp_path, monkeypatch) -> None:
    from domino.data import IndexedDataset
    from domino.training import data as train_data
    from domino.training.prepare import prepare_run

    monkeypatch.setenv("DOMINO_CACHE_DIR", str(tmp_path / "cache"))
    files = train_data.default_corpus_files()[:40]
    assert not any("pydoc_data" in f or "/encodings/" in f
                   for f in train_data.default_corpus_files())
    monkeypatch.setattr(train_data, "default_corpus_files", lambda: files)
    run = prepare_run(TrainArgs(split="90,10,0"), world_size=2, progress=False)
    args, config = run.args, run.config
    assert args.tokenizer_type == "bpe" and args.tokenizer_dir  # BPE trained on the corpus
    assert args.global_batch_size == 8 and args.max_position_embeddings == args.seq_length
    tok = BPETokenizer.load(args.tokenizer_dir)
    assert config.vocab_size == tok.vocab_size
    assert IndexedDataset(args.data_path[0]).tokenizer_info["vocab_hash"] == tok.vocab_hash()
    cached = sorted((tmp_path / "cache").rglob("*"))
    mtimes = [p.stat().st_mtime_ns for p in cached]
    again = prepare_run(TrainArgs(split="90,10,0"), world_size=2, progress=False).args
    assert again.data_path == args.data_path and again.tokenizer_dir == args.tokenizer_dir
    assert [p.stat().st_mtime_ns for p in cached] == mtimes  # nothing rebuilt
    byte = prepare_run(TrainArgs(split="90,10,0", tokenizer_type="byte"), world_size=2,
                       progress=False).args
    assert IndexedDataset(byte.data_path[0]).tokenizer_info == ByteTokenizer().describe()
