"""The prepared accelerator check runs on CPU here: its TP=2 section reports every schedule as
exact, and its readiness section (tiny sizes) prints its whole table.

One run of the whole script (``--section all``, what the GPU run uses) serves both checks; the
section selection is checked in-process. Only the table's shape is checked (a row per plan and
size, numeric split costs and MFU, the goal lines); timing values are never asserted on.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"
PLANS = ("m1:none", "m2:cross", "m4:cross")
TAGS = ("h64", "h128", "gpt")  # the two tiny stack sizes and the tiny stand-in of the 1B model
ROW = re.compile(r"^\s*(h\d+|gpt)( compiled)? (m\d+:\w+)\s+step\s+(\d+\.\d+) ms\s+split cost\s+([+-]\d+\.\d+)%"
                 r"\s+MFU\s+(\S+)", re.M)


@pytest.fixture(scope="module")
def run() -> tuple[str, str]:
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--steps", "1",
                          "--tiny", "--peak-tflops", "1", "--compile", "both",
                          "--compile-backend", "aot_eager"],
                         capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    return out.stdout, text


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
    # --compile both: every size and the model eager, then with compiled pieces
    assert set(rows) == {(t + c, p) for t in TAGS for c in ("", " compiled") for p in PLANS}, text
    assert re.search(r"h64 compiled: compiled \d+ graphs in [\d.]+ s", stdout), text
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
    spec = importlib.util.spec_from_file_location("device_check_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look themselves up
    spec.loader.exec_module(script)
    ran = []
    monkeypatch.setattr(script, "run_tp2", lambda args: ran.append("tp2") or True)
    monkeypatch.setattr(script, "run_readiness", lambda args: ran.append("readiness") or True)
    assert script.main(["--device", "cpu", "--section", section]) == 0
    assert ran == expected
