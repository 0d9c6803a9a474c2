"""Compare domino's fully sharded data parallelism with PyTorch's FSDP2 on the same GPT.

Run with the project's venv (it imports ``domino``; FSDP2 is torch's own, so both sides run in
it)::

    python scripts/compare_fsdp/compare.py [--links loopback,1gbit] [--dtypes fp32,bf16] \
        [--rounds 4] [--json out.json]

Per round, link and dtype, every system trains the same GPT (same shape, parameter count,
global batch, DP=2, TP=1) for a few steps, one run after the other, the order rotated every
round: ``fsdp2`` (``fsdp2_worker.py``: ``fully_shard`` per block, then the root) and ours,
``domino train --data-parallel-sharding-strategy`` ``optim_grads_params`` and ``no_shard`` (the
baseline), and on emulated links also ``optim_grads_params`` with its gathers waited where used
and its reduce-scatters after the backward (``--fsdp-prefetch 0 --no-overlap-grad-reduce``).
Emulated links are :class:`domino.netem.EmulatedLink` for both systems (each rank in its own
network namespace, joined by a veth shaped with one tbf): ``domino train --emulate-link`` for
ours, ``peer_compare.run_peer_ranks`` (the same class and defaults) for FSDP2.

A run's figures: the median step time of its measured steps (rank 0's, as ``domino train``
logs them), tokens/s = global tokens per step / that median, the peak memory per rank (the
process's VmHWM after the last step, the larger rank's) and for ours the exposed DP
communication per step (``metrics.jsonl``'s ``exposed_dp_comm_s``). The tables show the median
over rounds and its range. See README.md next to this file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: what the comparisons share

from peer_compare import (  # noqa: E402
    LOOPBACK,
    RunFailed,
    domino_version,
    git_commit,
    prepare_links,
    require_domino,
    run_peer_ranks,
    shown_command,
    summarize,
    tail,
)
from peer_compare import parse_links as _parse_links  # noqa: E402

sys.path.insert(0, HERE)
from fsdp_figures import (  # noqa: E402
    FSDP2,
    WAITED,
    cell_summary,
    format_goals,
    format_table,
    fsdp2_figures,
    goals,
    ours_figures,
    row_label,
)
from fsdp_figures import fmt as _fmt  # noqa: E402

WORKER = os.path.join(HERE, "fsdp2_worker.py")
# Our systems: domino train's flags for each.
OUR_FLAGS = {
    "no_shard": ["--data-parallel-sharding-strategy", "no_shard"],
    "optim": ["--data-parallel-sharding-strategy", "optim"],
    "optim_grads": ["--data-parallel-sharding-strategy", "optim_grads"],
    "optim_grads_params": ["--data-parallel-sharding-strategy", "optim_grads_params"],
    WAITED: ["--data-parallel-sharding-strategy", "optim_grads_params", "--fsdp-prefetch", "0",
             "--no-overlap-grad-reduce"],
    "optim_grads_params_gloo": ["--data-parallel-sharding-strategy", "optim_grads_params",
                                "--no-shared-memory-comm"],
}
PEER_SYSTEMS = {FSDP2: 1, "fsdp2_no_prefetch": 0}  # name -> the worker's --prefetch
DEFAULT_LOOPBACK = "fsdp2,no_shard,optim_grads_params"
DEFAULT_EMULATED = "fsdp2,no_shard,optim_grads_params,optim_grads_params_waited"


# ---- pure helpers (unit-tested in tests/test_compare_fsdp_script.py) -------------------------


def parse_links(text: str) -> list[str]:
    """``"loopback,1GBit"`` -> ``["loopback", "1gbit"]``."""
    return _parse_links(text, "loopback,1gbit")


def parse_systems(text: str) -> list[str]:
    """Comma-separated system names, each known (ValueError naming the choices)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = [*PEER_SYSTEMS, *OUR_FLAGS]
    for name in names:
        if name not in known:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(known)}")
    if not names:
        raise ValueError("no systems given")
    return list(dict.fromkeys(names))


def order_for_round(systems: Sequence[str], index: int) -> list[str]:
    """The systems in round ``index``'s order: the list rotated by one every round, so each
    runs first, in the middle and last in turn."""
    k = index % len(systems)
    return list(systems[k:]) + list(systems[:k])


# ---- running the systems -----------------------------------------------------------------------


def size_flags(args: argparse.Namespace) -> list[str]:
    """The model flags both sides take, spelled the same way."""
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads),
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size)]


def tokens_per_step(args: argparse.Namespace) -> int:
    return args.micro_batch_size * args.data_parallel_size * args.seq_length


def our_command(args: argparse.Namespace, system: str, link: str, dtype: str,
                run_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "domino.cli", "train", *size_flags(args),
           "--nproc", str(args.data_parallel_size), "--tensor-model-parallel-size", "1",
           "--device", args.device, "--train-iters", str(args.warmup + args.steps),
           "--log-interval", "1", "--eval-iters", "0", "--sample-tokens", "0",
           "--save-interval", "0", "--no-tensorboard", "--save", run_dir, "--overwrite",
           *OUR_FLAGS[system]]
    if dtype == "bf16":
        cmd.append("--bf16")
    if link != LOOPBACK:
        cmd += ["--emulate-link", link]
    return cmd


def run_ours(args: argparse.Namespace, system: str, link: str, dtype: str, workdir: str,
             tag: str) -> dict[str, Any]:
    """One ``domino train`` run; its figures (:func:`ours_figures`)."""
    import subprocess

    run_dir, log = os.path.join(workdir, f"ours_{tag}"), os.path.join(workdir, f"ours_{tag}.log")
    cmd = our_command(args, system, link, dtype, run_dir)
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RunFailed(f"domino train failed (exit {proc.returncode}); log {log}:\n{tail(log)}")
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)  # disk, not figures
    return read_ours(args, system, link, dtype, workdir, tag)


def read_ours(args: argparse.Namespace, system: str, link: str, dtype: str, workdir: str,
              tag: str) -> dict[str, Any]:
    """The figures of our run ``tag`` from what it left in ``workdir``."""
    with open(os.path.join(workdir, f"ours_{tag}", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(workdir, f"ours_{tag}.log"), errors="replace") as f:
        text = f.read()
    return ours_figures(records, text, args.warmup, tokens_per_step(args))


def run_fsdp2(args: argparse.Namespace, system: str, link: str, dtype: str, workdir: str,
              tag: str) -> dict[str, Any]:
    """One FSDP2 run of DP ranks (one per emulated host on an emulated link); its figures."""
    out = os.path.join(workdir, f"fsdp2_{tag}.json")
    world = args.data_parallel_size
    logs = [os.path.join(workdir, f"fsdp2_{tag}_rank{r}.log") for r in range(world)]
    threads = max(1, (os.cpu_count() or 1) // world)  # what domino train gives each rank

    def command(rank: int) -> list[str]:
        return [sys.executable, WORKER, *size_flags(args), "--vocab-size", str(args.vocab_size),
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", dtype,
                "--prefetch", str(PEER_SYSTEMS[system]), "--threads", str(threads),
                "--device", args.device, "--seed", str(args.seed), "--timeout", str(args.timeout),
                "--out", out, "--log", logs[rank]]

    run_peer_ranks(world, link, command, logs, "fsdp2", args.timeout, threads)
    return read_fsdp2(args, system, link, dtype, workdir, tag)


def read_fsdp2(args: argparse.Namespace, system: str, link: str, dtype: str, workdir: str,
               tag: str) -> dict[str, Any]:
    """The figures of FSDP2 run ``tag`` from its report in ``workdir``."""
    with open(os.path.join(workdir, f"fsdp2_{tag}.json")) as f:
        return fsdp2_figures(json.load(f), tokens_per_step(args))


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--links", default="loopback,1gbit",
      help="comma-separated: loopback and/or tc rates to emulate (e.g. 1gbit; root)")
    a("--dtypes", default="fp32,bf16", help="comma-separated: fp32 and/or bf16")
    a("--rounds", type=int, default=4, help="interleaved rounds")
    a("--steps", type=int, default=6, help="measured steps per run")
    a("--warmup", type=int, default=2, help="unmeasured steps first, per run")
    a("--loopback-systems", default=DEFAULT_LOOPBACK,
      help=f"systems run on loopback (of {', '.join([*PEER_SYSTEMS, *OUR_FLAGS])})")
    a("--emulated-systems", default=DEFAULT_EMULATED, help="systems run on emulated links")
    a("--num-layers", type=int, default=8)
    a("--hidden-size", type=int, default=512)
    a("--num-attention-heads", type=int, default=8)
    a("--seq-length", type=int, default=256)
    a("--micro-batch-size", type=int, default=4, help="samples per DP rank and step")
    a("--vocab-size", type=int, default=2048,
      help="FSDP2's vocabulary: domino train's default BPE's (2048; checked by parameter count)")
    a("--data-parallel-size", type=int, default=2, help="ranks (DP; TP=1)")
    a("--device", choices=("cpu", "cuda"), default="cpu")
    a("--seed", type=int, default=1234)
    a("--timeout", type=float, default=600.0, help="seconds a rank may wait for a peer")
    a("--json", metavar="PATH", default=None, help="also write every run's figures here")
    a("--keep-dir", metavar="DIR", default=None,
      help="keep every run's logs and reports here (default: a temporary directory)")
    a("--tabulate", metavar="DIR[,DIR]", default=None,
      help="run nothing: tabulate the runs earlier --keep-dir DIRs kept (the same flags; "
           "several: their rounds together)")
    args = p.parse_args(argv)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 0 or args.data_parallel_size < 2:
        p.error("--warmup must be >= 0 and --data-parallel-size >= 2")
    try:
        args.link_list = parse_links(args.links)
        args.loopback_list = parse_systems(args.loopback_systems)
        args.emulated_list = parse_systems(args.emulated_systems)
    except ValueError as err:
        p.error(str(err))
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.dtype_list or any(d not in ("fp32", "bf16") for d in args.dtype_list):
        p.error(f"--dtypes {args.dtypes!r}: fp32 and/or bf16")
    return args


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(args: argparse.Namespace, workdir: str, read_only: bool = False
            ) -> dict[tuple[str, str, str], list[dict]]:
    """Every round: {(link, dtype, system): [each round's figures]}; ``read_only``: from what
    the runs of an earlier ``--keep-dir`` left, running nothing."""
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for r in range(args.rounds):
        for link in args.link_list:
            systems = args.loopback_list if link == LOOPBACK else args.emulated_list
            for dtype in args.dtype_list:
                for system in order_for_round(systems, r):
                    tag = f"r{r}_{link}_{dtype}_{system}"
                    # the machine's load (others' work too); a tabulated run's, as saved
                    t0, load = time.monotonic(), None if read_only else os.getloadavg()[0]
                    peer = system in PEER_SYSTEMS
                    how = ((read_fsdp2 if peer else read_ours) if read_only else
                           (run_fsdp2 if peer else run_ours))
                    run = how(args, system, link, dtype, workdir, tag)
                    saved = os.path.join(workdir, f"figures_{tag}.json")
                    if read_only:
                        with contextlib.suppress(OSError):
                            with open(saved) as f:
                                load = json.load(f).get("load_1min")
                    else:
                        with open(saved, "w") as f:
                            json.dump({**run, "load_1min": load}, f)
                    run["load_1min"] = load
                    runs.setdefault((link, dtype, system), []).append(run)
                    if read_only:
                        continue
                    exposed = run["exposed_dp_s"]
                    _log(f"[round {r + 1}] {row_label(link)} {dtype} {system}: "
                         f"{run['step_s'] * 1e3:.0f} ms/step, peak {run['peak_mib']:.0f} MiB"
                         + ("" if exposed is None else f", exposed DP {exposed * 1e3:.0f} ms")
                         + f" ({time.monotonic() - t0:.0f} s, load {load:.1f})")
    return runs


def check_same_model(runs: dict[tuple[str, str, str], list[dict]]) -> int:
    """Every run trained the same number of parameters (SystemExit naming them if not)."""
    counts = {k: sorted({r["params"] for r in rs if r.get("params")}) for k, rs in runs.items()}
    seen = {n for ns in counts.values() for n in ns}
    if len(seen) != 1:
        raise SystemExit(f"compare.py: the systems' parameter counts differ: {counts}; pass "
                         "FSDP2's --vocab-size as domino's padded vocabulary")
    return seen.pop()


def summarise(args: argparse.Namespace, runs: dict[tuple[str, str, str], list[dict]]
              ) -> tuple[list[dict], list[dict]]:
    rows, goal_rows = [], []
    for link in args.link_list:
        systems = args.loopback_list if link == LOOPBACK else args.emulated_list
        for dtype in args.dtype_list:
            cells = {s: cell_summary(runs[(link, dtype, s)]) for s in systems}
            rows += [{"link": link, "dtype": dtype, "system": s, **c} for s, c in cells.items()]
            goal_rows.append({"link": link, "dtype": dtype,
                              **goals(cells, emulated=link != LOOPBACK)})
    return rows, goal_rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_domino()
    if args.tabulate is None:
        prepare_links(args.link_list)
    import torch

    command = shown_command(sys.argv[0], REPO, argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    _log(f"compare: FSDP2 vs domino (torch {torch.__version__}); links "
         f"{','.join(args.link_list)}, dtypes {','.join(args.dtype_list)}, {args.rounds} rounds")
    t0 = time.monotonic()
    if args.tabulate is not None:
        runs = {}
        for kept in args.tabulate.split(","):
            for key, rounds in measure(args, kept, read_only=True).items():
                runs.setdefault(key, []).extend(rounds)
    elif args.keep_dir is not None:
        os.makedirs(args.keep_dir, exist_ok=True)
        runs = measure(args, args.keep_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="compare-fsdp-") as tmp:
            runs = measure(args, tmp)
    elapsed = time.monotonic() - t0
    params = check_same_model(runs)
    loads = summarize([r["load_1min"] for rs in runs.values() for r in rs
                       if r.get("load_1min") is not None])
    rows, goal_rows = summarise(args, runs)
    lines = [
        f"Date: {started.isoformat(timespec='seconds')}; command: `{command}`",
        "",
        f"GPT: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} "
        f"heads, seq {args.seq_length}, vocabulary {args.vocab_size}, {params:,} parameters; "
        f"DP={args.data_parallel_size}, TP=1, micro-batch {args.micro_batch_size} per rank "
        f"(global batch {args.micro_batch_size * args.data_parallel_size}, "
        f"{tokens_per_step(args)} tokens per step); {args.device.upper()}. Each cell: median "
        f"over {len(next(iter(runs.values())))} interleaved rounds (range in brackets) of each "
        f"run's median step "
        f"(rank 0's, {args.steps} steps after {args.warmup} warm-up); fastest step: the "
        f"fastest single measured step of all rounds (the goals' 'fastest steps' ratios use "
        f"it). Peak: the process's RSS "
        f"high-water mark (VmHWM) after the last step, the larger rank's. torch "
        f"{torch.__version__}, domino {domino_version()} at {git_commit(REPO)}. "
        + (f"Tabulated from {args.tabulate}. " if args.tabulate else
           f"Took {elapsed / 60:.1f} min on {os.cpu_count()} CPUs. ")
        + "1-minute load average at the runs' "
        f"starts {_fmt(loads, digits=1)} (other jobs included).",
        "",
        format_table(rows),
        "",
        format_goals(goal_rows),
    ]
    print("\n".join(lines), flush=True)
    if args.json is not None:
        report = {
            "command": command, "date": started.isoformat(timespec="seconds"),
            "elapsed_s": elapsed, "config": {k: v for k, v in vars(args).items()},
            "torch_version": torch.__version__, "python_version": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "params": params,
            "rows": rows, "goals": goal_rows,
            "runs": [{"link": k[0], "dtype": k[1], "system": k[2], "rounds": v}
                     for k, v in runs.items()],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
