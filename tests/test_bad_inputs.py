"""Bad input to every command gets one line naming the file or flag, the rule and the fix, exit
2, no traceback, and nothing left behind (all in one process: each is refused before any
spawn)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_checkpoint_format import _args, _checkpoint

from domino.cli import main
from domino.utils import format_bytes

RO = "/sys/domino-test-out"  # read-only for root too (as the --save checks use)


@pytest.fixture(scope="module")
def data(byte_dataset) -> str:
    return byte_dataset(200_000)


def _refused(capfd, argv: list[str]) -> str:
    """Run ``domino ARGV``; assert the one-line refusal and return it."""
    capfd.readouterr()
    rc = main(argv)
    err = capfd.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"domino {argv[0]}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _small(data: str) -> list[str]:
    return ["--data-path", data, "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
            "--train-iters", "2", "--tensor-model-parallel-size", "1", "--no-tensorboard"]


def _garbage_bpe(tmp_path: Path) -> tuple[Path, Path, Path]:
    good = tmp_path / "good"
    from domino.data import BPETokenizer

    BPETokenizer.train(["alpha beta gamma " * 50] * 20, vocab_size=300).save(good)
    bad = tmp_path / "garbage.json"
    bad.write_text("{garbage\n")
    return good / "vocab.json", good / "merges.txt", bad


def test_garbage_bpe_files_are_named(tmp_path: Path, data: str, capfd) -> None:
    vocab, merges, bad = _garbage_bpe(tmp_path)
    run = tmp_path / "run"
    line = _refused(capfd, ["train", *_small(data), "--tokenizer-type", "bpe", "--vocab-file",
                            str(bad), "--merge-file", str(merges), "--save", str(run)])
    assert f"--vocab-file {bad} is not JSON" in line and "GPT-2 style vocab.json" in line
    assert not run.exists()  # the refused run left no folder
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    line = _refused(capfd, ["preprocess", "--input", str(corpus), "--output-prefix",
                            str(tmp_path / "out" / "ds"), "--tokenizer-type", "bpe",
                            "--vocab-file", str(vocab), "--merge-file", str(bad), "--no-progress"])
    assert f"merges_file {bad}" in line and f"vocab_file {vocab}" in line
    assert not (tmp_path / "out").exists()
    # A vocab.json that parses but is not token -> id.
    bad.write_text('["a", "b"]')
    line = _refused(capfd, ["preprocess", "--input", str(corpus), "--output-prefix",
                            str(tmp_path / "ds"), "--tokenizer-type", "bpe", "--vocab-file",
                            str(bad), "--merge-file", str(merges), "--no-progress"])
    assert "is not a JSON object of token -> integer id" in line


def test_model_sizes_and_nproc_are_checked_first(tmp_path: Path, data: str, capfd) -> None:
    for flag, value in (("--hidden-size", "0"), ("--hidden-size", "-8"),
                        ("--num-attention-heads", "0"), ("--num-layers", "0"),
                        ("--ffn-hidden-size", "0"), ("--nproc", "0"), ("--nproc", "-1"),
                        ("--tensor-model-parallel-size", "0")):
        run = tmp_path / f"run{flag}{value}"
        line = _refused(capfd, ["train", *_small(data), flag, value, "--save", str(run)])
        assert f"{flag}={value} must be > 0" in line, line
        assert "column-chunks" not in line and not run.exists()


def test_a_broken_dataset_sidecar_is_named(tmp_path: Path, data: str, capfd) -> None:
    copy = tmp_path / "ds"
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(data + suffix, str(copy) + suffix)
    Path(str(copy) + ".json").write_text('{"tokenizer": \n')
    line = _refused(capfd, ["train", *_small(str(copy)), "--save", str(tmp_path / "run")])
    assert f"{copy}.json: the dataset's sidecar is not valid JSON" in line
    assert "domino preprocess" in line and not (tmp_path / "run").exists()
    Path(str(copy) + ".json").write_text('[1, 2]')
    line = _refused(capfd, ["train", *_small(str(copy)), "--save", str(tmp_path / "run")])
    assert "must be a JSON object" in line


def test_save_inside_a_checkpoint_folder_is_refused(tmp_path: Path, data: str, capfd) -> None:
    other = tmp_path / "other"
    _checkpoint(other, step=2, args=_args(data))
    (other / "config.json").write_text("{}")
    for inside in (other / "checkpoints", other / "checkpoints" / "step_0000002",
                   other / "checkpoints" / "step_0000002" / "sub", other / "checkpoints" / "new"):
        line = _refused(capfd, ["train", *_small(data), "--save", str(inside)])
        assert "a checkpoint folder of the run in" in line and str(other) in line
        assert f"--load {other} --save {other}" in line
    assert not (other / "checkpoints" / "new").exists()
    assert sorted(p.name for p in (other / "checkpoints").iterdir()) == [
        "latest.json", "step_0000002"]


def test_dense_and_moe_checkpoints_name_the_experts_alone(tmp_path: Path, data: str,
                                                         capfd) -> None:
    # The moe_* settings apply only with experts: across a dense and an MoE model they are no
    # differences of their own, and --num-experts is the one named (with both values).
    from domino.training.prepare import model_config

    for name, experts in (("dense", None), ("moe", 4)):
        args = _args(data, num_layers=1, num_experts=experts)
        _checkpoint(tmp_path / name, step=2, config=model_config(args, 257), args=args)
    flags = [*_small(data), "--eval-iters", "0", "--save", str(tmp_path / "new")]
    line = _refused(capfd, ["train", *flags, "--num-experts", "4", "--load",
                            str(tmp_path / "dense")])
    assert ("the checkpoint holds another model: --num-experts is unset (a dense model: no "
            "experts) in the checkpoint but 4 here. Pass the checkpoint's settings") in line
    assert "--moe-" not in line, line
    line = _refused(capfd, ["train", *flags, "--load", str(tmp_path / "moe")])
    assert ("the checkpoint holds another model: --num-experts is 4 in the checkpoint but "
            "unset (a dense model: no experts) here. Pass") in line and "--moe-" not in line
    # Between two MoE models a setting of their experts is a difference of its own.
    line = _refused(capfd, ["train", *flags, "--num-experts", "8", "--moe-router-topk", "1",
                            "--load", str(tmp_path / "moe")])
    assert ("another model: --num-experts is 4 in the checkpoint but 8 here; "
            "--moe-router-topk is 2 in the checkpoint but 1 here.") in line
    assert not (tmp_path / "new").exists()


def test_a_refused_run_leaves_no_folder(tmp_path: Path, data: str, capfd) -> None:
    run = tmp_path / "a" / "b" / "run"
    _refused(capfd, ["train", *_small(data), "--lr", "-1", "--save", str(run)])
    _refused(capfd, ["train", *_small(data), "--split", "0,0,0", "--save", str(run)])
    assert not (tmp_path / "a").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    _refused(capfd, ["train", *_small(data), "--split", "0,0,0", "--save", str(existing)])
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]  # left as it was


def test_outputs_that_cannot_be_written(tmp_path: Path, data: str, capfd) -> None:
    src = tmp_path / "src"
    _checkpoint(src, step=2, args=_args(data))
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = _refused(capfd, ["preprocess", "--input", data + ".json", "--output-prefix",
                            f"{RO}/ds", "--no-progress"])
    assert "--output-prefix" in line and "cannot write there" in line
    line = _refused(capfd, ["preprocess", "--input", data + ".json", "--output-prefix",
                            f"{afile}/ds", "--no-progress"])
    assert "--output-prefix" in line and "is a file" in line
    for out in (afile, Path(RO)):
        line = _refused(capfd, ["convert", str(src), str(out), "--tensor-model-parallel-size",
                                "1"])
        assert f"OUT {out}" in line and ("is a file" in line or "cannot write there" in line)
        line = _refused(capfd, ["export", "--format", "hf", str(src), str(out)])
        assert f"OUT {out}" in line
    assert afile.read_text() == "x"


def test_bench_refuses_flags_it_would_ignore(capfd) -> None:
    line = _refused(capfd, ["bench", "--plan", "nonsense"])
    assert "--plan applies only to a pipeline comparison" in line
    line = _refused(capfd, ["bench", "--pipeline-micro-batches", "4", "--schedules", "1f1b"])
    assert "--pipeline-micro-batches, --schedules apply only" in line
    line = _refused(capfd, ["bench", "--pipeline-model-parallel-size", "2", "--modes", "sync"])
    assert "drop --modes" in line
    line = _refused(capfd, ["bench", "--pipeline-model-parallel-size", "2", "--plan",
                            "nonsense"])
    assert "invalid Domino plan 'nonsense'" in line


def test_sizes_are_printed_in_a_unit_that_shows_them() -> None:
    assert format_bytes(0) == "0 B" and format_bytes(1000) == "1000 B"
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(10 << 20) == "10.0 MiB"
    assert format_bytes(3 << 30) == "3.00 GiB"


def test_a_sidecar_of_the_wrong_shape_is_refused(tmp_path: Path, data: str) -> None:
    # A sidecar that is JSON but not of the expected shape is refused, not half-read.
    copy = tmp_path / "ds"
    for suffix in (".bin", ".idx"):
        shutil.copy(data + suffix, str(copy) + suffix)
    Path(str(copy) + ".json").write_text(json.dumps({"tokenizer": "byte"}))
    from domino.data import IndexedDataset

    with pytest.raises(ValueError, match="'tokenizer' object"):
        IndexedDataset(copy)


@pytest.fixture
def small_fs(tmp_path: Path):
    """``small_fs(kib)``: a tmpfs of that size (a real full disk); skipped where mounting is not
    allowed (not root, or a container without the capability)."""
    mounted: list[Path] = []

    def make(kib: int) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_full_disk_mid_run_keeps_the_previous_checkpoint(small_fs, data: str, capfd,
                                                           nproc: int) -> None:
    # With two ranks (TP=2: both write shards) each names the full disk: none fails on a file
    # of the save that another rank removed ("No such file or directory").
    from domino.checkpoint.layout import open_checkpoint
    from domino.training.prepare import model_config as config_of
    from domino.training.resume import BYTES_PER_PARAM_SAVED, parameter_bytes

    flags = [*_small(data), "--train-iters", "4", "--save-interval", "2", "--eval-iters", "0",
             "--sample-tokens", "0", "--nproc", str(nproc),
             "--tensor-model-parallel-size", str(nproc)]
    args = _args(data, num_layers=1, hidden_size=32, seq_length=16)
    need = parameter_bytes(config_of(args, 257)) * BYTES_PER_PARAM_SAVED
    # Room for the up-front check and one checkpoint, not for a second one beside it.
    fs = small_fs(int(need * 1.5) // 1024)
    run = fs / "run"
    capfd.readouterr()
    rc = main(["train", *flags, "--save", str(run)])
    err = capfd.readouterr().err
    assert rc == 2, err
    assert "No space left on device" in err and "the previous checkpoint is intact" in err
    assert "free space on the --save filesystem" in err and "Traceback" not in err
    assert "No such file or directory" not in err, err
    reports = [line for line in err.splitlines() if line.startswith("[rank ")]
    assert len(reports) == nproc and all("No space left on device" in r for r in reports), err
    step_dir, meta, _ = open_checkpoint(run)
    assert meta.step == 2 and step_dir.name == "step_0000002"
    assert not list((run / "checkpoints").glob("*.tmp"))  # the failed save left nothing
