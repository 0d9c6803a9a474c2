"""The sharding strategies with a pipeline: ``domino train`` at PP=2 x DP=2 (1F1B) under
``no_shard``, ``optim`` and ``optim_grads_params`` resharded per micro-batch or kept for the step,
in interleaved rounds; prints per strategy the model state held per rank at rest, the median step
time, the median exposed DP communication per step and the peak memory per rank.

    python scripts/compare_fsdp/pipeline.py [--rounds 2] [--layers 8] [--hidden-size 512]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OGP = ["--data-parallel-sharding-strategy", "optim_grads_params"]
MODES = {
    "no_shard": [],
    "optim": ["--data-parallel-sharding-strategy", "optim"],
    "optim_grads_params, resharded": OGP,
    "optim_grads_params, kept": [*OGP, "--no-fsdp-reshard-after-forward"],
}


def one_run(args: argparse.Namespace, flags: list[str], run_dir: str) -> dict:
    """One ``domino train`` run -> its medians (the first step left out) and held state."""
    cmd = [sys.executable, "-m", "domino.cli", "train", "--num-layers", str(args.layers),
           "--hidden-size", str(args.hidden_size), "--num-attention-heads", "8",
           "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "16",
           "--train-iters", str(args.steps), "--eval-iters", "0", "--sample-tokens", "0",
           "--no-tensorboard", "--log-interval", "1", "--nproc", "4",
           "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
           "--save-interval", "0", "--save", run_dir, "--overwrite", *flags]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"pipeline.py: {' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if '"loss"' in line][1:]
    held = re.search(r"model state per rank \(weights \+ gradients \+ optimizer\): ([^;]*?) MiB",
                     out.stdout + out.stderr)
    return {"step_ms": 1e3 * statistics.median(r["step_time_s"] for r in steps),
            "exposed_dp_ms": 1e3 * statistics.median(r["exposed_dp_comm_s"] for r in steps),
            "peak_mib": max(r["peak_mem_bytes"] for r in steps) / 2**20,
            "held": held.group(1).split("), ")[0] + ")" if held else "?",
            "loss": steps[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=512)
    args = p.parse_args(argv)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="fsdp-pp-") as tmp:
        for r in range(args.rounds):
            order = list(MODES)[r % len(MODES):] + list(MODES)[:r % len(MODES)]
            for mode in order:
                results[mode].append(one_run(args, MODES[mode], os.path.join(tmp, f"r{r}")))
                print(f"round {r + 1} {mode}: {results[mode][-1]}", file=sys.stderr, flush=True)
    print("| strategy | model state held per rank at rest, MiB | step, ms | exposed DP "
          "communication per step, ms | peak memory per rank, MiB |")
    print("|---|---|---|---|---|")
    for mode, runs in results.items():
        med = {k: statistics.median(x[k] for x in runs)
               for k in ("step_ms", "exposed_dp_ms", "peak_mib")}
        print(f"| `{mode}` | {runs[0]['held']} | {med['step_ms']:.0f} | "
              f"{med['exposed_dp_ms']:.0f} | {med['peak_mib']:.0f} |")
    losses = {f"{x['loss']:.6f}" for runs in results.values() for x in runs}
    print(f"\nfinal losses (every strategy, every round): {', '.join(sorted(losses))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
