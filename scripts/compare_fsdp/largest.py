"""The largest GPT that trains on this machine at DP=2 under ``optim`` (ZeRO-1) and under
``optim_grads_params`` (ZeRO-3), from the measured peak memory per rank; then one real run at
a size ``optim`` cannot fit.

Run with the project's venv, on an otherwise quiet machine (the real run takes most of its
memory)::

    python scripts/compare_fsdp/largest.py [--layers 4,10,16] [--hidden-size 1024] \
        [--real-run] [--json out.json]

Method. The model family is domino train's GPT at a fixed width (hidden 1024, 16 heads, seq 256,
micro-batch 1, the default 2048-token BPE vocabulary, fp32), deepened: every layer adds the same
parameters (12 h^2 + 13 h), the same activations and, per strategy, the same model-state bytes
per rank. So each strategy's peak per rank (the process's VmHWM, the larger rank's, from
``domino train``'s closing line) is a line in the number of layers: ``peak(L) = a + b L``,
fitted by least squares to short runs at a few depths. Its slope against the formula's (the
start-up line's per-rank model state: optim 4 + 4 + 12/DP bytes per parameter - weights, fp32
gradients, AdamW's moments and fp32 masters; optim_grads_params (4 + 12)/DP plus a fixed few
units in flight) is printed too. The budget per rank is (MemTotal - ``--reserve-gib``) / DP; the
largest depth is the largest L whose fitted peak fits it. The real run trains
``optim_grads_params`` for a few steps at the depth where ``optim``'s fitted peak is
``--real-margin`` over the budget (or ``--real-layers``), after checking that enough memory is
free now.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from fsdp_figures import (  # noqa: E402
    parse_implied_mib,
    parse_model_state_mib,
    parse_param_count,
    parse_peaks_mib,
)
from peer_compare import RunFailed, git_commit, tail  # noqa: E402

GIB = 2 ** 30
MIB = 2 ** 20
STRATEGIES = ("optim", "optim_grads_params")


# ---- pure helpers (unit-tested in tests/test_compare_fsdp_script.py) -------------------------


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` -> (a, b); at least two distinct x."""
    if len(set(xs)) < 2:
        raise ValueError(f"fit_line: need two or more distinct depths, got {list(xs)}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def largest_depth(a: float, b: float, budget: float) -> int:
    """The largest L with ``a + b L <= budget`` (0 when not even one layer fits)."""
    return max(0, math.floor((budget - a) / b))


def depth_over(a: float, b: float, level: float) -> int:
    """The smallest L with ``a + b L >= level``."""
    return max(1, math.ceil((level - a) / b))


def layer_params(hidden: int) -> int:
    """Parameters one layer of domino's default GPT adds: QKV, projection, the two MLP linears
    (ffn 4h) with biases, and two LayerNorms."""
    return 12 * hidden * hidden + 13 * hidden


def formula_bytes_per_param(strategy: str, dp: int) -> float:
    """Model-state bytes per rank per trained parameter under fp32 (the start-up line's
    formula, docs/parallelism.md), without the fixed units in flight."""
    if strategy == "optim":
        return 4 + 4 + 12 / dp  # weights, fp32 gradients, moments + fp32 masters over DP
    if strategy == "optim_grads_params":
        return (12 + 4) / dp  # moments + masters and fp32 gradients, all over DP
    raise ValueError(f"formula_bytes_per_param: {strategy!r} is not optim or optim_grads_params")


def budget_per_rank(mem_total: int, reserve: int, dp: int) -> float:
    return (mem_total - reserve) / dp


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            out[name] = int(value.split()[0]) * 1024
    return out


# ---- runs ---------------------------------------------------------------------------------------


def command(args: argparse.Namespace, strategy: str, layers: int, steps: int,
            run_dir: str) -> list[str]:
    return [sys.executable, "-m", "domino.cli", "train", "--num-layers", str(layers),
            "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads),
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--nproc", str(args.data_parallel_size), "--tensor-model-parallel-size", "1",
            "--device", "cpu", "--data-parallel-sharding-strategy", strategy,
            "--train-iters", str(steps), "--log-interval", "1", "--eval-iters", "0",
            "--sample-tokens", "0", "--save-interval", "0", "--no-tensorboard",
            "--save", run_dir, "--overwrite",
            # (TP=1 runs each micro-batch unsplit; the flag's check still wants samples for it)
            "--domino-micro-batches", str(min(2, args.micro_batch_size))]


def _timed(cmd: list[str], log: str) -> tuple[int, float]:
    """Run ``cmd`` with its output in ``log`` -> (exit code, the largest resident set of it and
    its rank processes, MiB: ``wait4``'s, which counts the waited-for descendants, as
    ``/usr/bin/time`` does; it includes the closing checkpoint, after the peak line)."""
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        _pid, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024 / MIB


def run(args: argparse.Namespace, strategy: str, layers: int, steps: int,
        workdir: str, keep: bool = False, load: bool = False) -> dict[str, Any]:
    """One short ``domino train`` run; its peaks, model-state lines, step times, closing
    checkpoint (size and seconds) and largest resident set. ``keep``: its checkpoints stay
    (for a resumed run); ``load``: it resumes the run of the same folder for ``steps``."""
    run_dir = os.path.join(workdir, f"{strategy}_L{layers}")
    log = run_dir + (".resumed.log" if load else ".log")
    cmd = command(args, strategy, layers, steps, run_dir)
    if load:
        cmd.remove("--overwrite")
        cmd += ["--load", run_dir]
    code, max_rss = _timed(cmd, log)
    with open(log, errors="replace") as f:
        text = f.read()
    if code != 0:
        raise RunFailed(f"domino train failed (exit {code}); log {log}:\n{tail(log)}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not keep:
        subprocess.run(["rm", "-rf", os.path.join(run_dir, "checkpoints")], check=False)
    shown = ["python", "-m", "domino.cli", *cmd[3:]]
    shown[shown.index("--save") + 1] = "RUN"
    if load:
        shown[shown.index("--load") + 1] = "RUN"
    saved = re.search(r"checkpoint step_\d+: ([\d.]+) MiB in ([\d.]+) s", text)
    return {"strategy": strategy, "layers": layers, "params": parse_param_count(text),
            "exit_code": code, "max_rss_mib": max_rss,
            "save_mib": float(saved.group(1)) if saved else None,
            "save_s": float(saved.group(2)) if saved else None,
            "peak_mib": max(parse_peaks_mib(text)), "peak_mib_per_rank": parse_peaks_mib(text),
            "implied_mib": parse_implied_mib(text), "model_state_mib": parse_model_state_mib(text),
            "step_s": [r["step_time_s"] for r in records], "losses": [r["loss"] for r in records],
            "command": shlex.join(shown)}


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--layers", default="4,10,16", help="depths measured (comma-separated)")
    a("--steps", type=int, default=2, help="steps of each measuring run")
    a("--hidden-size", type=int, default=1024)
    a("--num-attention-heads", type=int, default=16)
    a("--seq-length", type=int, default=256)
    a("--micro-batch-size", type=int, default=1)
    a("--data-parallel-size", type=int, default=2)
    a("--reserve-gib", type=float, default=1.5,
      help="memory left to the system and the launcher, GiB")
    a("--real-run", action="store_true", help="then train optim_grads_params at a size optim "
                                              "cannot fit")
    a("--real-layers", type=int, default=None, help="its depth (default: --real-margin)")
    a("--real-margin", type=float, default=1.05,
      help="default real depth: where optim's fitted peak is this times the budget")
    a("--real-steps", type=int, default=3)
    a("--json", default=None, metavar="PATH")
    a("--keep-dir", default=None, metavar="DIR")
    args = p.parse_args(argv)
    args.layer_list = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    if len(args.layer_list) < 2:
        p.error("--layers: two or more distinct depths")
    return args


def analyse(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fits, the budget and the largest depths (and parameters) per strategy."""
    mem = meminfo()
    dp = args.data_parallel_size
    budget = budget_per_rank(mem["MemTotal"], int(args.reserve_gib * GIB), dp) / MIB
    per_layer = layer_params(args.hidden_size)
    counts = {r["layers"]: r["params"] for r in runs}
    base = next(iter(counts.values())) - per_layer * next(iter(counts))  # params at L = 0
    out: dict[str, Any] = {"budget_mib_per_rank": budget, "mem_total_mib": mem["MemTotal"] / MIB,
                           "params_per_layer": per_layer, "params_outside_layers": base,
                           "strategies": {}}
    for s in STRATEGIES:
        mine = [r for r in runs if r["strategy"] == s]
        a, b = fit_line([r["layers"] for r in mine], [r["peak_mib"] for r in mine])
        ia, ib = fit_line([r["layers"] for r in mine], [r["implied_mib"] for r in mine])
        depth = largest_depth(a, b, budget)
        out["strategies"][s] = {
            "fit_mib": [a, b], "implied_fit_mib": [ia, ib],
            "formula_mib_per_layer": formula_bytes_per_param(s, dp) * per_layer / MIB,
            "residuals_mib": [r["peak_mib"] - (a + b * r["layers"]) for r in mine],
            "largest_layers": depth, "largest_params": base + per_layer * depth}
    return out


def report_lines(args: argparse.Namespace, runs: list[dict[str, Any]],
                 fit: dict[str, Any]) -> list[str]:
    lines = [f"Budget per rank: (MemTotal {fit['mem_total_mib'] / 1024:.1f} GiB - "
             f"{args.reserve_gib} GiB) / {args.data_parallel_size} = "
             f"{fit['budget_mib_per_rank'] / 1024:.2f} GiB. GPT hidden {args.hidden_size}, "
             f"{args.num_attention_heads} heads, seq {args.seq_length}, micro-batch "
             f"{args.micro_batch_size}, fp32, DP={args.data_parallel_size}, TP=1: "
             f"{fit['params_per_layer']:,} parameters per layer + "
             f"{fit['params_outside_layers']:,} outside.", "",
             "| strategy | layers | parameters | implied model state MiB/rank | measured model "
             "state MiB/rank (rank 0) | peak MiB per rank |", "|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        state = r["model_state_mib"][0] if r["model_state_mib"] else float("nan")
        lines.append(f"| {r['strategy']} | {r['layers']} | {r['params']:,} | "
                     f"{r['implied_mib']:.0f} | {state:.0f} | {r['peak_mib']:.0f} |")
    lines += ["", "| strategy | fitted peak MiB/rank | implied state per layer (formula) | "
              "largest depth | its parameters |", "|---|---|---:|---:|---:|"]
    for s, f in fit["strategies"].items():
        a, b = f["fit_mib"]
        lines.append(f"| {s} | {a:.0f} + {b:.1f} L | {f['implied_fit_mib'][1]:.1f} "
                     f"({f['formula_mib_per_layer']:.1f}) MiB | {f['largest_layers']} | "
                     f"{f['largest_params'] / 1e9:.2f} B |")
    return lines


def real_run(args: argparse.Namespace, fit: dict[str, Any], workdir: str) -> dict[str, Any]:
    """Train optim_grads_params where optim cannot fit, after checking the free memory: a few
    steps and their closing checkpoint (the masters and moments streamed bucket by bucket:
    docs/checkpoints.md), then one more step resumed from it."""
    budget = fit["budget_mib_per_rank"]
    a_o, b_o = fit["strategies"]["optim"]["fit_mib"]
    a_z, b_z = fit["strategies"]["optim_grads_params"]["fit_mib"]
    layers = args.real_layers or depth_over(a_o, b_o, args.real_margin * budget)
    need = (a_z + b_z * layers) * args.data_parallel_size
    free = meminfo()["MemAvailable"] / MIB
    if need + 1024 > free:
        raise SystemExit(f"largest.py: the real run at {layers} layers needs about {need:.0f} "
                         f"MiB and {free:.0f} MiB are available now; wait for a quieter machine "
                         "or pass a smaller --real-layers")
    if os.path.exists(os.path.join(workdir, f"optim_grads_params_L{layers}")):
        raise SystemExit(f"largest.py: {workdir} already holds a run at {layers} layers; pass "
                         "another --keep-dir")
    r = run(args, "optim_grads_params", layers, args.real_steps, workdir, keep=True)
    r["real_steps"] = args.real_steps
    r["resumed"] = run(args, "optim_grads_params", layers, args.real_steps + 1, workdir,
                       load=True)
    r["optim_fitted_peak_mib"] = a_o + b_o * layers
    r["ogp_fitted_peak_mib"] = a_z + b_z * layers
    return r


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    workdir = args.keep_dir or tempfile.mkdtemp(prefix="fsdp-largest-")
    os.makedirs(workdir, exist_ok=True)
    runs = []
    for layers in args.layer_list:
        for s in STRATEGIES:
            runs.append(run(args, s, layers, args.steps, workdir))
            print(f"{s} L={layers}: peak {runs[-1]['peak_mib']:.0f} MiB per rank",
                  file=sys.stderr, flush=True)
    fit = analyse(args, runs)
    shown = shlex.join(["python", "scripts/compare_fsdp/largest.py",
                        *(sys.argv[1:] if argv is None else argv)])
    lines = [f"Date: {started.isoformat(timespec='seconds')}; commit {git_commit(REPO)}; "
             f"command: `{shown}`", "", *report_lines(args, runs, fit)]
    real = real_run(args, fit, workdir) if args.real_run else None
    if real is not None:
        steps = ", ".join(f"{t:.1f}" for t in real["step_s"])
        peaks = ", ".join(f"{p:.0f}" for p in real["peak_mib_per_rank"])
        lines += ["", f"Real run: `{real['command']}`: {real['params']:,} parameters, step times "
                      f"{steps} s, peak per rank {peaks} MiB (fitted "
                      f"{real['ogp_fitted_peak_mib']:.0f}); optim's fitted peak at this depth: "
                      f"{real['optim_fitted_peak_mib']:.0f} MiB per rank. Its closing "
                      f"checkpoint: {real['save_mib']:.0f} MiB in {real['save_s']:.1f} s; the "
                      f"largest process, save included: {real['max_rss_mib']:.0f} MiB. Resumed "
                      f"from it for step {real['real_steps'] + 1}: loss "
                      f"{real['resumed']['losses'][-1]:.4f}, peak per rank "
                      f"{', '.join(f'{p:.0f}' for p in real['resumed']['peak_mib_per_rank'])} "
                      f"MiB, checkpoint {real['resumed']['save_s']:.1f} s."]
    print("\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "runs": runs, "fit": fit, "real": real}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
