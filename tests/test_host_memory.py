"""A CPU rank keeps its freed memory (``domino.host_memory``): the page faults it saves, the
setting's checks (a bench run's ranks applying it: ``test_bench.py::test_real_two_rank_run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from domino import host_memory
from domino.supervisor import run_ranks

# A step's allocations of mixed sizes (8, 4, 16, 40 MiB, one freed mid-step), as a training
# step makes and frees activations: minor page faults per round, in a fresh interpreter.
_ROUNDS = r"""
import json, resource, sys, torch
from domino.host_memory import keep_freed_memory
applied = keep_freed_memory()
def step():
    a = torch.empty(2 << 20).fill_(1)
    b = torch.empty(1 << 20).fill_(1)
    c = torch.empty(4 << 20).fill_(1)
    del b
    d = torch.empty(10 << 20).fill_(1)
    return float(a.sum() + c.sum() + d.sum())
faults = []
for _ in range(8):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _rounds(setting: str) -> dict:
    env = dict(os.environ, **{host_memory.ENV: setting})
    out = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_freed_memory_is_kept_instead_of_faulted_back_in() -> None:
    on, off = _rounds("on"), _rounds("off")
    assert on["applied"] and not off["applied"]
    # After the first rounds (the heap grows to the step's peak once) glibc's defaults fault
    # most of each round's 68 MiB back in (17,408 pages); kept, rounds fault (almost) nothing.
    steady_on, steady_off = sum(on["faults"][2:]), sum(off["faults"][2:])
    assert steady_off > 6 * 4096, off
    assert steady_on < steady_off / 3, (on, off)


def test_the_setting_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(host_memory.ENV, "yes")
    with pytest.raises(ValueError, match=r"DOMINO_MALLOC_TUNING='yes': must be 'on'.*'off'"):
        host_memory.keep_freed_memory()
    # checked by the launcher before any rank starts
    with pytest.raises(ValueError, match="DOMINO_MALLOC_TUNING"):
        run_ranks([[sys.executable, "-c", "raise SystemExit(3)"]], [dict(os.environ)],
                  label="never started")
    monkeypatch.setenv(host_memory.ENV, "off")
    assert host_memory.enabled() is False and host_memory.keep_freed_memory() is False
    monkeypatch.delenv(host_memory.ENV)
    assert host_memory.enabled() is True  # the default
