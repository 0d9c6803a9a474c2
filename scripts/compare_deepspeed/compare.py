"""Compare domino's Domino schedules with DeepSpeed's ``DominoTransformer`` on the same sizes.

Run with the project's venv (it imports ``domino``); DeepSpeed runs in its own venv, made by
``bash scripts/compare_deepspeed/setup.sh``::

    python scripts/compare_deepspeed/compare.py [--links loopback,1gbit,500mbit] [--rounds 4]

Per round and per link, our side is one ``domino bench`` run (sync, nocomm and four domino:*
modes, a few steps each) and DeepSpeed's side one run of ``ds_worker.py`` (DeepSpeed's Domino
transformer, cross-layer, the same sizes and loss), one after the other, the order alternating
every round. Emulated links are :class:`domino.netem.EmulatedLink` for both systems: each
rank in its own network namespace, joined by a veth shaped with the same tbf (rate, burst,
latency). A round's figure is the median step time of that run (a step's time being its
slowest rank's); the table shows, per link, the median over rounds and the range over rounds.
See README.md next to this file for the method and its caveats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: what the comparisons share

from peer_compare import (  # noqa: E402
    LOOPBACK,
    OurRounds,
    best_domino,
    check_peer_python,
    domino_version,
    fmt_ms,
    fmt_ratio,
    ours_from_report,
    peer_env,
    prepare_links,
    require_domino,
    run_bench,
    run_peer_ranks,
    shown_command,
)
from peer_compare import format_best_modes as _format_best_modes  # noqa: E402
from peer_compare import order_for_round as _order_for_round  # noqa: E402
from peer_compare import parse_links as _parse_links  # noqa: E402

WORKER = os.path.join(HERE, "ds_worker.py")
DEFAULT_DS_VENV = os.path.join(REPO, ".venv-deepspeed")
SETUP_CMD = "bash scripts/compare_deepspeed/setup.sh"

DEFAULT_MODES = ("sync,nocomm,domino:m2:cross,domino:m4:cross,domino:m2:cross:c2,"
                 "domino:m4:cross:c2")
DEFAULT_TP1_MODES = "sync,nocomm,domino:m2:cross"
TP1 = "TP=1"  # the single-process row's key
HEADER = ("link", "our sync", "our nocomm", "our best Domino", "DeepSpeed Domino",
          "DeepSpeed / ours")


# ---- pure helpers (unit-tested in tests/test_compare_deepspeed_script.py) --------------------


def parse_links(text: str) -> list[str]:
    """``"loopback,1gbit,500MBit"`` -> ``["loopback", "1gbit", "500mbit"]``."""
    return _parse_links(text, "loopback,1gbit,500mbit")


def order_for_round(index: int) -> tuple[str, str]:
    """Which system runs first in round ``index`` (0-based): ours on even rounds."""
    return _order_for_round(index, "deepspeed")


@dataclass
class LinkRounds(OurRounds):
    """Every round's figures for one row of the table (one link, or the TP=1 row)."""

    link: str
    tp: int
    gloo: bool = False  # our side with --no-shared-memory-comm (loopback only)

    @property
    def deepspeed(self) -> list[float]:
        return self.peer

    def add_deepspeed(self, step_times_s: Sequence[float]) -> None:
        self.peer.append(statistics.median(step_times_s))

    def summary(self) -> dict[str, Any]:
        return {"link": self.link, "tp": self.tp, "gloo": self.gloo,
                "our_tp_transport": sorted(set(self.transports)),
                **self.figures("deepspeed_domino", "deepspeed_over_ours")}


def row_label(link: str, tp: int, gloo: bool = False) -> str:
    if tp == 1:
        return "TP=1, 1 process (no comm; loopback)"
    if gloo:
        return f"{link}, ours over gloo (--no-shared-memory-comm)"
    return LOOPBACK if link == LOOPBACK else f"{link} emulated"


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """The markdown table, one row per summary (see :meth:`LinkRounds.summary`)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(["---"] + ["---:"] * 5) + "|"]
    for s in summaries:
        cells = (row_label(s["link"], s["tp"], s.get("gloo", False)), fmt_ms(s["our_sync"]),
                 fmt_ms(s["our_nocomm"]), fmt_ms(s["our_best_domino"]),
                 fmt_ms(s["deepspeed_domino"]),
                 fmt_ratio(s["deepspeed_over_ours"], s["deepspeed_over_ours_per_round"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_best_modes(summaries: Sequence[dict[str, Any]]) -> str:
    """Which of our domino:* modes was fastest, per row, over the rounds."""
    return _format_best_modes(
        summaries, lambda s: row_label(s["link"], s["tp"], s.get("gloo", False)))


def format_transports(summaries: Sequence[dict[str, Any]]) -> str:
    """How our TP group moved its bytes, per row (domino bench's report says)."""
    parts = [f"{row_label(s['link'], s['tp'], s.get('gloo', False))}: "
             f"{'/'.join(s['our_tp_transport'])}" for s in summaries
             if s.get("our_tp_transport") and s["tp"] > 1]
    return ("our TP collectives (DeepSpeed's are always gloo's): " + "; ".join(parts)
            if parts else "")


# ---- running the two systems -------------------------------------------------------------------


def size_flags(args: argparse.Namespace) -> list[str]:
    """The model / timing flags both sides take, spelled the same way."""
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads),
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--threads-per-rank", str(args.threads_per_rank), "--dtype", args.dtype,
            "--seed", str(args.seed), "--timeout", str(args.timeout)]


def run_ours(args: argparse.Namespace, link: str, tp: int, modes: str, workdir: str,
             tag: str, gloo: bool = False) -> tuple[dict[str, float], str]:
    """One ``domino bench`` run; ({mode: median step seconds}, how its TP group moved
    bytes)."""
    out = os.path.join(workdir, f"ours_{tag}.json")
    log = os.path.join(workdir, f"ours_{tag}.log")
    cmd = [sys.executable, "-m", "domino.cli", "bench", "--modes", modes, *size_flags(args),
           "--tensor-model-parallel-size", str(tp), "--device", "cpu", "--json", out]
    if link != LOOPBACK:
        cmd += ["--emulate-link", link]
    if gloo:
        cmd += ["--no-shared-memory-comm"]
    report = run_bench(cmd, out, log, REPO)
    transports = report["config"].get("transports") or {}
    return ours_from_report(report), transports.get("tp", "-")


def _ds_env(base: dict[str, str]) -> dict[str, str]:
    """The DeepSpeed ranks' environment: nothing from our venv may leak into theirs."""
    return peer_env(base, DS_ACCELERATOR="cpu")


def run_deepspeed(args: argparse.Namespace, link: str, tp: int, workdir: str,
                  tag: str) -> list[float]:
    """One DeepSpeed run of ``tp`` ranks (one per emulated host on an emulated link); the step
    times (max over ranks)."""
    out = os.path.join(workdir, f"ds_{tag}.json")
    logs = [os.path.join(workdir, f"ds_{tag}_rank{r}.log") for r in range(tp)]
    run_peer_ranks(tp, link, lambda rank: [args.ds_python, WORKER, *size_flags(args), "--out",
                                           out, "--log", logs[rank]],
                   logs, "deepspeed domino", args.timeout, args.threads_per_rank,
                   DS_ACCELERATOR="cpu")
    with open(out) as f:
        return json.load(f)["step_times_s"]


def deepspeed_info(ds_python: str) -> dict[str, str]:
    """Versions in the DeepSpeed venv; SystemExit naming the setup command when it is missing."""
    probe = ("import json, torch, deepspeed; from deepspeed.runtime.domino.transformer import "
             "DominoTransformer; print(json.dumps({'deepspeed': deepspeed.__version__, "
             "'torch': torch.__version__}))")
    return check_peer_python(ds_python, probe, "deepspeed's DominoTransformer", SETUP_CMD,
                             "--ds-python", _ds_env(dict(os.environ)))


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--links", default="loopback,1gbit,500mbit",
      help="comma-separated: loopback and/or tc rates to emulate (e.g. 1gbit, 500mbit; root)")
    a("--rounds", type=int, default=4, help="interleaved rounds per link")
    a("--steps", type=int, default=6, help="measured steps per run (per mode on our side)")
    a("--warmup", type=int, default=2, help="unmeasured steps per run (per mode on our side)")
    a("--modes", default=DEFAULT_MODES, help="our domino bench modes (TP=2 rows)")
    a("--tensor-model-parallel-size", type=int, default=2, help="TP size of the link rows")
    a("--tp1-rounds", type=int, default=2,
      help="rounds of the single-process TP=1 row (same compute, no comm); 0 leaves it out")
    a("--tp1-modes", default=DEFAULT_TP1_MODES, help="our modes in the TP=1 row")
    a("--num-layers", type=int, default=2)
    a("--hidden-size", type=int, default=512)
    a("--num-attention-heads", type=int, default=8)
    a("--seq-length", type=int, default=256)
    a("--micro-batch-size", type=int, default=8)
    a("--threads-per-rank", type=int, default=1)
    a("--dtype", choices=("fp32", "bf16"), default="fp32")
    a("--seed", type=int, default=1234)
    a("--timeout", type=float, default=300.0, help="seconds a rank may wait for a peer")
    a("--ds-python", default=os.path.join(DEFAULT_DS_VENV, "bin", "python"),
      help=f"python of the DeepSpeed venv (made by {SETUP_CMD})")
    a("--no-gloo-row", dest="gloo_row", action="store_false",
      help="leave out the loopback row whose our side runs over gloo (--no-shared-memory-comm) "
           "instead of the shared-memory transport")
    a("--json", metavar="PATH", default=None, help="also write every round's figures here")
    a("--keep-dir", metavar="DIR", default=None,
      help="keep every run's raw JSON and logs here (default: a temporary directory)")
    args = p.parse_args(argv)
    for name in ("rounds", "steps", "threads_per_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.tp1_rounds < 0:
        p.error("--warmup and --tp1-rounds must be >= 0")
    if args.tensor_model_parallel_size < 2:
        p.error("--tensor-model-parallel-size must be >= 2 (the TP=1 row is --tp1-rounds)")
    try:
        args.link_list = parse_links(args.links)
    except ValueError as err:
        p.error(str(err))
    return args


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(args: argparse.Namespace, workdir: str) -> list[LinkRounds]:
    """All rounds; one :class:`LinkRounds` per row, the TP=1 row last."""
    tp = args.tensor_model_parallel_size
    rows = [LinkRounds(link, tp) for link in args.link_list]
    if LOOPBACK in args.link_list and args.gloo_row:
        rows.insert(args.link_list.index(LOOPBACK) + 1, LinkRounds(LOOPBACK, tp, gloo=True))
    tp1 = LinkRounds(LOOPBACK, 1) if args.tp1_rounds else None
    for r in range(max(args.rounds, args.tp1_rounds)):
        order = order_for_round(r)
        jobs = [(row, args.modes) for row in rows if r < args.rounds]
        if tp1 is not None and r < args.tp1_rounds:
            jobs.append((tp1, args.tp1_modes))
        for row, modes in jobs:
            label = row_label(row.link, row.tp, row.gloo)
            for system in order:
                tag = f"r{r}_{'tp1' if row.tp == 1 else row.link}{'_gloo' if row.gloo else ''}"
                t0 = time.monotonic()
                if system == "ours":
                    times, transport = run_ours(args, row.link, row.tp, modes, workdir, tag,
                                                row.gloo)
                    row.add_ours(times)
                    row.transports.append(transport)
                    best = best_domino(times)
                    what = (f"best {best[0]} {best[1] * 1e3:.0f} ms" if best else
                            f"sync {times.get('sync', float('nan')) * 1e3:.0f} ms")
                else:
                    steps = run_deepspeed(args, row.link, row.tp, workdir, tag)
                    row.add_deepspeed(steps)
                    what = f"median {statistics.median(steps) * 1e3:.0f} ms"
                _log(f"[round {r + 1}] {label}: {system}: {what} "
                     f"({time.monotonic() - t0:.0f} s)")
    return rows + ([tp1] if tp1 is not None else [])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_domino()
    info = deepspeed_info(args.ds_python)
    prepare_links(args.link_list)
    import torch

    command = shown_command(sys.argv[0], REPO, argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    _log(f"compare: deepspeed {info['deepspeed']} (torch {info['torch']}) vs domino "
         f"(torch {torch.__version__}); links {','.join(args.link_list)}, {args.rounds} rounds")
    t0 = time.monotonic()
    if args.keep_dir is not None:
        os.makedirs(args.keep_dir, exist_ok=True)
        rows = measure(args, args.keep_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="compare-deepspeed-") as tmp:
            rows = measure(args, tmp)
    elapsed = time.monotonic() - t0
    summaries = [row.summary() for row in rows]
    desc = (f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} "
            f"heads, seq {args.seq_length}, batch {args.micro_batch_size}, {args.dtype}, "
            f"{args.threads_per_rank} thread(s)/rank, CPU")
    lines = [
        f"Date: {started.isoformat(timespec='seconds')}; command: `{command}`",
        "",
        f"Median ms of one forward+backward step, TP={args.tensor_model_parallel_size} unless "
        f"noted; {desc}. Each cell: median over rounds of each round's median (range over rounds "
        f"in brackets); {args.rounds} interleaved rounds ({args.tp1_rounds} for TP=1), "
        f"{args.steps} steps after {args.warmup} warm-up per run and mode. DeepSpeed "
        f"{info['deepspeed']} (torch {info['torch']}) DominoTransformer, cross-layer, 2 halves; "
        f"ours: domino {domino_version()} (torch {torch.__version__}), best of "
        f"{', '.join(m for m in args.modes.split(',') if m.strip().startswith('domino:'))}. "
        f"DeepSpeed / ours = DeepSpeed median / our best Domino median (per-round ratios in "
        f"brackets). Took {elapsed / 60:.1f} min on {os.cpu_count()} CPUs.",
        "",
        format_table(summaries),
        "",
        format_best_modes(summaries),
        "",
        format_transports(summaries),
    ]
    print("\n".join(lines), flush=True)
    if args.json is not None:
        report = {
            "command": command, "date": started.isoformat(timespec="seconds"),
            "elapsed_s": elapsed, "config": {k: v for k, v in vars(args).items()},
            "deepspeed_version": info["deepspeed"], "deepspeed_torch_version": info["torch"],
            "torch_version": torch.__version__, "python_version": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "rows": [{**s, "rounds": {"our_sync_s": row.sync, "our_nocomm_s": row.nocomm,
                                      "our_best_domino_s": row.best,
                                      "our_best_domino_mode": row.best_mode,
                                      "deepspeed_domino_s": row.deepspeed}}
                     for s, row in zip(summaries, rows)],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
