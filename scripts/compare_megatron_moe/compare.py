"""Compare domino's MoE layer (EP all-to-all, Domino schedules) with Megatron-core's ``MoELayer``.

Run with the project's venv (it imports ``domino``); Megatron-core runs in its own venv, made by
``bash scripts/compare_megatron_moe/setup.sh``::

    python scripts/compare_megatron_moe/compare.py [--links loopback,1gbit] [--rounds 4]

Per round and per link, our side is one ``domino bench --model moe`` run (sync, nocomm and
domino:* modes, a few steps each) and Megatron's side one run of ``mcore_worker.py`` (Megatron's
``MoELayer`` with the alltoall token dispatcher and SequentialMLP experts, the same sizes and
loss), one after the other, the order alternating every round. Both run expert parallelism over
EP ranks (default 2, TP=1), each rank with its own tokens. Emulated links are
:class:`domino.netem.EmulatedLink` for both systems: each rank in its own network namespace,
joined by a veth shaped with the same tbf (rate, burst, latency). A round's figure is the median
step time of that run (a step's time being its slowest rank's); the table shows, per link, the
median over rounds and the range over rounds. See README.md next to this file for the method
and its caveats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    package_version,
    peer_env,
    prepare_links,
    require_domino,
    run_bench,
    run_peer_ranks,
    shown_command,
)
from peer_compare import format_best_modes as _format_best_modes  # noqa: E402
from peer_compare import git_commit as _git_commit  # noqa: E402
from peer_compare import order_for_round as _order_for_round  # noqa: E402
from peer_compare import parse_links as _parse_links  # noqa: E402

WORKER = os.path.join(HERE, "mcore_worker.py")
DEFAULT_MCORE_VENV = os.path.join(REPO, ".venv-megatron")
SETUP_CMD = "bash scripts/compare_megatron_moe/setup.sh"

DEFAULT_MODES = ("sync,nocomm,domino:m2:cross,domino:m2:cross:c2,domino:m1:cross:c2,"
                 "domino:m1:cross:c4")
HEADER = ("link", "our sync", "our nocomm", "our best Domino", "Megatron alltoall",
          "Megatron / ours")


# ---- pure helpers (unit-tested in tests/test_compare_megatron_script.py) ---------------------


def parse_links(text: str) -> list[str]:
    """``"loopback,1GBit,500mbit"`` -> ``["loopback", "1gbit", "500mbit"]``."""
    return _parse_links(text, "loopback,1gbit")


def order_for_round(index: int) -> tuple[str, str]:
    """Which system runs first in round ``index`` (0-based): ours on even rounds."""
    return _order_for_round(index, "megatron")


def transports_label(report: dict[str, Any]) -> str:
    """How our run's groups moved their bytes, from its report's ``config.transports``
    (``{"tp": "shm", "ep": "gloo"}`` -> ``"ep gloo, tp shm"``; ``"-"`` when it says nothing)."""
    transports = report.get("config", {}).get("transports") or {}
    if isinstance(transports, str):
        return transports
    return ", ".join(f"{k} {v}" for k, v in sorted(transports.items())) or "-"


def copies_summary(copies: dict[str, Sequence[int]]) -> dict[str, float]:
    """Megatron's per-step dispatch token copies per direction -> the median per direction."""
    return {k: statistics.median(v) for k, v in sorted(copies.items()) if v}


@dataclass
class LinkRounds(OurRounds):
    """Every round's figures for one row of the table (one link)."""

    link: str
    gloo: bool = False  # our side with --no-shared-memory-comm (loopback only)
    copies: list[dict[str, float]] = field(default_factory=list)  # Megatron's, per round

    @property
    def megatron(self) -> list[float]:
        return self.peer

    def add_megatron(self, report: dict[str, Any]) -> float:
        """One worker report (rank 0's JSON); that run's median step seconds."""
        median = statistics.median(report["step_times_s"])
        self.peer.append(median)
        self.copies.append(copies_summary(report.get("dispatch_token_copies_per_step", {})))
        return median

    def summary(self) -> dict[str, Any]:
        directions = sorted({k for c in self.copies for k in c})
        copies = {d: statistics.median([c[d] for c in self.copies if d in c]) for d in directions}
        return {"link": self.link, "gloo": self.gloo,
                "our_transports": sorted(set(self.transports)),
                **self.figures("megatron_alltoall", "megatron_over_ours"),
                "megatron_dispatch_copies_per_step": copies}


def row_label(link: str, gloo: bool = False) -> str:
    if gloo:
        return f"{link}, ours over gloo (--no-shared-memory-comm)"
    return LOOPBACK if link == LOOPBACK else f"{link} emulated"


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """The markdown table, one row per summary (see :meth:`LinkRounds.summary`)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(["---"] + ["---:"] * 5) + "|"]
    for s in summaries:
        cells = (row_label(s["link"], s.get("gloo", False)), fmt_ms(s["our_sync"]),
                 fmt_ms(s["our_nocomm"]), fmt_ms(s["our_best_domino"]),
                 fmt_ms(s["megatron_alltoall"]),
                 fmt_ratio(s["megatron_over_ours"], s["megatron_over_ours_per_round"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_best_modes(summaries: Sequence[dict[str, Any]]) -> str:
    """Which of our domino:* modes was fastest, per row, over the rounds."""
    return _format_best_modes(summaries, lambda s: row_label(s["link"], s.get("gloo", False)))


def format_transports(summaries: Sequence[dict[str, Any]]) -> str:
    """How our groups moved their bytes, per row (domino bench's report says)."""
    parts = [f"{row_label(s['link'], s.get('gloo', False))}: {'/'.join(s['our_transports'])}"
             for s in summaries if s.get("our_transports")]
    return ("our collectives (Megatron's are always gloo's): " + "; ".join(parts)
            if parts else "")


def format_copies(summaries: Sequence[dict[str, Any]]) -> str:
    """Megatron's dispatch all-to-all token copies per step and direction, per row."""
    parts = []
    for s in summaries:
        copies = s.get("megatron_dispatch_copies_per_step") or {}
        if copies:
            text = ", ".join(f"{d} {v:g}" for d, v in copies.items())
            parts.append(f"{row_label(s['link'], s.get('gloo', False))}: {text}")
    return ("Megatron dispatch token copies per step (median; the combine sends as many back, "
            "backward repeats both): " + "; ".join(parts) if parts else "")


# ---- the two systems' command lines -------------------------------------------------------------


def shared_flags(args: argparse.Namespace) -> list[str]:
    """The model / timing flags both sides take, spelled the same way."""
    flags = ["--hidden-size", str(args.hidden_size),
             "--moe-ffn-hidden-size", str(args.moe_ffn_hidden_size),
             "--num-experts", str(args.num_experts), "--moe-router-topk", str(args.moe_router_topk),
             "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
             "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--threads-per-rank", str(args.threads_per_rank), "--dtype", args.dtype,
             "--seed", str(args.seed), "--timeout", str(args.timeout),
             "--moe-aux-loss-coeff", repr(args.moe_aux_loss_coeff)]
    if args.force_load_balancing:
        flags.append("--moe-router-force-load-balancing")
    if args.swiglu:
        flags.append("--swiglu")
    return flags


def ours_command(args: argparse.Namespace, link: str, out: str, gloo: bool = False,
                 python: str | None = None) -> list[str]:
    """The ``domino bench --model moe`` command of one run of our side."""
    cmd = [python or sys.executable, "-m", "domino.cli", "bench", "--model", "moe",
           "--num-layers", "1", *shared_flags(args),
           "--tensor-model-parallel-size", "1",
           "--expert-model-parallel-size", str(args.expert_model_parallel_size),
           "--modes", args.modes, "--device", "cpu", "--json", out]
    if link != LOOPBACK:
        cmd += ["--emulate-link", link]
    if gloo:
        cmd += ["--no-shared-memory-comm"]
    return cmd + shlex.split(args.ours_extra_args)


def megatron_command(args: argparse.Namespace, out: str, log: str) -> list[str]:
    """One Megatron rank's command (the same for every rank; the rank is in its environment)."""
    return [args.mcore_python, WORKER, *shared_flags(args), "--unit", args.megatron_unit,
            "--out", out, "--log", log]


def megatron_env(base: dict[str, str]) -> dict[str, str]:
    """A Megatron rank's environment: nothing from our venv may leak into theirs."""
    return peer_env(base)


# ---- running the two systems -------------------------------------------------------------------


def run_ours(args: argparse.Namespace, link: str, workdir: str, tag: str,
             gloo: bool = False) -> tuple[dict[str, float], str]:
    """One ``domino bench --model moe`` run; ({mode: median step seconds}, how its groups moved
    bytes)."""
    out = os.path.join(workdir, f"ours_{tag}.json")
    log = os.path.join(workdir, f"ours_{tag}.log")
    report = run_bench(ours_command(args, link, out, gloo), out, log, REPO)
    return ours_from_report(report), transports_label(report)


def run_megatron(args: argparse.Namespace, link: str, workdir: str, tag: str) -> dict[str, Any]:
    """One Megatron run of EP ranks (one per emulated host on an emulated link); rank 0's
    report (step times as the max over ranks)."""
    world = args.expert_model_parallel_size
    out = os.path.join(workdir, f"megatron_{tag}.json")
    logs = [os.path.join(workdir, f"megatron_{tag}_rank{r}.log") for r in range(world)]
    run_peer_ranks(world, link, lambda rank: megatron_command(args, out, logs[rank]), logs,
                   "megatron moe", args.timeout, args.threads_per_rank)
    with open(out) as f:
        return json.load(f)


def megatron_info(mcore_python: str) -> dict[str, str]:
    """Versions in the Megatron venv; SystemExit naming the setup command when it is missing."""
    probe = ("import json, torch, megatron.core; from megatron.core.transformer.moe.moe_layer "
             "import MoELayer; print(json.dumps({'megatron_core': megatron.core.__version__, "
             "'torch': torch.__version__}))")
    return check_peer_python(mcore_python, probe, "megatron-core's MoELayer", SETUP_CMD,
                             "--mcore-python", megatron_env(dict(os.environ)))


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--links", default="loopback,1gbit",
      help="comma-separated: loopback and/or tc rates to emulate (e.g. 1gbit, 500mbit; root)")
    a("--rounds", type=int, default=4, help="interleaved rounds per link")
    a("--steps", type=int, default=6, help="measured steps per run (per mode on our side)")
    a("--warmup", type=int, default=2, help="unmeasured steps per run (per mode on our side)")
    a("--modes", default=DEFAULT_MODES, help="our domino bench modes")
    a("--expert-model-parallel-size", type=int, default=2,
      help="EP size = ranks per side (TP=1; each rank its own tokens)")
    a("--hidden-size", type=int, default=512)
    a("--moe-ffn-hidden-size", type=int, default=1024)
    a("--num-experts", type=int, default=8)
    a("--moe-router-topk", type=int, default=2)
    a("--seq-length", type=int, default=256)
    a("--micro-batch-size", type=int, default=4, help="batch per EP rank")
    a("--threads-per-rank", type=int, default=1)
    a("--dtype", choices=("fp32",), default="fp32")
    a("--seed", type=int, default=1234)
    a("--swiglu", action="store_true",
      help="SwiGLU experts on both sides (default: exact GELU, domino bench's MoE default)")
    a("--force-load-balancing", action="store_true",
      help="random router logits on both sides (Megatron's --moe-router-force-load-balancing)")
    a("--moe-aux-loss-coeff", type=float, default=0.01,
      help="Megatron's load-balancing loss weight (our side: see --ours-extra-args)")
    a("--timeout", type=float, default=300.0, help="seconds a rank may wait for a peer")
    a("--megatron-unit", choices=("block", "layer"), default="block",
      help="what Megatron's side times: block (default) the unit our side times - pre-MLP "
           "LayerNorm, MoELayer, residual, final LayerNorm, from Megatron's own modules; layer "
           "the bare MoELayer (less work than our unit)")
    a("--mcore-python", default=os.path.join(DEFAULT_MCORE_VENV, "bin", "python"),
      help=f"python of the Megatron venv (made by {SETUP_CMD})")
    a("--ours-extra-args", default="",
      help="more flags for our domino bench runs, one shell-quoted string")
    a("--gloo-row", action="store_true",
      help="add a loopback row whose our side runs over gloo (--no-shared-memory-comm)")
    a("--skip-ours", action="store_true",
      help="measure Megatron's side only (our columns show '-')")
    a("--ours-cmd-only", action="store_true",
      help="print the domino bench command of each row and exit (runs nothing)")
    a("--json", metavar="PATH", default=None, help="also write every round's figures here")
    a("--write-latest", action="store_true",
      help="also write latest_output.md and latest_output.json next to this script")
    a("--keep-dir", metavar="DIR", default=None,
      help="keep every run's raw JSON and logs here (default: a temporary directory)")
    args = p.parse_args(argv)
    for name in ("rounds", "steps", "threads_per_rank", "hidden_size", "moe_ffn_hidden_size",
                 "num_experts", "moe_router_topk", "seq_length", "micro_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.moe_aux_loss_coeff < 0:
        p.error("--warmup and --moe-aux-loss-coeff must be >= 0")
    ep = args.expert_model_parallel_size
    if ep < 2:
        p.error("--expert-model-parallel-size must be >= 2 (there is nothing to exchange at 1)")
    if args.num_experts % ep:
        p.error(f"--num-experts {args.num_experts} must divide by "
                f"--expert-model-parallel-size {ep}")
    if args.moe_router_topk > args.num_experts:
        p.error("--moe-router-topk must be <= --num-experts")
    if not any(m.strip().startswith("domino:") for m in args.modes.split(",")):
        p.error("--modes needs at least one domino:* mode (the 'our best Domino' column)")
    try:
        shlex.split(args.ours_extra_args)
    except ValueError as err:
        p.error(f"--ours-extra-args: {err}")
    try:
        args.link_list = parse_links(args.links)
    except ValueError as err:
        p.error(str(err))
    return args


_PROGRESS: list[str] = []


def _log(msg: str) -> None:
    _PROGRESS.append(msg)
    print(msg, file=sys.stderr, flush=True)


def table_rows(args: argparse.Namespace) -> list[LinkRounds]:
    """One :class:`LinkRounds` per row: each link, the gloo row after loopback if asked for."""
    rows = [LinkRounds(link) for link in args.link_list]
    if LOOPBACK in args.link_list and args.gloo_row:
        rows.insert(args.link_list.index(LOOPBACK) + 1, LinkRounds(LOOPBACK, gloo=True))
    return rows


def measure(args: argparse.Namespace, workdir: str) -> list[LinkRounds]:
    """All rounds; one :class:`LinkRounds` per row."""
    rows = table_rows(args)
    for r in range(args.rounds):
        order = order_for_round(r)
        for row in rows:
            label = row_label(row.link, row.gloo)
            for system in order:
                if system == "ours" and args.skip_ours:
                    continue
                if system == "megatron" and row.gloo:
                    continue  # Megatron's side of that row is the loopback row's
                tag = f"r{r}_{row.link}{'_gloo' if row.gloo else ''}"
                t0 = time.monotonic()
                if system == "ours":
                    times, transport = run_ours(args, row.link, workdir, tag, row.gloo)
                    row.add_ours(times)
                    row.transports.append(transport)
                    best = best_domino(times)
                    what = (f"best {best[0]} {best[1] * 1e3:.0f} ms" if best else
                            f"sync {times.get('sync', float('nan')) * 1e3:.0f} ms")
                else:
                    median = row.add_megatron(run_megatron(args, row.link, workdir, tag))
                    copies = ", ".join(f"{k} {v:g}" for k, v in row.copies[-1].items())
                    what = f"median {median * 1e3:.0f} ms (dispatch copies/step: {copies})"
                _log(f"[round {r + 1}] {label}: {system}: {what} "
                     f"({time.monotonic() - t0:.0f} s)")
    # The gloo row's Megatron figures are the loopback row's (Megatron always uses gloo).
    for row in rows:
        if row.gloo:
            loop = next(x for x in rows if x.link == LOOPBACK and not x.gloo)
            row.peer, row.copies = list(loop.peer), list(loop.copies)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ours_cmd_only:
        for row in table_rows(args):
            out = f"ours_{row.link}{'_gloo' if row.gloo else ''}.json"
            print(f"# {row_label(row.link, row.gloo)}")
            print(shlex.join(ours_command(args, row.link, out, row.gloo, python="python")))
        return 0
    require_domino()
    info = megatron_info(args.mcore_python)
    prepare_links(args.link_list)
    torch_version = package_version("torch")

    command = shown_command(sys.argv[0], REPO, argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    _PROGRESS.clear()
    _log(f"compare: megatron-core {info['megatron_core']} (torch {info['torch']}) vs domino "
         f"(torch {torch_version}); links {','.join(args.link_list)}, {args.rounds} rounds"
         + (" (Megatron only)" if args.skip_ours else ""))
    t0 = time.monotonic()
    if args.keep_dir is not None:
        os.makedirs(args.keep_dir, exist_ok=True)
        rows = measure(args, args.keep_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="compare-megatron-moe-") as tmp:
            rows = measure(args, tmp)
    elapsed = time.monotonic() - t0
    summaries = [row.summary() for row in rows]
    ep = args.expert_model_parallel_size
    unit = ("final norm(x + MoE(norm(x))): on Megatron's side its TransformerBlock of one "
            "TransformerLayer (attention an IdentityOp)" if args.megatron_unit == "block" else
            "ours final norm(x + MoE(norm(x))), Megatron's the bare MoELayer")
    desc = (f"one MoE layer ({unit}), hidden {args.hidden_size}, {args.num_experts} experts of ffn "
            f"{args.moe_ffn_hidden_size} ({'SwiGLU' if args.swiglu else 'GELU'}, no biases), "
            f"top-{args.moe_router_topk}, seq {args.seq_length}, batch {args.micro_batch_size} "
            f"per rank ({args.seq_length * args.micro_batch_size} tokens), {args.dtype}, "
            f"{args.threads_per_rank} thread(s)/rank, CPU"
            + (", random router logits" if args.force_load_balancing else ""))
    domino_modes = ", ".join(m.strip() for m in args.modes.split(",")
                             if m.strip().startswith("domino:"))
    ours = ("ours: not run (--skip-ours)" if args.skip_ours else
            f"ours: domino {domino_version()} (torch {torch_version}), best of {domino_modes}")
    lines = [
        f"Date: {started.isoformat(timespec='seconds')}; command: `{command}`",
        "",
        f"Median ms of one forward+backward step, EP={ep} (TP=1, {ep} ranks, each with its own "
        f"tokens); {desc}. Each cell: median over rounds of each round's median (range over "
        f"rounds in brackets); {args.rounds} interleaved rounds, {args.steps} steps after "
        f"{args.warmup} warm-up per run and mode. Megatron-core {info['megatron_core']} (torch "
        f"{info['torch']}) MoELayer: alltoall dispatcher, SequentialMLP experts, softmax top-k "
        f"router; {ours}; both sides: load-balancing loss coeff "
        f"{args.moe_aux_loss_coeff:g}. Megatron / ours = Megatron median / our best Domino "
        f"median (per-round ratios in brackets). Took "
        f"{elapsed / 60:.1f} min on {os.cpu_count()} CPUs.",
        "",
        format_table(summaries),
    ]
    for extra in (format_best_modes(summaries), format_transports(summaries),
                  format_copies(summaries)):
        if extra:
            lines += ["", extra]
    text = "\n".join(lines)
    print(text, flush=True)
    report = {
        "command": command, "date": started.isoformat(timespec="seconds"),
        "elapsed_s": elapsed, "config": dict(vars(args)),
        "megatron_core_version": info["megatron_core"],
        "megatron_torch_version": info["torch"],
        "torch_version": torch_version, "python_version": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "rows": [{**s, "rounds": {"our_sync_s": row.sync, "our_nocomm_s": row.nocomm,
                                  "our_best_domino_s": row.best,
                                  "our_best_domino_mode": row.best_mode,
                                  "megatron_alltoall_s": row.megatron,
                                  "megatron_dispatch_copies": row.copies}}
                 for s, row in zip(summaries, rows)],
    }
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.write_latest:
        write_latest(report, text, list(_PROGRESS))
    return 0


def latest_markdown(report: dict[str, Any], text: str, progress: Sequence[str]) -> str:
    """``latest_output.md``: how the run was made, its printed table and its progress lines."""
    return "\n".join([
        "# Latest run",
        "",
        f"Run on {report['date'][:10]} (UTC) on a {report['cpu_count']}-CPU machine, from the "
        f"repository root, at commit {git_commit()}:",
        "",
        "```bash",
        f"{SETUP_CMD}   # once",
        ". .venv/bin/activate",
        report["command"],
        "```",
        "",
        "Printed output:",
        "",
        text,
        "",
        "Per-run progress (stderr), in the order the runs were made:",
        "",
        "```text",
        *progress,
        "```",
        "",
    ])


def write_latest(report: dict[str, Any], text: str, progress: Sequence[str]) -> None:
    with open(os.path.join(HERE, "latest_output.json"), "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    with open(os.path.join(HERE, "latest_output.md"), "w") as f:
        f.write(latest_markdown(report, text, progress))


def git_commit() -> str:
    return _git_commit(REPO)


if __name__ == "__main__":
    sys.exit(main())
