"""What the side-by-side benchmarks against other systems share (``compare_deepspeed/``,
``compare_megatron_moe/``, ``compare_fsdp/``): the venv and link checks, parsing the links,
alternating who runs first, the per-round figures and their formatting, running our ``domino
bench`` and the peer's ranks (each rank its own emulated host on an emulated link, exactly as
``domino bench`` does), and labels.

Imported by each ``compare.py`` from this folder (run with the project's venv).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

LOOPBACK = "loopback"

# What must not leak from our venv into a peer's processes.
_VENV_VARS = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")


def require_domino() -> None:
    """SystemExit unless this Python has domino (the comparisons run from the project's venv)."""
    try:
        import domino  # noqa: F401
    except ImportError:
        raise SystemExit("compare.py: run it with the project's venv (it imports domino), e.g. "
                         ". .venv/bin/activate") from None


def prepare_links(links: Sequence[str]) -> None:
    """Where ``links`` need the emulated link: SystemExit unless this machine can emulate it,
    and the network namespaces killed runs left removed."""
    if all(link == LOOPBACK for link in links):
        return
    from domino.netem import check_can_emulate, cleanup_stale

    try:
        check_can_emulate()
    except RuntimeError as err:
        raise SystemExit(f"compare.py: {err}") from None
    cleanup_stale()


def shown_command(script: str, repo: str, argv: Sequence[str] | None) -> str:
    """The command line that ran ``script``, relative to ``repo``, for the report."""
    return shlex.join(["python", os.path.relpath(os.path.abspath(script), repo),
                       *(sys.argv[1:] if argv is None else argv)])


def parse_links(text: str, example: str = "loopback,1gbit") -> list[str]:
    """``"loopback,1gbit,500MBit"`` -> ``["loopback", "1gbit", "500mbit"]`` (rates validated,
    repeats dropped, order kept)."""
    from domino.netem import parse_rate

    links: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        if not name:
            continue
        if name != LOOPBACK:
            name = parse_rate(name)  # ValueError naming the accepted units
        if name not in links:
            links.append(name)
    if not links:
        raise ValueError(f"--links is empty; give e.g. {example}")
    return links


def order_for_round(index: int, peer: str) -> tuple[str, str]:
    """Which system runs first in round ``index`` (0-based): ours on even rounds."""
    return ("ours", peer) if index % 2 == 0 else (peer, "ours")


def best_domino(step_times: dict[str, float]) -> tuple[str, float] | None:
    """The fastest comm-enabled Domino mode (``domino:*``) of one run, or None without one."""
    domino = {m: t for m, t in step_times.items() if m.startswith("domino:")}
    if not domino:
        return None
    mode = min(domino, key=domino.__getitem__)
    return mode, domino[mode]


def ours_from_report(report: dict[str, Any]) -> dict[str, float]:
    """``domino bench --json`` report -> {mode: median step seconds of that run}."""
    return {r["mode"]: float(r["step_time_s"]) for r in report["results"]}


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """Median, min and max of the per-round figures (None for no rounds)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": len(values)}


def fmt_ms(summary: dict[str, float] | None) -> str:
    """Seconds summary -> ``"812 (670-1013)"`` in ms; a single round has no range."""
    if summary is None:
        return "-"
    med, lo, hi = (round(summary[k] * 1e3) for k in ("median", "min", "max"))
    return f"{med}" if summary["rounds"] < 2 else f"{med} ({lo}-{hi})"


def fmt_ratio(ratio: float | None, per_round: Sequence[float]) -> str:
    """``"1.52x (1.31-1.70)"``: the ratio of medians, then the range of per-round ratios."""
    if ratio is None:
        return "-"
    text = f"{ratio:.2f}x"
    if len(per_round) >= 2:
        text += f" ({min(per_round):.2f}-{max(per_round):.2f})"
    return text


@dataclass
class OurRounds:
    """Our side's figures of one table row over the rounds, and the peer's median step time
    per round (``peer``); a comparison's row class adds its own fields."""

    _: KW_ONLY
    sync: list[float] = field(default_factory=list)
    nocomm: list[float] = field(default_factory=list)
    best: list[float] = field(default_factory=list)
    best_mode: list[str] = field(default_factory=list)
    transports: list[str] = field(default_factory=list)  # how our groups moved bytes
    peer: list[float] = field(default_factory=list)

    def add_ours(self, step_times: dict[str, float]) -> None:
        if "sync" in step_times:
            self.sync.append(step_times["sync"])
        if "nocomm" in step_times:
            self.nocomm.append(step_times["nocomm"])
        best = best_domino(step_times)
        if best is not None:
            self.best_mode.append(best[0])
            self.best.append(best[1])

    def figures(self, peer_key: str, ratio_key: str) -> dict[str, Any]:
        """The row's summary: ours, the peer's (``peer_key``), their ratio of medians and
        per-round ratios (``ratio_key``) and how often each Domino mode was our best."""
        best, peer = summarize(self.best), summarize(self.peer)
        # Per-round ratios pair runs made in the same round (next to each other in time).
        counts: dict[str, int] = {}
        for m in self.best_mode:
            counts[m] = counts.get(m, 0) + 1
        return {"our_sync": summarize(self.sync), "our_nocomm": summarize(self.nocomm),
                "our_best_domino": best, peer_key: peer,
                ratio_key: peer["median"] / best["median"] if best and peer else None,
                f"{ratio_key}_per_round": [p / b for p, b in zip(self.peer, self.best)],
                "best_mode_counts": counts}


def format_best_modes(summaries: Sequence[dict[str, Any]],
                      label: Callable[[dict[str, Any]], str]) -> str:
    """Which of our domino:* modes was fastest, per row (``label`` names it), over the
    rounds."""
    parts = []
    for s in summaries:
        counts = sorted(s["best_mode_counts"].items(), key=lambda kv: (-kv[1], kv[0]))
        if counts:
            modes = ", ".join(f"{m.removeprefix('domino:')} x{n}" for m, n in counts)
            parts.append(f"{label(s)}: {modes}")
    return "our best Domino mode per round: " + "; ".join(parts) if parts else ""


class RunFailed(RuntimeError):
    pass


def tail(path: str, lines: int = 40) -> str:
    """The last ``lines`` of a log (for an error message)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def run_bench(cmd: list[str], out: str, log: str, cwd: str) -> dict[str, Any]:
    """Run one ``domino bench`` command, its output in ``log``; its JSON report (``out``)."""
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, check=False)
    if proc.returncode != 0:
        raise RunFailed(f"domino bench failed (exit {proc.returncode}); log {log}:\n{tail(log)}")
    with open(out) as f:
        return json.load(f)


def peer_env(base: dict[str, str], **extra: str) -> dict[str, str]:
    """A peer's process environment: ``base`` without our venv's variables, plus ``extra``."""
    env = {k: v for k, v in base.items() if k not in _VENV_VARS}
    env.update(extra)
    return env


def run_peer_ranks(world: int, link: str, command: Callable[[int], list[str]],
                   logs: Sequence[str], label: str, timeout: float, threads: int,
                   **env_extra: str) -> None:
    """Run ``world`` peer ranks (``command(rank)``), on loopback or each in its own emulated
    host of ``link`` (:class:`domino.netem.EmulatedLink`: the same class, rate and defaults
    - burst, latency, MTU - ``domino bench`` uses); :class:`RunFailed` with the ranks' log
    tails when one fails."""
    from domino.netem import EmulatedLink
    from domino.supervisor import RankFailed, local_env, run_ranks
    from domino.utils import free_port

    def launch(emulated: EmulatedLink | None) -> None:
        # A fresh namespace has every port free; on loopback pick one that is free now.
        port = 29500 if emulated is not None else free_port()
        commands, envs = [], []
        for rank in range(world):
            env = peer_env(local_env(rank, world, port, OMP_NUM_THREADS=str(threads),
                                     MKL_NUM_THREADS=str(threads)), **env_extra)
            argv = command(rank)
            if emulated is not None:
                env.update(emulated.env_for(rank, port))
                env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
                argv = emulated.wrap(rank, argv)
            else:
                env["GLOO_SOCKET_IFNAME"] = "lo"
            commands.append(argv)
            envs.append(env)
        run_ranks(commands, envs, label=label, straggler_s=timeout)

    try:
        if link == LOOPBACK:
            launch(None)
        else:
            with EmulatedLink(num_hosts=world, rate=link) as emulated:
                launch(emulated)
    except RankFailed as err:
        tails = "\n".join(f"--- {p}:\n{tail(p)}" for p in logs)
        raise RunFailed(f"{err}\n{tails}") from err


def package_version(name: str) -> str:
    """An installed package's version, as a label ("?" when unknown)."""
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # only a label
        return "?"


def domino_version() -> str:
    return package_version("domino-lm")


def git_commit(repo: str) -> str:
    """The repository's short HEAD, as a label."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def check_peer_python(python: str, probe: str, what: str, setup_cmd: str, flag: str,
                      env: dict[str, str]) -> dict[str, str]:
    """Run ``probe`` (prints one JSON line of versions) with a peer venv's ``python``;
    SystemExit naming ``setup_cmd`` when the venv is missing or cannot import ``what``."""
    if not os.path.exists(python):
        raise SystemExit(f"compare.py: the peer venv's python {python} does not exist; create "
                         f"the venv with: {setup_cmd} (or pass {flag})")
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"compare.py: {python} cannot import {what} "
                         f"({proc.stderr.strip().splitlines()[-1:]}); rerun: {setup_cmd}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
