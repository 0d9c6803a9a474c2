"""LoRA against a full fine-tune: step time, tokens/s, peak memory and model state per rank
(issue 49 item 7; the figures are in docs/finetune.md, "LoRA: memory and speed").

For each model size it makes a base checkpoint (``domino train --train-iters 1 --save BASE`` on
the built-in data and tokenizer), then fine-tunes it (``domino train --load BASE --finetune``)
in full and with LoRA (``--lora-rank 16 --lora-alpha 32``), in fp32 and in ``--bf16``, with
the same batch, sequence and TP (TP=2, two processes, the default Domino plan). The four runs
interleave over ``--rounds`` rounds, their order rotating each round, so load on the machine
hits every mode alike. A run's step time is the median of its steps after ``--warmup``; the
table shows the median over rounds (and the range), and the fastest step of all rounds: on a
machine that other work shares, the load only ever adds time, so the fastest step is the
figure least moved by it. Peak memory and model state per rank (weights + gradients +
optimizer) are what ``domino train`` prints at its end.

The frozen base weights per rank are the LoRA run's weights W minus its adapters: the adapters
are fp32 and each has one fp32 gradient, so their bytes equal the run's gradients G. Goals:
LoRA's model state per rank <= 1.1 x the frozen base weights, and LoRA's step <= 0.8 x a full
fine-tune's (judged on the medians, and on the fastest steps). Usage::

    python scripts/bench_lora.py [--sizes default,h1024] [--rounds 3] [--steps 6] [--warmup 2]
                                 [--precisions fp32,bf16] [--json OUT] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (what it is, the `domino train` model flags that make it; the rest are its defaults:
# 4 layers, hidden 256, 4 heads, seq 128, micro-batch 8, the BPE tokenizer of the built-in data)
SIZES: dict[str, tuple[str, list[str]]] = {
    "default": ("the `domino train` default: 4 layers, hidden 256, 4 heads, seq 128", []),
    "h1024": ("hidden 1024, 16 heads, 4 layers, seq 128",
              ["--hidden-size", "1024", "--num-attention-heads", "16"]),
    "issue47": ("hidden 1024, 16 heads, 4 layers, seq 512 (issue 47's shape)",
                ["--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "512"]),
}
MODES = ("full", "lora")
STATE_GOAL = 1.10  # LoRA's model state per rank / frozen base weights per rank, at most
STEP_GOAL = 0.80  # LoRA's step / a full fine-tune's, at most

_MEMORY = re.compile(r"peak memory per rank \((.*?)\): ([\d, ]+) MiB")
_STATE = re.compile(r"model state per rank \(weights \+ gradients \+ optimizer\): (.*?) MiB")
_TRIPLE = re.compile(r"([\d.]+) \(([\d.]+) \+ ([\d.]+) \+ ([\d.]+)\)")
_BATCH = re.compile(r"global batch (\d+) x (\d+) tokens")
_PLAN = re.compile(r"Domino plan (\S+) inside")


def parse_output(text: str) -> dict:
    """A `domino train` run's printed figures: the memory method, peak MiB and model state
    (MiB: total, weights, grads, optimizer) per rank, tokens per step and the Domino plan.
    ValueError naming what is missing."""
    mem, state, batch = _MEMORY.search(text), _STATE.search(text), _BATCH.search(text)
    missing = [name for name, m in (("peak memory line", mem), ("model state", state),
                                    ("global batch line", batch)) if m is None]
    if missing:
        raise ValueError(f"the run's output lacks its {', '.join(missing)}: is this a "
                         "`domino train` run that finished?")
    states = [dict(zip(("total", "weights", "grads", "optimizer"), map(float, t)))
              for t in _TRIPLE.findall(state.group(1))]
    plan = _PLAN.search(text)
    return {"memory_method": mem.group(1),
            "peak_mib": [float(v) for v in mem.group(2).replace(" ", "").split(",") if v],
            "state_mib": states,
            "tokens_per_step": int(batch.group(1)) * int(batch.group(2)),
            "plan": plan.group(1) if plan else "none (one TP rank)"}


def step_times_ms(metrics_jsonl: str, warmup: int) -> list[float]:
    """``step_time_s`` (ms) of metrics.jsonl's steps after the first ``warmup``."""
    times = [rec["step_time_s"] * 1e3 for rec in map(json.loads, metrics_jsonl.splitlines())
             if rec.get("step", 0) > warmup and "step_time_s" in rec]
    if not times:
        raise ValueError(f"metrics.jsonl holds no step after the {warmup} warm-up step(s): "
                         "raise --steps or lower --warmup")
    return times


def run_record(size: str, precision: str, mode: str, round_: int, parsed: dict,
               times: list[float]) -> dict:
    """One run's figures: its median and fastest step (ms), and the rank with the most model
    state stands for the run (TP ranks hold alike)."""
    state = max(parsed["state_mib"], key=lambda s: s["total"])
    return {"size": size, "precision": precision, "mode": mode, "round": round_,
            "step_ms": statistics.median(times), "best_ms": min(times),
            "peak_mib": max(parsed["peak_mib"]), "state_mib": state,
            "tokens_per_step": parsed["tokens_per_step"]}


def summarize(records: list[dict]) -> list[dict]:
    """One row per (size, precision, mode): the median over rounds of the runs' median steps
    (and their range), the fastest step of all its runs, and for LoRA rows its step over the
    full fine-tune's and its model state over the frozen base weights (W - G)."""
    keys = list(dict.fromkeys((r["size"], r["precision"], r["mode"]) for r in records))
    rows = []
    for key in keys:
        runs = [r for r in records if (r["size"], r["precision"], r["mode"]) == key]
        steps = [r["step_ms"] for r in runs]
        rows.append({"size": key[0], "precision": key[1], "mode": key[2], "rounds": len(runs),
                     "step_ms": statistics.median(steps), "step_ms_min": min(steps),
                     "step_ms_max": max(steps), "best_ms": min(r["best_ms"] for r in runs),
                     "tokens_per_s": runs[0]["tokens_per_step"] / statistics.median(steps) * 1e3,
                     "peak_mib": statistics.median(r["peak_mib"] for r in runs),
                     "state_mib": runs[-1]["state_mib"]})
    for row in rows:
        if row["mode"] != "lora":
            continue
        full = next((r for r in rows if (r["size"], r["precision"], r["mode"])
                     == (row["size"], row["precision"], "full")), None)
        s = row["state_mib"]
        row["base_weights_mib"] = s["weights"] - s["grads"]
        row["state_over_base"] = s["total"] / row["base_weights_mib"]
        row["state_goal_met"] = row["state_over_base"] <= STATE_GOAL
        row["step_over_full"] = row["step_ms"] / full["step_ms"] if full else None
        row["step_over_full_per_round"] = _paired(records, row)
        row["best_over_full"] = row["best_ms"] / full["best_ms"] if full else None
        row["step_goal_met"] = row["step_over_full"] <= STEP_GOAL if full else None
        row["best_goal_met"] = row["best_over_full"] <= STEP_GOAL if full else None
    return rows


def _paired(records: list[dict], row: dict) -> list[float]:
    """LoRA's step over the full fine-tune's of the same round, per round: how far the load
    on the machine moved the ratio."""
    steps = {(r["mode"], r["round"]): r["step_ms"] for r in records
             if (r["size"], r["precision"]) == (row["size"], row["precision"])}
    return [steps[("lora", k)] / steps[("full", k)] for m, k in sorted(steps)
            if m == "lora" and ("full", k) in steps]


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _step_ratio(row: dict) -> str:
    """``0.69 (rounds 0.60-0.81)``: the ratio of the medians, then the per-round range."""
    per = row.get("step_over_full_per_round") or []
    spread = f" (rounds {min(per):.2f}-{max(per):.2f})" if len(per) > 1 else ""
    return _ratio(row.get("step_over_full")) + spread


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table, then one line per goal and LoRA row."""
    head = ("| size | precision | mode | ms/step: median (range) | fastest step ms | tokens/s | "
            "peak MiB/rank | model state MiB/rank: W + G + O | LoRA/full step: median; fastest "
            "| LoRA state / base weights |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        s = r["state_mib"]
        lora = r["mode"] == "lora"
        lines.append(
            f"| {r['size']} | {r['precision']} | {r['mode']} | {r['step_ms']:.0f} "
            f"({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}) | {r['best_ms']:.0f} | "
            f"{r['tokens_per_s']:,.0f} | {r['peak_mib']:.0f} | {s['total']:.1f} = "
            f"{s['weights']:.1f} + {s['grads']:.1f} + {s['optimizer']:.1f} | "
            + (f"{_step_ratio(r)}; {_ratio(r['best_over_full'])} | {r['state_over_base']:.3f} "
               f"(base {r['base_weights_mib']:.1f})" if lora else " | ")
            + " |")
    lines.append("")
    met = {True: "met", False: "NOT met", None: "not measured"}
    for r in rows:
        if r["mode"] == "lora":
            lines.append(
                f"{r['size']}, {r['precision']}: model state <= {STATE_GOAL:.2f} x base "
                f"weights: {r['state_over_base']:.3f} -> {met[r['state_goal_met']]}; step <= "
                f"{STEP_GOAL:.1f} x full: median {_step_ratio(r)} -> {met[r['step_goal_met']]}, "
                f"fastest {_ratio(r['best_over_full'])} -> {met[r['best_goal_met']]}")
    return "\n".join(lines)


def cpu_text() -> str:
    """The CPU's model name and whether it has AMX-BF16 / AVX512-BF16."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU (no /proc/cpuinfo)"
    name = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    found = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    flags = set(found.group(1).split()) if found else set()
    have = ", ".join(f"{'' if f in flags else 'no '}{f}" for f in ("amx_bf16", "avx512_bf16"))
    return f"{name.group(1).strip() if name else 'unknown CPU'} ({os.cpu_count()} cores; {have})"


def _domino() -> list[str]:
    beside = Path(sys.executable).parent / "domino"
    found = str(beside) if beside.exists() else shutil.which("domino")
    if found is None:
        raise SystemExit("bench_lora: no `domino` command: activate the project's venv")
    return [found]


def _train(cmd: list[str], log: Path) -> str:
    """Run ``domino train`` (output into ``log``); its output, or SystemExit with its tail."""
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    text = log.read_text(errors="replace")
    if done.returncode != 0:
        raise SystemExit(f"bench_lora: {shlex.join(cmd)} failed (exit {done.returncode}); "
                         f"its output ends:\n{text[-3000:]}")
    return text


def _common(args: argparse.Namespace) -> list[str]:
    out = ["--tensor-model-parallel-size", str(args.tp), "--eval-iters", "0",
           "--sample-tokens", "0", "--log-interval", "1"]
    if args.device:
        out += ["--device", args.device]
    return out + shlex.split(args.train_args)


def run_order(precisions: list[str], rounds: int) -> list[tuple[int, str, str]]:
    """(round, precision, mode) in the order they run: every precision x mode once a round,
    the order rotated by one each round so that none always runs first or after another."""
    combos = [(p, m) for p in precisions for m in MODES]
    return [(r, *combos[(k + r) % len(combos)]) for r in range(rounds)
            for k in range(len(combos))]


def bench_size(args: argparse.Namespace, size: str, work: Path) -> tuple[list[dict], dict]:
    """Base checkpoint, then the interleaved fine-tunes of one size: their records and what
    the runs print once (memory method, plan, load)."""
    base = work / size / "base"
    _train(_domino() + ["train", *SIZES[size][1], *_common(args), "--train-iters", "1",
                        "--save", str(base), "--overwrite"], work / f"{size}-base.log")
    records, seen = [], {}
    for round_, precision, mode in run_order(args.precisions, args.rounds):
        name = f"{size}-{precision}-{mode}-r{round_}"
        run_dir = work / size / name
        cmd = _domino() + ["train", "--load", str(base), "--finetune", *_common(args),
                           "--train-iters", str(args.steps), "--save", str(run_dir),
                           "--overwrite"]
        cmd += ["--bf16"] if precision == "bf16" else []
        cmd += (["--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha)]
                if mode == "lora" else [])
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        parsed = parse_output(_train(cmd, work / f"{name}.log"))
        times = step_times_ms((run_dir / "metrics.jsonl").read_text(), args.warmup)
        records.append(run_record(size, precision, mode, round_, parsed, times))
        records[-1].update(load_before=load, wall_s=time.perf_counter() - t0)
        seen.setdefault("memory_method", parsed["memory_method"])
        seen.setdefault("plan", parsed["plan"])
        seen.setdefault("command", {})[f"{precision} {mode}"] = shlex.join(cmd[1:])
        print(f"  {name}: {records[-1]['step_ms']:.0f} ms/step (fastest "
              f"{records[-1]['best_ms']:.0f}), model state {records[-1]['state_mib']}, "
              f"load {load:.1f}", flush=True)
        if not args.keep:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return records, seen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = parser.add_argument
    a("--sizes", default="default,h1024",
      help="Comma-separated sizes: " + "; ".join(f"{k}: {v[0]}" for k, v in SIZES.items()))
    a("--precisions", default="fp32,bf16", help="Comma-separated: fp32, bf16.")
    a("--rounds", type=int, default=3, help="Interleaved rounds of the four runs.")
    a("--steps", type=int, default=6, help="Training steps per run.")
    a("--warmup", type=int, default=2, help="First steps of each run left out of its median.")
    a("--lora-rank", type=int, default=16)
    a("--lora-alpha", type=float, default=32.0)
    a("--tp", type=int, default=2, help="Tensor-parallel size (= processes).")
    a("--device", default=None, help="cpu or cuda; default domino train's (cuda when there).")
    a("--train-args", default="", help="More `domino train` flags for every run, one string.")
    a("--workdir", default=None, help="Folder for the runs; default a new temporary one.")
    a("--keep", action="store_true", help="Keep the fine-tunes' checkpoints.")
    a("--json", default=None, metavar="OUT", help="Also write the figures as JSON here.")
    args = parser.parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [s for s in args.sizes if s not in SIZES] + [
        p for p in args.precisions if p not in ("fp32", "bf16")]
    if bad or not args.sizes or not args.precisions:
        parser.error(f"--sizes/--precisions: unknown or empty {bad}; sizes are "
                     f"{', '.join(SIZES)}, precisions fp32, bf16")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must be below --steps {args.steps}, so that "
                     "some steps are timed")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_lora_"))
    work.mkdir(parents=True, exist_ok=True)
    cpu, load0 = cpu_text(), os.getloadavg()
    print(f"bench_lora: {cpu}; load average {load0[0]:.2f}; runs in {work}", flush=True)
    records, seen = [], {}
    for size in args.sizes:
        print(f"{size}: {SIZES[size][0]}", flush=True)
        recs, seen[size] = bench_size(args, size, work)
        records += recs
    rows = summarize(records)
    load1 = os.getloadavg()
    first = next(iter(seen.values()))
    print(f"\nLoRA rank {args.lora_rank}, alpha {args.lora_alpha:g} vs full fine-tune; "
          f"TP={args.tp}, Domino plan {first['plan']}; {args.steps} steps per run, median (and "
          f"fastest) of those after {args.warmup}, median over {args.rounds} interleaved "
          f"rounds; peak memory: {first['memory_method']}; {cpu}; load average "
          f"{load0[0]:.2f} before, {load1[0]:.2f} after")
    print("sizes: " + "; ".join(f"{s}: {SIZES[s][0]}" for s in args.sizes) + "\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"cpu": cpu, "load_average": [load0[0], load1[0]], "args": vars(args),
             "runs": seen, "records": records, "rows": rows}, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
