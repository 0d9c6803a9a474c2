"""The report of ``domino bench --data-parallel-size D``: per sharding strategy the step time
(the slowest rank's per round, median over rounds), tokens/s, model FLOP/s per rank and MFU, the
exposed data-parallel communication per step, the model state per rank (implied by the
strategy's formula and measured as held) and the peak memory per rank; every step's global loss
per strategy (they train the same model on the same data, so the losses agree to rounding).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
from typing import Any

import torch

from domino.bench.figures import header_lines
from domino.flops import utilisation

TIMING_METHOD = (
    "per round, every strategy one train_step in an order rotated by one each round; per step: "
    "barrier, perf_counter around train_step (its parameter all-gathers waited inside it; CUDA "
    "synchronised); a round's step time is the max over ranks; step_time_s is the median over "
    "measured rounds; exposed_dp_comm_s: train_step's exposed_dp_s, the ranks' mean per round, "
    "median over rounds")


def _median_of_rounds(per_rank: list[list[float]], reduce) -> tuple[float, list[float]]:
    rounds = [reduce(vals) for vals in zip(*per_rank, strict=True)]
    return statistics.median(rounds), rounds


def results(raw: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One figures row per strategy."""
    ranks = raw["ranks"]
    tokens = spec["data_parallel_size"] * spec["micro_batch_size"] * spec["seq_length"]
    flops, peak = raw.get("model_flops_per_step"), raw.get("peak_flops_per_s")
    out = []
    for name in spec["strategies"]:
        step, steps = _median_of_rounds([r["times"][name] for r in ranks], max)
        exposed, _ = _median_of_rounds([r["exposed_dp"][name] for r in ranks], statistics.mean)
        per_rank, mfu = utilisation(flops, len(ranks), step, peak)
        memory = [r["memory"][name] for r in ranks]
        out.append({
            "strategy": name, "step_time_s": step, "step_times_s": steps,
            "tokens_per_s": tokens / step, "model_flops_per_s_per_rank": per_rank, "mfu": mfu,
            "exposed_dp_comm_s": exposed,
            "model_state_implied_bytes_per_rank": [m["implied"] for m in memory],
            "model_state_bytes_per_rank": [m["held"] for m in memory],
            "step_peak_bytes_per_rank": [m["step_peak"] for m in memory],
            "peak_mem_bytes_per_rank": [m["peak"] for m in memory],
            "losses": raw["losses"][name], "grad_norms": raw["grad_norms"][name],
        })
    return out


def loss_spread(rows: list[dict[str, Any]]) -> float:
    """The largest relative difference between two strategies' losses of the same step."""
    worst = 0.0
    for losses in zip(*(r["losses"] for r in rows), strict=True):
        low, high = min(losses), max(losses)
        if not all(math.isfinite(v) for v in losses):
            return math.inf
        worst = max(worst, (high - low) / max(abs(low), 1e-30))
    return worst


def build_report(args: argparse.Namespace, spec: dict[str, Any],
                 raw: dict[str, Any]) -> dict[str, Any]:
    """The report of a run of ``spec`` (from ``args``) whose rank 0 gathered ``raw``."""
    rows = results(raw, spec)
    config = {**{k: v for k, v in vars(args).items() if not k.startswith("_")},
              "strategies": spec["strategies"], "plan": spec["plan"],
              "fsdp_unit_layers": spec["fsdp_unit_layers"],
              "fsdp_prefetch": spec["fsdp_prefetch"], "device": raw["device"],
              "link": spec.get("link", "loopback"), "transports": raw.get("transports"),
              "tokens_per_step": (spec["data_parallel_size"] * spec["micro_batch_size"]
                                  * spec["seq_length"]),
              "model_flops_per_step": raw.get("model_flops_per_step"),
              "peak_flops_per_s": raw.get("peak_flops_per_s"), "mfu_of": raw.get("peak_what"),
              "attention": raw.get("attention"), "host_malloc": raw.get("host_malloc"),
              "timing_method": TIMING_METHOD, "peak_method": raw.get("peak_method"),
              "torch_version": torch.__version__,
              "python_version": platform.python_version(), "platform": platform.platform(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return {"config": config, "results": rows, "loss_spread": loss_spread(rows)}


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def format_table(report: dict[str, Any]) -> str:
    """The report as an aligned text table, a row per strategy (memory: the largest rank's)."""
    c = report["config"]
    transports = c.get("transports") or {}
    lines = [f"domino bench (data parallel): GPT {c['num_layers']} layers, hidden "
             f"{c['hidden_size']}, {c['num_attention_heads']} heads, seq {c['seq_length']}, "
             f"micro-batch {c['micro_batch_size']} per replica, DP={c['data_parallel_size']} x "
             f"TP={c['tensor_model_parallel_size']} (Domino plan {c['plan']}), "
             f"{'bf16 compute from fp32 masters' if c.get('bf16') else 'fp32'}, {c['device']}, "
             f"{c['threads_per_rank']} thread(s)/rank, link {c['link']}"
             + (f", DP over {transports['dp']}" if "dp" in transports else "")
             + f", optim_grads_params units of {c['fsdp_unit_layers']} layer(s) prefetching "
             f"{c['fsdp_prefetch']}, {c['steps']} steps after {c['warmup']} warm-up"]
    lines += header_lines(c)
    head = ("strategy", "step ms", "tokens/s", "TFLOP/s/rank", "MFU", "exposed DP ms",
            "state MiB implied", "state MiB held", "peak MiB")
    body = [(r["strategy"], f"{r['step_time_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}",
             "-" if r.get("model_flops_per_s_per_rank") is None
             else f"{r['model_flops_per_s_per_rank'] / 1e12:.3g}",
             "-" if r.get("mfu") is None else f"{r['mfu'] * 100:.3g}%",
             f"{r['exposed_dp_comm_s'] * 1e3:.2f}",
             _mib(max(sum(m.values()) for m in r["model_state_implied_bytes_per_rank"])),
             _mib(max(sum(m.values()) for m in r["model_state_bytes_per_rank"])),
             _mib(max(r["peak_mem_bytes_per_rank"])))
            for r in report["results"]]
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    for row in (head, *body):
        lines.append("  ".join([row[0].ljust(widths[0])]
                               + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]))
    first = report["results"][0]["losses"]
    lines.append(f"losses ({len(first)} steps each, global): {first[0]:.4f} first, "
                 f"{first[-1]:.4f} last; the strategies agree to {report['loss_spread']:.1e} "
                 "relative")
    return "\n".join(lines)
