"""The device check's readiness section runs (tiny sizes, on CPU) and prints its whole table.

Only the table's shape is checked (a row per plan and size, numeric split costs and MFU, the
goal lines); timing values are never asserted on.
"""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"
PLANS = ("m1:none", "m2:cross", "m4:cross")
TAGS = ("h64", "h128", "gpt")  # the two tiny stack sizes and the tiny stand-in of the 1B model
ROW = re.compile(r"^\s*(h\d+|gpt) (m\d+:\w+)\s+step\s+(\d+\.\d+) ms\s+split cost\s+([+-]\d+\.\d+)%"
                 r"\s+MFU\s+(\S+)", re.M)


def test_readiness_section_on_cpu() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--section", "readiness", "--device",
                          "cpu", "--tiny", "--peak-tflops", "1"],
                         capture_output=True, text=True, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "READINESS DONE" in out.stdout and "with errors" not in out.stdout, text
    assert "OOM at" not in out.stdout and "ERROR at" not in out.stdout, text
    assert "section tp2" not in out.stdout  # --section readiness runs that section only
    found = ROW.findall(out.stdout)
    rows = {(tag, plan): (float(cost), mfu) for tag, plan, _ms, cost, mfu in found}
    assert set(rows) == {(t, p) for t in TAGS for p in PLANS}, text
    for (tag, plan), (cost, mfu) in rows.items():
        assert mfu.endswith("%") and float(mfu[:-1]) >= 0.0, (tag, plan, mfu)
        if plan == "m1:none":
            assert cost == 0.0  # the unsplit row is the baseline of its size
    assert "goal: split costs <= 5% at hidden >= 2048" in out.stdout
    assert re.search(r"goal: 1B model >= 45% bf16 MFU: unsplit (MET|NOT MET)", out.stdout), text
    assert re.search(r"1B model MFU: unsplit m1:none [\d.]+ ms [\d.]+%; best split m[24]:cross",
                     out.stdout), text
