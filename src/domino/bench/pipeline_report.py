"""The report of ``domino bench --pipeline-model-parallel-size P``: per schedule the step time
(slowest rank), the measured bubble (1 - a stage's busy time / the step time, averaged over
stages; busy = its F, B and W passes), the theoretical bubble, the pipeline micro-batches a stage
holds at most and each stage's peak step memory; a timeline per schedule with a row per stage.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from domino.bench.figures import header_lines
from domino.bench.timeline import Timeline, render_png, to_chrome_trace
from domino.flops import utilisation
from domino.pipeline.schedules import theoretical_bubble


def results(raw: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One figures row per schedule."""
    ranks = raw["ranks"]
    p, m = spec["pipeline_model_parallel_size"], spec["pipeline_micro_batches"]
    tokens = m * spec["micro_batch_size"] * spec["seq_length"]
    flops, peak = raw.get("model_flops_per_step"), raw.get("peak_flops_per_s")
    out = []
    for name in spec["schedules"]:
        rounds = list(zip(*(r["times"][name] for r in ranks), strict=True))
        step = [max(t) for t in rounds]  # the pipeline moves at its slowest rank's pace
        bubbles = [1.0 - statistics.mean(r["busy"][name][i] for r in ranks) / step[i]
                   for i in range(len(step))]
        layout = raw["layouts"][name]
        chunks = len(layout) // p
        stage_ranks = {}
        for r in ranks:
            stage_ranks.setdefault(r["stage"], r)
        per_rank, mfu = utilisation(flops, len(ranks), statistics.median(step), peak)
        out.append({
            "schedule": name, "step_time_s": statistics.median(step), "step_times_s": step,
            "tokens_per_s": tokens / statistics.median(step),
            "model_flops_per_s_per_rank": per_rank, "mfu": mfu,
            "bubble": statistics.median(bubbles), "bubbles": bubbles,
            "theoretical_bubble": theoretical_bubble(name, p, m, chunks),
            "layers": layout, "chunks": chunks,
            "held_micro_batches_per_stage": [stage_ranks[s]["held"][name] for s in range(p)],
            "peak_mem_bytes_per_stage": [stage_ranks[s]["memory"][name] for s in range(p)],
            "timeline_png": None,
        })
    return out


def format_table(report: dict[str, Any]) -> str:
    """The report as an aligned text table, a row per schedule."""
    c = report["config"]
    lines = [f"domino bench (pipeline): GPT {c['num_layers']} layers, hidden {c['hidden_size']}, "
             f"{c['num_attention_heads']} heads, seq {c['seq_length']}, micro-batch "
             f"{c['micro_batch_size']}, {c['pipeline_micro_batches']} pipeline micro-batches, "
             f"PP={c['pipeline_model_parallel_size']} x TP={c['tensor_model_parallel_size']} "
             f"(Domino plan {c['plan']} in each stage), {c['dtype']}, {c['device']}, link "
             f"{c['link']}, {c['steps']} steps after {c['warmup']} warm-up"]
    lines += header_lines(c)
    head = ("schedule", "step ms", "tokens/s", "TFLOP/s/rank", "MFU", "bubble", "theory",
            "held mb/stage", "peak MiB/stage")
    body = [(r["schedule"] + (f" (x{r['chunks']} chunks)" if r["chunks"] > 1 else ""),
             f"{r['step_time_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}",
             "-" if r.get("model_flops_per_s_per_rank") is None
             else f"{r['model_flops_per_s_per_rank'] / 1e12:.3f}",
             "-" if r.get("mfu") is None else f"{r['mfu'] * 100:.1f}%",
             f"{r['bubble'] * 100:.0f}%", f"{r['theoretical_bubble'] * 100:.0f}%",
             "/".join(map(str, r["held_micro_batches_per_stage"])),
             "/".join(f"{b / 2**20:.1f}" for b in r["peak_mem_bytes_per_stage"]))
            for r in report["results"]]
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    for row in (head, *body):
        lines.append("  ".join([row[0].ljust(widths[0])]
                               + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]))
    return "\n".join(lines)


def build_report(args: argparse.Namespace, spec: dict[str, Any],
                 raw: dict[str, Any]) -> dict[str, Any]:
    """The report of a run of ``spec`` (from ``args``) whose rank 0 gathered ``raw``; with
    ``--out-dir``, one timeline per schedule is written there."""
    rows = results(raw, spec)
    link = spec.get("link", "loopback")
    config = {**{k: v for k, v in vars(args).items() if not k.startswith("_")},
              "schedules": spec["schedules"], "device": raw["device"], "link": link,
              "layers_per_virtual_stage": spec["layers_per_virtual_stage"],
              "model_flops_per_step": raw.get("model_flops_per_step"),
              "peak_flops_per_s": raw.get("peak_flops_per_s"), "mfu_of": raw.get("peak_what"),
              "attention": raw.get("attention"),
              "compile_graphs": raw.get("compile_graphs"), "compile_s": raw.get("compile_s"),
              "compile_graphs_timed": raw.get("compile_graphs_timed")}
    report = {"config": config, "results": rows}
    if args.out_dir is not None:
        _render(raw, rows, args.out_dir, link, spec)
    return report


def _render(raw: dict[str, Any], rows: list[dict[str, Any]], out_dir: str, link: str,
            spec: dict[str, Any]) -> None:
    for row in rows:
        # One row per stage (its TP rank 0: the others run the same passes).
        tls = [Timeline.from_dict(r["traces"][row["schedule"]]) for r in raw["ranks"]
               if r["tp"] == 0]
        png = os.path.join(out_dir, f"timeline_pp_{row['schedule']}.png")
        to_chrome_trace(tls, os.path.join(out_dir, f"trace_pp_{row['schedule']}.json"))
        render_png(tls, png, row_label="stage",
                   title=f"{row['schedule']}: one traced step, {spec['pipeline_micro_batches']} "
                         f"pipeline micro-batches over {spec['pipeline_model_parallel_size']} "
                         f"stages (bars: F/B/W passes per micro-batch), link {link}; bubble "
                         f"{row['bubble'] * 100:.0f}% measured, "
                         f"{row['theoretical_bubble'] * 100:.0f}% in theory")
        row["timeline_png"] = png
