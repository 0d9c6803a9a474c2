"""The report of a comparison of Domino modes: its config block and rows (JSON), the text table,
and one timeline picture and Chrome trace per traced mode."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from typing import Any

import torch

from domino.bench.figures import (
    best_mode,
    comm_cpu_bound,
    compute_results,
    detect_regime,
    header_lines,
)
from domino.bench.modes import Mode
from domino.netem import rate_bits_per_s

TIMING_METHOD = (
    "per round, every mode once in an order rotated by one each round; per step: barrier, "
    "perf_counter around zero_grad + forward + backward (CUDA synchronised); a round's step "
    "time is the max over ranks; step_time_s is the median over measured rounds"
)


def build_report(args: argparse.Namespace, spec: dict[str, Any], modes: list[Mode],
                 raw: dict[str, Any]) -> dict[str, Any]:
    """The report of a run of ``spec`` (from ``args``) whose rank 0 measured ``raw``; with
    ``--out-dir``, the timelines of its traced modes are written there."""
    link = spec.get("link", "loopback")
    rate = spec.get("link", spec.get("simulate_link"))
    if "simulate_link" in spec:
        link = f"{spec['simulate_link']} simulated (no CPU, no data)"
    flags = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "modes"}
    config = {
        **flags,
        "modes": spec["modes"],
        "device": raw["device"],
        "link": link,
        "link_rate_bits_per_s": rate_bits_per_s(rate) if rate is not None else None,
        "transports": raw.get("transports"),
        "host_malloc": raw.get("host_malloc"),
        "allreduce_8mib_s": raw["allreduce_8mib_s"],
        "allreduce_8mib_cpu_s": raw.get("allreduce_8mib_cpu_s"),
        "exchange_8mib_s": raw.get("exchange_8mib_s"),
        "exchange_8mib_cpu_s": raw.get("exchange_8mib_cpu_s"),
        "param_bytes_per_rank": raw["param_bytes"],
        "model_flops_per_step": raw.get("model_flops_per_step"),
        "peak_flops_per_s": raw.get("peak_flops_per_s"),
        "mfu_of": raw.get("peak_what"),
        "attention": raw.get("attention"),
        "compile_graphs": raw.get("compile_graphs"),
        "compile_s": raw.get("compile_s"),
        "compile_graphs_timed": raw.get("compile_graphs_timed"),
        "tokens_per_step": (args.micro_batch_size * args.seq_length
                            * getattr(args, "expert_model_parallel_size", 1)),
        "timing_method": TIMING_METHOD,
        "memory_method": raw["memory_method"],
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows = compute_results(raw, modes, config["tokens_per_step"])
    if args.out_dir is not None:
        render_timelines(raw, rows, args.out_dir, link)
    best = best_mode(rows)
    # Only meaningful where the ranks' threads fill the host's CPUs (the default set-up on CPU).
    ranks = len(raw["param_bytes"])
    busy = (raw["device"] == "cpu" and "simulate_link" not in spec
            and ranks * args.threads_per_rank >= (os.cpu_count() or 1))
    return {"config": config, "results": rows, "best_domino_mode": best,
            "comm_cpu_bound": comm_cpu_bound(rows, os.cpu_count() or 1) if busy else None,
            "regime": detect_regime(rows, raw, cpus=os.cpu_count() or 1, busy=busy)}


def render_timelines(raw: dict[str, Any], rows: list[dict[str, Any]], out_dir: str,
                     link: str) -> None:
    """A PNG timeline and a Chrome trace per traced mode into ``out_dir``; their paths go into
    ``rows``."""
    from domino.bench.timeline import Timeline, render_png, to_chrome_trace

    for row in rows:
        dicts = raw["traces"].get(row["mode"])
        if not dicts:
            continue
        tls = [Timeline.from_dict(d) for d in dicts]
        slug = row["mode"].replace(":", "_")
        png = os.path.join(out_dir, f"timeline_{slug}.png")
        trace = os.path.join(out_dir, f"trace_{slug}.json")
        to_chrome_trace(tls, trace)
        title = (f"{row['mode']}: one traced fwd+bwd step (median {row['step_time_s'] * 1e3:.0f} "
                 f"ms untraced), {len(tls)} ranks, link {link}")
        render_png(tls, png, title=title)
        row["timeline_png"], row["chrome_trace"] = png, trace
        # Where the traced step's time went on each rank: working (compute not spent blocked)
        # and blocked on a collective.
        row["traced_work_s_per_rank"] = [tl.covered_s("compute", minus="wait") for tl in tls]
        row["traced_wait_s_per_rank"] = [tl.covered_s("wait") for tl in tls]


def _probe_text(kind: str, seconds: float | None, cpu_s: float | None) -> str:
    """The header's note on a probe that ran: ' (8 MiB <kind> N ms, M ms of host CPU)'."""
    if seconds is None:
        return ""
    cpu = f", {cpu_s * 1e3:.1f} ms of host CPU" if cpu_s is not None else ""
    return f" (8 MiB {kind} {seconds * 1e3:.1f} ms{cpu})"


def _per_rank(seconds: list[float]) -> str:
    return " / ".join(f"{v * 1e3:.0f}" for v in seconds)


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def format_table(report: dict[str, Any]) -> str:
    """The report as an aligned text table plus a line naming the best Domino mode."""
    c = report["config"]
    lines = [
        f"domino bench: {c['model']}, {c['num_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']} heads, seq {c['seq_length']}, batch {c['micro_batch_size']}, "
        f"TP={c['tensor_model_parallel_size']}"
        + (f" x EP={c['expert_model_parallel_size']} ({c['num_experts']} experts, top-"
           f"{c['moe_router_topk']})" if (c.get("expert_model_parallel_size") or 1) > 1 else "")
        + (f" x CP={c['context_parallel_size']} ({c['cp_comm_type']})"
           if (c.get("context_parallel_size") or 1) > 1 else "")
        + f", {c['dtype']}, {c['device']}, "
        f"{c['threads_per_rank']} thread(s)/rank, link {c['link']}"
        + (f" MTU {c['link_mtu']}" if c.get("link_mtu") else "")
        + (f", TP over {c['transports']['tp']}" if c.get("transports") else "")
        + (f", EP over {c['transports']['ep']}" if "ep" in (c.get("transports") or {}) else "")
        + (", malloc keeps freed memory" if c.get("host_malloc") == "freed memory kept" else "")
        + _probe_text("all-reduce", c.get("allreduce_8mib_s"), c.get("allreduce_8mib_cpu_s"))
        + _probe_text("all-to-all", c.get("exchange_8mib_s"), c.get("exchange_8mib_cpu_s"))
        + f", {c['steps']} steps after {c['warmup']} warm-up",
    ]
    lines += header_lines(c)
    head = ("mode", "step ms", "min ms", "CPU ms", "tokens/s", "TFLOP/s/rank", "MFU",
            "exposed ms", "vs split ms", "hidden", "speedup", "peak MiB")
    body = []
    for r in report["results"]:
        exposed = r["exposed_comm_s"] if r["comm_enabled"] else r["split_cost_s"]
        body.append((
            r["mode"], _fmt(r["step_time_s"], 1e3), _fmt(min(r["step_times_s"]), 1e3),
            _fmt(r.get("cpu_s_per_step"), 1e3), _fmt(r["tokens_per_s"], 1.0, ".0f"),
            _fmt(r.get("model_flops_per_s_per_rank"), 1e-12, ".3f"),
            _fmt(r.get("mfu"), 100, ".1f", "%"),
            _fmt(exposed, 1e3) + ("" if r["comm_enabled"] or exposed is None else " (split)"),
            _fmt(r["exposed_comm_vs_split_nocomm_s"], 1e3), _fmt(r["comm_hidden"], 100, ".0f", "%"),
            _fmt(r["speedup_vs_sync"], 1.0, ".2f", "x"),
            _fmt(r["peak_mem_bytes"], 1 / 2**20, ".1f")))
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    for row in (head, *body):
        cells = [row[0].ljust(widths[0])]
        cells += [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    best = report.get("best_domino_mode")
    if best is not None:
        r = next(x for x in report["results"] if x["mode"] == best)
        lines.append(f"best Domino mode: {best} ({r['step_time_s'] * 1e3:.1f} ms"
                     + (f", {r['speedup_vs_sync']:.2f}x vs sync" if r["speedup_vs_sync"] else "")
                     + (f", hides {r['comm_hidden'] * 100:.0f}% of sync's exposed comm"
                        if r["comm_hidden"] is not None else "")
                     + (f"; {r['comm_hidden_paired'] * 100:.0f}% paired by round"
                        if r.get("comm_hidden_paired") is not None else "") + ")"
                     + (f"; its ranks' CPU per step {r['cpu_vs_split_nocomm_s'] * 1e3:+.1f} ms "
                        "against the same split without comm"
                        if r.get("cpu_vs_split_nocomm_s") is not None else ""))
    regime = report.get("regime")
    if regime is not None:
        lines.append(f"regime: {regime['name']} ({regime['why']}) -> pick {regime['pick']}")
    traced = [r for r in report["results"] if r.get("traced_work_s_per_rank")]
    if traced:
        lines.append("traced step, per rank: " + "; ".join(
            f"{r['mode']} worked {_per_rank(r['traced_work_s_per_rank'])} ms, waited "
            f"{_per_rank(r['traced_wait_s_per_rank'])} ms" for r in traced))
    bound = report.get("comm_cpu_bound")
    if bound is not None:
        exchanged = bound["exchange_bytes_per_step"]
        reduced = bound["allreduce_bytes_per_step"] - exchanged
        sent = " and ".join(
            ([f"{reduced / 2**20:.1f} MiB all-reduced"] if reduced else [])
            + ([f"{exchanged / 2**20:.1f} MiB exchanged"] if exchanged else [])) or "0 MiB"
        lines.append(
            f"comm per step: {sent} per rank, at least {bound['comm_cpu_s_per_step'] * 1e3:.0f} "
            f"ms of host CPU (the ranks and the kernel, scaled from the 8 MiB probes; smaller "
            f"messages cost more per byte); with the ranks' compute filling the "
            f"{bound['cpus']} CPUs, overlapped comm "
            f"still takes about {bound['floor_s'] * 1e3:.0f} ms or more per step from compute"
            + (f", so at most {bound['comm_hidden_ceiling'] * 100:.0f}% of sync's exposed comm "
               "can be hidden on this host" if bound["comm_hidden_ceiling"] is not None else ""))
    return "\n".join(lines)
