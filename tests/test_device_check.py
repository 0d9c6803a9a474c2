"""The prepared accelerator check runs on CPU here: its TP=2 section reports every schedule as
exact, and its readiness section (tiny sizes) prints its whole table.

One run of the whole script's ``main`` (``--section all``, what the GPU run uses) serves both
checks; the section selection is checked in-process too. Only the table's shape is checked (a
row per plan and size, numeric split costs and MFU, the goal lines); timing values are never
asserted on.
"""

import contextlib
import importlib.util
import io
import os
import re
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
from tp_helpers import one_thread

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"
PLANS = ("m1:none", "m2:cross", "m4:cross")
TAGS = ("h64", "h128", "gpt")  # the two tiny stack sizes and the tiny stand-in of the 1B model
ROW = re.compile(r"^\s*(h\d+|gpt)( compiled)? (m\d+:\w+)"
                 r"\s+step\s+(\d+\.\d+) ms\s+split cost\s+([+-]\d+\.\d+)%"
                 r"\s+MFU\s+(\S+)", re.M)


def _writing_to(rank: int, fn, folder: str, args: tuple) -> None:
    """``fn(rank, *args)`` with this process's stdout and stderr in ``folder``: a rank forked
    from the fork server writes to the server's, not to the test's."""
    with open(f"{folder}/{rank}.out", "w") as out, open(f"{folder}/{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            fn(rank, *args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def _forked_spawn(fn, args=(), nprocs=1, join=True):
    """``torch.multiprocessing.spawn`` with the ranks forked from the session's fork server
    (torch imported there once: tests/dist.py) instead of fresh interpreters importing it; what
    they print is printed here afterwards (rank order), to this process's ``sys.stdout``."""
    import torch.multiprocessing as mp
    from dist import PRELOAD

    mp.set_forkserver_preload(PRELOAD)  # the session's server (read when it first starts)
    with tempfile.TemporaryDirectory() as folder:
        try:
            return mp.start_processes(_writing_to, args=(fn, folder, args), nprocs=nprocs,
                                      join=join, start_method="forkserver")
        finally:
            for rank in range(nprocs):
                for suffix, stream in (("out", sys.stdout), ("err", sys.stderr)):
                    path = Path(folder) / f"{rank}.{suffix}"
                    if path.exists():
                        stream.write(path.read_text())
                        stream.flush()


@pytest.fixture(scope="module")
def run() -> tuple[str, str]:
    # The script's main in this process and its TP=2 ranks forked from the session's fork
    # server: three interpreters importing torch fewer than `python device_check.py`. The ranks
    # import the script by name, so it is loaded as `device_check` from scripts/ on sys.path
    # (which they inherit). One thread (the TP=2 ranks set it themselves): on a busy 2-core
    # host the readiness section's OpenMP threads spin against the other tests' processes,
    # several times slower. One timed round per plan and a short sequence are enough for the
    # table's shape; timings are never asserted on. The global RNG the script seeds is
    # restored afterwards.
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = script
    try:
        spec.loader.exec_module(script)
        out, err = io.StringIO(), io.StringIO()
        with pytest.MonkeyPatch.context() as mp, one_thread(), torch.random.fork_rng(), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            mp.setattr(script, "mp", types.SimpleNamespace(spawn=_forked_spawn))
            rc = script.main(["--device", "cpu", "--steps", "1", "--tiny", "--peak-tflops", "1",
                              "--rounds", "1", "--seq", "16"])
    finally:
        sys.modules.pop("device_check", None)
        sys.path.remove(str(SCRIPT.parent))
    text = out.getvalue() + err.getvalue()
    assert rc == 0, text
    return out.getvalue(), text


def test_tp2_section_on_cpu(run) -> None:
    stdout, text = run
    assert "DEVICE CHECK OK" in stdout, text
    assert stdout.count("max relative error vs sync") == 5, text


def test_readiness_section_on_cpu(run) -> None:
    stdout, text = run
    assert "READINESS DONE" in stdout and "with errors" not in stdout, text
    assert "OOM at" not in stdout and "ERROR at" not in stdout, text
    found = ROW.findall(stdout)
    rows = {(tag + compiled, plan): (float(cost), mfu)
            for tag, compiled, plan, _ms, cost, mfu in found}
    assert set(rows) == {(t, p) for t in TAGS for p in PLANS}, text
    for (tag, plan), (cost, mfu) in rows.items():
        assert mfu.endswith("%") and float(mfu[:-1]) >= 0.0, (tag, plan, mfu)
        if plan == "m1:none":
            assert cost == 0.0  # the unsplit row is the baseline of its size
    assert "goal: split costs <= 5% at hidden >= 2048" in stdout
    assert re.search(r"goal: 1B model >= 45% bf16 MFU: unsplit (MET|NOT MET)", stdout), text
    assert re.search(r"1B model MFU: unsplit m1:none [\d.]+ ms [\d.]+%; best split m[24]:cross",
                     stdout), text


@pytest.mark.parametrize("section, expected", [("all", ["tp2", "readiness"]),
                                               ("tp2", ["tp2"]), ("readiness", ["readiness"])])
def test_section_runs_only_what_it_names(monkeypatch, section, expected) -> None:
    script = _script(monkeypatch)
    ran = []
    monkeypatch.setattr(script, "run_tp2", lambda args: ran.append("tp2") or True)
    monkeypatch.setattr(script, "run_readiness", lambda args: ran.append("readiness") or True)
    assert script.main(["--device", "cpu", "--section", section]) == 0
    assert ran == expected


def _script(monkeypatch):
    spec = importlib.util.spec_from_file_location("device_check_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look themselves up
    spec.loader.exec_module(script)
    return script


def test_compile_both_times_every_size_eager_then_compiled(monkeypatch, capsys) -> None:
    """--compile both: each stack size and the model run eager, then with compiled pieces
    (the runtime they are built with says so); the split-cost summary reads the eager rows.
    (Compiled pieces themselves are checked in test_compile.py; here only the wiring, so the
    suite does not pay for compiling three more models.)"""
    script = _script(monkeypatch)
    calls = []
    plans = ("m1:none", "m2:cross", "m4:cross")

    def fake(kind):
        def run(shape, plans_, device, precision, warmup, rounds, peak, compile, backend):
            runtime = script._runtime(precision, compile, backend)
            calls.append((kind, shape.hidden, runtime.compile, runtime.compile_backend))
            return {p: (1.0, 0.0 if p == plans[0] else (3.0 if compile else 1.0), 0.5)
                    for p in plans}
        return run

    monkeypatch.setattr(script, "_stack_size", fake("stack"))
    monkeypatch.setattr(script, "_gpt_model", fake("gpt"))
    script.main(["--device", "cpu", "--section", "readiness", "--compile", "both",
                 "--compile-backend", "aot_eager"])
    assert calls == [("stack", 64, False, "aot_eager"), ("stack", 64, True, "aot_eager"),
                     ("stack", 128, False, "aot_eager"), ("stack", 128, True, "aot_eager"),
                     ("gpt", 128, False, "aot_eager"), ("gpt", 128, True, "aot_eager")]
    out = capsys.readouterr().out
    assert "hidden 64: split cost vs unsplit: m2:cross +1.00%" in out  # eager's rows
