"""Flags that are refused before any process starts, as one line naming the flag and value, the
rule and the fix (exit 2, no traceback, no run folder): a broken --compile toolchain, flags of a
feature the run does not use (they would be ignored), out-of-range MoE values, a --seq-length
past a checkpoint's position table, and argparse's own errors."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest
from test_bad_inputs import _refused, _small
from test_checkpoint_format import _args, _checkpoint

from domino import runtime
from domino.cli import main
from domino.runtime import check_compile
from domino.training.prepare import model_config


@pytest.fixture(scope="module")
def data(byte_dataset) -> str:
    return byte_dataset(200_000)


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _train_refused(capfd, tmp_path: Path, data: str, *flags: str) -> str:
    run = tmp_path / "run"
    line = _refused(capfd, ["train", *_small(data), *flags, "--save", str(run)])
    assert not run.exists(), line  # nothing left behind
    return line


def test_compile_with_a_missing_or_broken_compiler_is_refused(tmp_path, data, capfd,
                                                              monkeypatch) -> None:
    broken = _script(tmp_path / "broken-cxx", "echo 'cc1plus: fatal error: no' >&2; exit 1")
    silent = _script(tmp_path / "silent-cxx", "exit 0")  # "succeeds" without an output file
    for cxx, needle in (("/nonexistent/g++", "does not exist or is not executable"),
                        ("no-such-compiler-here", "is not on PATH"),
                        (str(broken),
                         "failed to compile a one-line file (exit 1: cc1plus: fatal error: no)"),
                        (str(silent), "wrote no library")):
        monkeypatch.setenv("CXX", cxx)
        line = _train_refused(capfd, tmp_path, data, "--compile", "--device", "cpu")
        assert f"--compile with the inductor backend: the C++ compiler {cxx!r}" in line, line
        assert f"{needle} (from CXX)" in line, line
        assert "--compile-backend aot_eager" in line and "drop --compile" in line, line


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
def test_a_working_compiler_is_checked_once_per_binary(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DOMINO_CACHE_DIR", str(tmp_path / "cache"))
    wrapper = _script(tmp_path / "cxx", f'exec {shutil.which("g++")} "$@"')
    monkeypatch.setenv("CXX", str(wrapper))
    check_compile(True, "inductor", "cpu", "--compile")
    assert (tmp_path / "cache" / runtime.CXX_CACHE_FILE).is_file()

    def no_compiling(*_a, **_k):
        raise AssertionError("the compiler ran again")

    monkeypatch.setattr(runtime.subprocess, "run", no_compiling)
    check_compile(True, "inductor", "cpu", "--compile")
    monkeypatch.undo()
    # The same path, another binary: checked again (and refused).
    monkeypatch.setenv("DOMINO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(_script(wrapper, "exit 1  # now broken")))
    with pytest.raises(ValueError, match="failed to compile a one-line file"):
        check_compile(True, "inductor", "cpu", "--compile")


def test_the_compile_hint_spells_the_flag(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    msgs = []
    for flag in ("--compile", "compile"):
        with pytest.raises(ValueError) as err:
            check_compile(True, "inductor", "cpu", flag)
        msgs.append(str(err.value))
    assert "pass --compile-backend aot_eager" in msgs[0] and "backendaot" not in msgs[0]
    assert "pass compile_backend='aot_eager'" in msgs[1]


def test_moe_flags_without_moe_are_refused(tmp_path, data, capfd) -> None:
    for flags, shown in ((["--moe-router-topk", "0"], "--moe-router-topk 0"),
                         (["--moe-expert-capacity-factor", "-1"],
                          "--moe-expert-capacity-factor -1"),
                         (["--moe-shared-expert-gate"], "--moe-shared-expert-gate"),
                         (["--moe-router-topk", "4", "--moe-aux-loss-coeff", "0.1"],
                          "--moe-router-topk 4, --moe-aux-loss-coeff 0.1")):
        line = _train_refused(capfd, tmp_path, data, *flags)
        assert f"{shown} set" in line and "--num-experts is not set" in line, line
        assert "add --num-experts N" in line and "or drop" in line, line


def test_bench_refuses_moe_and_cp_flags_it_would_ignore(capfd) -> None:
    import argparse

    from domino.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert {k: parser.get_default(k) for k in bench.MOE_DEFAULTS} == bench.MOE_DEFAULTS
    line = _refused(capfd, ["bench", "--moe-router-topk", "4", "--moe-aux-loss-coeff", "0"])
    assert "--moe-router-topk, --moe-aux-loss-coeff set the MoE layers" in line, line
    assert "add --num-experts N" in line, line
    line = _refused(capfd, ["bench", "--cp-comm-type", "a2a"])
    assert "--cp-comm-type a2a" in line and "--context-parallel-size is 1" in line, line
    line = _refused(capfd, ["bench", "--pipeline-model-parallel-size", "2", "--cp-comm-type",
                            "all_gather"])
    assert "add --context-parallel-size N" in line, line


@pytest.mark.parametrize(("flags", "needles"), [
    (["--num-experts", "0"], ["--num-experts=0 must be a positive integer"]),
    (["--num-experts", "-4"], ["--num-experts=-4 must be a positive integer"]),
    (["--num-experts", "4", "--moe-router-topk", "0"],
     ["--moe-router-topk=0 must be a positive integer"]),
    (["--num-experts", "4", "--moe-router-topk", "5"],
     ["--moe-router-topk=5 is more than --num-experts=4"]),
    (["--num-experts", "4", "--moe-router-topk-scaling-factor", "-2"],
     ["--moe-router-topk-scaling-factor=-2 must be > 0"]),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "0"],
     ["--moe-shared-expert-intermediate-size=0 must be a positive integer", "leave it out"]),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "-1"],
     ["--moe-expert-capacity-factor=-1 must be > 0"]),
    (["--num-experts", "4", "--moe-shared-expert-gate"],
     ["--moe-shared-expert-gate", "needs --moe-shared-expert-intermediate-size"]),
    (["--num-experts", "4", "--moe-token-drop-policy", "position"],
     ["--moe-token-drop-policy position", "needs --moe-expert-capacity-factor"]),
    (["--num-experts", "4", "--moe-router-bias-update-rate", "0.01"],
     ["--moe-router-bias-update-rate 0.01", "needs --moe-router-enable-expert-bias"]),
    (["--num-experts", "4", "--moe-router-score-function", "sigmoid",
      "--moe-router-pre-softmax"], ["--moe-router-pre-softmax", "softmax"]),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "none",
      "--moe-aux-loss-coeff", "0.1"], ["--moe-aux-loss-coeff 0.1", "aux_loss"]),
    (["--cp-comm-type", "a2a"], ["--cp-comm-type a2a", "--context-parallel-size is 1",
                                 "add --context-parallel-size N"]),
    (["--bf16", "--initial-loss-scale", "-5"],
     ["--initial-loss-scale -5", "only to --fp16", "must be > 0", "drop --initial-loss-scale"]),
    (["--initial-loss-scale", "1024"], ["--initial-loss-scale 1024", "only to --fp16"]),
    (["--bf16", "--loss-scale-window", "10"], ["--loss-scale-window 10", "only to --fp16"]),
])
def test_moe_cp_and_precision_values(tmp_path, data, capfd, flags, needles) -> None:
    # TP 2 without --sequence-parallel: a bad MoE value is named, not blamed on that.
    line = _train_refused(capfd, tmp_path, data, "--tensor-model-parallel-size", "2", *flags)
    for needle in needles:
        assert needle in line, (needle, line)
    assert "sequence-parallel" not in line, line


def test_eval_seq_length_past_the_position_table(tmp_path, data, capfd) -> None:
    args = _args(data)
    run = tmp_path / "saved"
    _checkpoint(run, step=2, config=model_config(args, 257), args=args)
    line = _refused(capfd, ["eval", str(run), "--data-path", data, "--seq-length", "1000"])
    assert "--seq-length=1000 is longer than the checkpoint's max_position_embeddings=16" in line
    assert "--seq-length 16 or less" in line, line


def _parse_refused(capfd, argv: list[str]) -> str:
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capfd.readouterr().err
    assert exit_.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # no usage block
    return lines[0]


def test_argparse_errors_are_one_line(capfd) -> None:
    line = _parse_refused(capfd, ["train", "--foo"])
    assert line == "domino train: error: unrecognized arguments: --foo; see domino train --help"
    line = _parse_refused(capfd, ["train", "--hiden-size", "8"])
    assert "unrecognized arguments: --hiden-size 8 (did you mean --hidden-size?)" in line
    line = _parse_refused(capfd, ["train", "--num-layers", "x"])
    assert line.startswith("domino train: error: argument --num-layers: invalid int value")
    line = _parse_refused(capfd, ["eval", "--data-path", "x"])
    assert "required: RUN_DIR" in line and line.endswith("; see domino eval --help")
    for command in ("generate", "bench", "convert", "preprocess"):
        line = _parse_refused(capfd, [command, "--no-such-flag"])
        assert line.startswith(f"domino {command}: error: "), line
        assert line.endswith(f"; see domino {command} --help"), line
    line = _parse_refused(capfd, ["trian"])
    assert line.startswith("domino: error: argument COMMAND: invalid choice: 'trian'"), line
    assert "(did you mean train?)" in line and line.endswith("; see domino --help"), line
