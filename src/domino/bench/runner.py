"""``domino bench``: sync TP vs Domino schedules vs the no-comm ideal on one model and batch.

The parent validates the arguments, starts one worker process per TP rank (each in its own
network namespace with ``--emulate-link``), waits for them (stopping all when one fails), then
turns rank 0's raw measurements into figures, a JSON report, timeline pictures and a table.
See ``worker.py`` for what a rank measures and ``modes.py`` for the mode grammar.

Figures per mode (medians over rounds; a round's time is its slowest rank's):
exposed comm = T_mode - T_nocomm, comm hidden = 1 - exposed(mode) / exposed(sync),
speedup = T_sync / T_mode, tokens/s = micro_batch_size * seq_length / T_mode (per TP group);
a sequence-parallel mode (``...:sp``) takes sync:sp and nocomm:sp as its sync and nocomm.
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
from typing import Any

import torch

from domino.bench.modes import DEFAULT_MODES, GRAMMAR, Mode, parse_modes
from domino.bench.pipeline import DEFAULT_SCHEDULES as _PIPELINE_DEFAULT
from domino.bench.pipeline import PIPELINE_MICRO_BATCHES, PIPELINE_PLAN
from domino.bench.worker import DTYPES, build_config
from domino.netem import (
    EmulatedLink,
    check_can_emulate,
    cleanup_stale,
    parse_rate,
    rate_bits_per_s,
)
from domino.supervisor import local_env, run_ranks
from domino.transformer.autotune import regime_of
from domino.utils import free_port

__all__ = ["add_arguments", "best_mode", "compute_results", "main", "parse_modes", "run"]

TIMING_METHOD = (
    "per round, every mode once in an order rotated by one each round; per step: barrier, "
    "perf_counter around zero_grad + forward + backward (CUDA synchronised); a round's step "
    "time is the max over ranks; step_time_s is the median over measured rounds"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``domino bench`` flags to ``parser``."""
    a = parser.add_argument
    a("--model", choices=("stack", "gpt"), default="stack",
      help="stack: the transformer stack on random [s, b, h] input; gpt: the full GPT model")
    a("--num-layers", type=int, default=2)
    a("--hidden-size", type=int, default=512)
    a("--num-attention-heads", type=int, default=8)
    a("--seq-length", type=int, default=256)
    a("--micro-batch-size", type=int, default=8, help="batch per TP group and step")
    a("--vocab-size", type=int, default=32000, help="vocabulary (--model gpt only)")
    a("--tensor-model-parallel-size", type=int, default=2, help="TP size = number of ranks")
    a("--modes", default=None,
      help=f"comma-separated modes: {GRAMMAR} [default: {DEFAULT_MODES}]")
    a("--steps", type=int, default=10, help="measured rounds (steps per mode)")
    a("--warmup", type=int, default=2, help="unmeasured rounds first")
    a("--threads-per-rank", type=int, default=1, help="torch / OpenMP threads per rank")
    a("--dtype", choices=tuple(DTYPES), default="fp32")
    a("--recompute-granularity", choices=("full", "selective"), default=None,
      help="activation recomputation of every mode's model (memory for compute)")
    a("--attention-dropout", type=float, default=0.0,
      help="attention dropout of every mode's model (with it the core attention keeps its "
           "s x s probabilities for backward, what selective recomputation drops)")
    a("--seed", type=int, default=1234)
    a("--device", choices=("auto", "cpu", "cuda"), default="auto",
      help="auto: cuda when it has a GPU per rank, else cpu")
    a("--emulate-link", metavar="RATE", default=None,
      help="run each rank in its own network namespace over a veth shaped to RATE "
           "(e.g. 1gbit, 100mbit); root only")
    a("--simulate-link", metavar="RATE", default=None,
      help="instead of sending data, make each all-reduce take RATE's time with no CPU cost "
           "(timing only, like nocomm): how well a schedule hides a link when moving bytes is "
           "free for the host; no root needed")
    a("--link-mtu", type=int, default=None, metavar="BYTES",
      help="MTU of the emulated link's veths (default: the veth default, 1500); e.g. 9000 for "
           "jumbo frames, which cut the host CPU each transfer costs")
    a("--no-shared-memory-comm", dest="shared_memory_comm", action="store_false",
      help="keep every collective on gloo (default on CPU: ranks on one host move TP "
           "collectives through shared memory; emulated hosts always use gloo)")
    a("--timeout", type=float, default=300.0,
      help="seconds a collective may wait for a peer before the ranks give up")
    a("--pipeline-model-parallel-size", type=int, default=1,
      help="> 1: compare pipeline schedules instead of Domino modes (GPT model, one stage per "
           "emulated host with --emulate-link)")
    a("--pipeline-micro-batches", type=int, default=None,
      help=f"pipeline micro-batches per step [default: {PIPELINE_MICRO_BATCHES}]")
    a("--schedules", default=None,
      help=f"pipeline schedules to compare [default: {_PIPELINE_DEFAULT}]")
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
      help="chunk size of the interleaved schedule [default: num_layers / (2 x PP)]")
    a("--pipeline-stage-layers", default=None,
      help="uneven stages, layers per stage (e.g. 5,3; not for the interleaved schedule)")
    a("--plan", default=None, help=f"Domino plan inside each pipeline stage [default: "
      f"{PIPELINE_PLAN}]")
    a("--json", metavar="PATH", default=None, help="write the report here")
    a("--out-dir", metavar="DIR", default=None,
      help="write a PNG timeline and a Chrome trace per traced mode here")


# ---- validation -----------------------------------------------------------------------------

# Flags only a pipeline comparison reads: given without one they would be silently ignored.
PIPELINE_ONLY = ("pipeline_micro_batches", "schedules", "num_layers_per_virtual_pipeline_stage",
                 "pipeline_stage_layers", "plan")


def _check_modes(modes: list[Mode], args: argparse.Namespace) -> None:
    for mode in modes:
        mode.plan.check_fits(args.micro_batch_size, what=f"the micro-batches (m<N>) of {mode.name}",
                             batch_name="--micro-batch-size")
        mode.plan.check_width(args.hidden_size, what=f"the column chunks (c<K>) of {mode.name}",
                              width_name="--hidden-size")
        tp = args.tensor_model_parallel_size
        if mode.sequence_parallel and args.seq_length % tp:
            raise ValueError(f"{mode.name} splits the sequence over the {tp} TP ranks: "
                             f"--seq-length={args.seq_length} is not divisible by {tp}; use a "
                             f"multiple of {tp} or drop the :sp modes.")


def _resolve_device(choice: str, world: int) -> str:
    have = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if choice == "cuda" and not have:
        raise ValueError(f"--device cuda needs {world} visible CUDA devices (one per rank); "
                         "use --device cpu")
    return "cuda" if choice == "cuda" or (choice == "auto" and have) else "cpu"


def _validate(args: argparse.Namespace) -> tuple[dict[str, Any], list[Mode]]:
    """Check everything that can be checked before processes start; return the worker spec."""
    given = [f"--{n.replace('_', '-')}" for n in PIPELINE_ONLY if getattr(args, n) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} only apply to a pipeline comparison: add "
                         "--pipeline-model-parallel-size 2 (or more), or drop them (the Domino "
                         "modes to compare are chosen with --modes)")
    modes = parse_modes(args.modes if args.modes is not None else DEFAULT_MODES)
    for name in ("steps", "threads_per_rank", "tensor_model_parallel_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.timeout <= 0:
        raise ValueError(f"--timeout={args.timeout} must be > 0")
    if args.model == "gpt" and args.vocab_size < 1:
        raise ValueError(f"--vocab-size={args.vocab_size} must be >= 1 for --model gpt")
    tp = args.tensor_model_parallel_size
    spec: dict[str, Any] = {
        k: getattr(args, k) for k in (
            "model", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
            "micro_batch_size", "vocab_size", "tensor_model_parallel_size", "steps", "warmup",
            "threads_per_rank", "dtype", "seed", "timeout", "recompute_granularity",
            "attention_dropout", "shared_memory_comm")}
    build_config(spec).validate_parallel(tp)
    _check_modes(modes, args)
    spec["modes"] = [m.name for m in modes]
    spec["device"] = _resolve_device(args.device, tp)
    spec["trace"] = args.out_dir is not None
    if args.simulate_link is not None:
        if args.emulate_link is not None:
            raise ValueError("--simulate-link and --emulate-link exclude each other: simulate a "
                             "CPU-free link or emulate a real one, not both")
        spec["simulate_link"] = parse_rate(args.simulate_link)
        if tp < 2:
            raise ValueError("--simulate-link needs --tensor-model-parallel-size >= 2")
    check_link(args, spec, hosts=tp)
    if args.json is not None:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise ValueError(f"--json {args.json}: directory {parent} does not exist")
    return spec, modes


def check_link(args: argparse.Namespace, spec: dict[str, Any], hosts: int) -> None:
    """``--emulate-link`` / ``--link-mtu`` into ``spec`` (``hosts`` emulated hosts)."""
    if args.link_mtu is not None and args.emulate_link is None:
        raise ValueError("--link-mtu sets the emulated link's MTU: add --emulate-link RATE")
    if args.emulate_link is not None:
        spec["link"] = parse_rate(args.emulate_link)
        if args.link_mtu is not None:
            if not 1280 <= args.link_mtu <= 65535:
                raise ValueError(f"--link-mtu={args.link_mtu} must be in [1280, 65535] (1500 is "
                                 "Ethernet's, 9000 jumbo frames)")
            spec["link_mtu"] = args.link_mtu
        if hosts < 2:
            raise ValueError("--emulate-link needs two or more hosts: --tensor-model-parallel-"
                             "size >= 2 (one host per rank), or a pipeline (one per stage)")
        if spec["device"] != "cpu":
            raise ValueError("--emulate-link shapes gloo's TCP traffic; use it with --device cpu")
        try:
            check_can_emulate()
        except RuntimeError as err:
            raise ValueError(str(err)) from err  # a set-up problem: report it like bad flags


# ---- launching ranks --------------------------------------------------------------------------


def _launch(spec_path: str, spec: dict[str, Any], link: EmulatedLink | None,
            worker: tuple[str, ...] = (sys.executable, "-m", "domino.bench.worker")) -> None:
    """Run ``worker + (spec_path,)`` once per rank (in the link's namespaces when given);
    raise :class:`~domino.supervisor.RankFailed` if any rank fails."""
    world = spec.get("world_size", spec["tensor_model_parallel_size"])
    per_host = spec.get("ranks_per_host", 1)  # a pipeline stage's ranks share a host
    # A fresh namespace has every port free; on loopback pick one that is free now.
    port = 29500 if link is not None else free_port()
    threads = str(spec["threads_per_rank"])
    commands, envs = [], []
    for rank in range(world):
        env = local_env(rank, world, port, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        argv = [*worker, spec_path]
        if link is not None:
            env.update(link.env_for(rank // per_host, port))
            # c10d warns that it cannot resolve peer hostnames in a bare namespace: noise.
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            argv = link.wrap(rank // per_host, argv)
        else:
            env["GLOO_SOCKET_IFNAME"] = "lo"
        commands.append(argv)
        envs.append(env)
    run_ranks(commands, envs, label="domino bench", straggler_s=spec["timeout"])


# ---- figures ----------------------------------------------------------------------------------


def _split_nocomm(mode: Mode, modes: list[Mode]) -> Mode | None:
    """The comm-free run with the same split (same overlap preferred; it is moot without comm)."""
    same = [m for m in modes if not m.comm and m.split == mode.split
            and m.sequence_parallel == mode.sequence_parallel]
    exact = [m for m in same if m.plan == mode.plan]
    return (exact or same or [None])[0]


def compute_results(raw: dict[str, Any], modes: list[Mode], tokens: int) -> list[dict[str, Any]]:
    """One figures dict per mode from the workers' raw measurements."""
    cpu_8mib = raw.get("allreduce_8mib_cpu_s")
    sent = raw.get("allreduce_bytes_per_step", {})
    med = {m.name: statistics.median(raw["step_times_s"][m.name]) for m in modes}
    t_sync, t_nocomm = med.get("sync"), med.get("nocomm")
    rows = []
    for mode in modes:
        t = med[mode.name]
        # Sequence-parallel modes against their own sync and nocomm when those ran.
        fam = mode.family
        f_sync, f_nocomm = med.get("sync" + fam, t_sync), med.get("nocomm" + fam, t_nocomm)
        f_exposed_sync = (f_sync - f_nocomm if f_sync is not None and f_nocomm is not None
                          else None)
        base = t - f_nocomm if f_nocomm is not None else None
        exposed = base if mode.comm else None
        split = _split_nocomm(mode, modes) if mode.is_domino else None
        hidden = None
        if (mode.is_domino and exposed is not None and f_exposed_sync is not None
                and f_exposed_sync > 0):
            hidden = 1.0 - exposed / f_exposed_sync
        peaks = raw["peak_bytes"][mode.name]
        known = [p for p in peaks if p is not None]
        rows.append({
            "mode": mode.name,
            "comm_enabled": mode.comm,
            "micro_batches": mode.plan.micro_batches,
            "overlap": mode.plan.overlap,
            "column_chunks": mode.plan.column_chunks,
            "sequence_parallel": mode.sequence_parallel,
            "step_time_s": t,
            "step_times_s": raw["step_times_s"][mode.name],
            "step_times_s_per_rank": raw["per_rank_step_times_s"][mode.name],
            "tokens_per_s": tokens / t,
            "exposed_comm_s": exposed,
            "exposed_comm_vs_split_nocomm_s": t - med[split.name] if split is not None else None,
            # For comm-free split runs: what splitting alone costs over unsplit compute.
            "split_cost_s": base if not mode.comm and mode.split != (1, 1) else None,
            "comm_hidden": hidden,
            "speedup_vs_sync": f_sync / t if f_sync is not None else None,
            "peak_mem_bytes": max(known) if known else None,
            # Bytes this rank all-reduced in one step, and the host CPU that moving them takes
            # (scaled from the 8 MiB probe): overlapped comm still costs this much CPU.
            "allreduce_bytes_per_step": sent.get(mode.name),
            "comm_cpu_s_per_step": (None if cpu_8mib is None or sent.get(mode.name) is None
                                    else cpu_8mib * sent[mode.name] / (8 << 20)),
            "peak_mem_bytes_per_rank": peaks,
            "peak_rss_bytes_per_rank": raw["peak_rss_bytes"][mode.name],
            "timeline_png": None,
            "chrome_trace": None,
        })
    return rows


def best_mode(rows: list[dict[str, Any]]) -> str | None:
    """The comm-enabled Domino mode with the lowest median step time (None without one)."""
    domino = [r for r in rows if r["comm_enabled"] and r["mode"].startswith("domino:")]
    return min(domino, key=lambda r: r["step_time_s"])["mode"] if domino else None


def _render(raw: dict[str, Any], rows: list[dict[str, Any]], out_dir: str, link: str) -> None:
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
                 f"ms untraced), TP={len(tls)}, link {link}")
        render_png(tls, png, title=title)
        row["timeline_png"], row["chrome_trace"] = png, trace


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def format_table(report: dict[str, Any]) -> str:
    """The report as an aligned text table plus a line naming the best Domino mode."""
    c = report["config"]
    ar, ar_cpu = c.get("allreduce_8mib_s"), c.get("allreduce_8mib_cpu_s")
    lines = [
        f"domino bench: {c['model']}, {c['num_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']} heads, seq {c['seq_length']}, batch {c['micro_batch_size']}, "
        f"TP={c['tensor_model_parallel_size']}, {c['dtype']}, {c['device']}, "
        f"{c['threads_per_rank']} thread(s)/rank, link {c['link']}"
        + (f" MTU {c['link_mtu']}" if c.get("link_mtu") else "")
        + (f", TP over {c['transports']['tp']}" if c.get("transports") else "")
        + (f" (8 MiB all-reduce {ar * 1e3:.1f} ms" if ar is not None else "")
        + (f", {ar_cpu * 1e3:.1f} ms of host CPU" if ar is not None and ar_cpu is not None else "")
        + (")" if ar is not None else "")
        + f", {c['steps']} steps after {c['warmup']} warm-up",
    ]
    head = ("mode", "step ms", "min ms", "tokens/s", "exposed ms", "vs split ms", "hidden",
            "speedup", "peak MiB")
    body = []
    for r in report["results"]:
        exposed = r["exposed_comm_s"] if r["comm_enabled"] else r["split_cost_s"]
        body.append((
            r["mode"], _fmt(r["step_time_s"], 1e3), _fmt(min(r["step_times_s"]), 1e3),
            _fmt(r["tokens_per_s"], 1.0, ".0f"),
            _fmt(exposed, 1e3) + ("" if r["comm_enabled"] or exposed is None else " (split)"),
            _fmt(r["exposed_comm_vs_split_nocomm_s"], 1e3), _fmt(r["comm_hidden"], 100, ".0f", "%"),
            _fmt(r["speedup_vs_sync"], 1.0, ".2f", "x"),
            _fmt(r["peak_mem_bytes"], 1 / 2**20, ".1f")))
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    for row in (head, *body):
        cells = [row[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    best = report.get("best_domino_mode")
    if best is not None:
        r = next(x for x in report["results"] if x["mode"] == best)
        lines.append(f"best Domino mode: {best} ({r['step_time_s'] * 1e3:.1f} ms"
                     + (f", {r['speedup_vs_sync']:.2f}x vs sync" if r["speedup_vs_sync"] else "")
                     + (f", hides {r['comm_hidden'] * 100:.0f}% of sync's exposed comm"
                        if r["comm_hidden"] is not None else "") + ")")
    regime = report.get("regime")
    if regime is not None:
        lines.append(f"regime: {regime['name']} ({regime['why']}) -> pick {regime['pick']}")
    bound = report.get("comm_cpu_bound")
    if bound is not None:
        lines.append(
            f"TP comm per step: {bound['allreduce_bytes_per_step'] / 2**20:.1f} MiB all-reduced "
            f"per rank, at least {bound['comm_cpu_s_per_step'] * 1e3:.0f} ms of host CPU (both "
            f"ranks and the kernel, scaled from the 8 MiB probe; smaller messages cost more per "
            f"byte); with the ranks' compute filling the {bound['cpus']} CPUs, overlapped comm "
            f"still takes about {bound['floor_s'] * 1e3:.0f} ms or more per step from compute"
            + (f", so at most {bound['comm_hidden_ceiling'] * 100:.0f}% of sync's exposed comm "
               "can be hidden on this host" if bound["comm_hidden_ceiling"] is not None else ""))
    return "\n".join(lines)


def detect_regime(rows: list[dict[str, Any]], raw: dict[str, Any], cpus: int,
                  busy: bool) -> dict[str, Any] | None:
    """Which regime the measured link is in (:func:`domino.transformer.autotune.regime_of`) and
    the plan that wins there: no split when communication is negligible, else the fastest
    Domino mode. Needs ``sync`` and ``nocomm`` rows; the host-CPU share of an all-reduce comes
    from the link probe and counts only when the ranks' compute fills the host's CPUs."""
    med = {r["mode"]: r["step_time_s"] for r in rows}
    if "sync" not in med or "nocomm" not in med:
        return None
    wall, cpu = raw.get("allreduce_8mib_s"), raw.get("allreduce_8mib_cpu_s")
    # cpu_s is host-wide busy CPU seconds per all-reduce: the share of the host's CPU capacity
    # a transfer takes while it runs.
    share = cpu / (wall * max(1, cpus)) if busy and wall and cpu is not None else None
    regime = regime_of(med["sync"], t_nocomm=med["nocomm"], comm_cpu_share=share)
    best = best_mode(rows)
    pick = "sync" if regime.name == "negligible" or best is None or med[best] >= med["sync"] \
        else best
    return {"name": regime.name, "why": regime.why, "comm_cpu_share": share, "pick": pick}


def comm_cpu_bound(rows: list[dict[str, Any]], cpus: int) -> dict[str, Any] | None:
    """What moving sync's bytes costs the host's CPUs, and the share of sync's exposed comm that
    overlap can hide at most when compute already keeps every CPU busy: the comm's CPU time is
    then taken from compute (``floor_s`` = CPU seconds / CPUs), hidden or not.

    None without a ``sync`` row or a CPU probe.
    """
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    if sync is None or sync.get("comm_cpu_s_per_step") is None:
        return None
    cpu = sync["comm_cpu_s_per_step"]
    floor = cpu / max(1, cpus)
    exposed = sync["exposed_comm_s"]
    return {
        "allreduce_bytes_per_step": sync["allreduce_bytes_per_step"],
        "comm_cpu_s_per_step": cpu,
        "cpus": cpus,
        "floor_s": floor,
        "comm_hidden_ceiling": (max(0.0, 1.0 - floor / exposed)
                                if exposed is not None and exposed > 0 else None),
    }


# ---- entry points -----------------------------------------------------------------------------


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the workers on ``spec`` (on the emulated link when it names one); rank 0's raw
    results."""
    with tempfile.TemporaryDirectory(prefix="domino-bench-") as tmp:
        spec["result_path"] = os.path.join(tmp, "raw.json")
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        if "link" in spec:
            cleanup_stale()  # namespaces left by runs that were killed
            hosts = spec.get("hosts", spec["tensor_model_parallel_size"])
            with EmulatedLink(num_hosts=hosts, rate=spec["link"],
                              mtu=spec.get("link_mtu")) as link:
                _launch(spec_path, spec, link)
        else:
            _launch(spec_path, spec, None)
        with open(spec["result_path"]) as f:
            return json.load(f)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args``; print the table and return the report."""
    if args.pipeline_model_parallel_size != 1:
        from domino.bench.pipeline import run_pipeline

        return run_pipeline(args)
    spec, modes = _validate(args)
    if args.out_dir is not None:
        os.makedirs(args.out_dir, exist_ok=True)
    raw = execute(spec)
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
        "allreduce_8mib_s": raw["allreduce_8mib_s"],
        "allreduce_8mib_cpu_s": raw.get("allreduce_8mib_cpu_s"),
        "param_bytes_per_rank": raw["param_bytes"],
        "tokens_per_step": args.micro_batch_size * args.seq_length,
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
        _render(raw, rows, args.out_dir, link)
    best = best_mode(rows)
    # Only meaningful where the ranks' threads fill the host's CPUs (the default set-up on CPU).
    busy = (raw["device"] == "cpu" and "simulate_link" not in spec
            and args.tensor_model_parallel_size * args.threads_per_rank >= (os.cpu_count() or 1))
    report = {"config": config, "results": rows, "best_domino_mode": best,
              "comm_cpu_bound": comm_cpu_bound(rows, os.cpu_count() or 1) if busy else None,
              "regime": detect_regime(rows, raw, cpus=os.cpu_count() or 1, busy=busy)}
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(format_table(report), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m domino.bench.runner [flags]``."""
    parser = argparse.ArgumentParser(
        prog="python -m domino.bench.runner", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except ValueError as err:
        print(f"domino bench: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
