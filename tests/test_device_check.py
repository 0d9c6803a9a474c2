"""The prepared accelerator check runs (on CPU here) and reports every schedule as exact."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"


def test_device_check_script_on_cpu() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--steps", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "DEVICE CHECK OK" in out.stdout
    assert out.stdout.count("max relative error vs sync") == 5
