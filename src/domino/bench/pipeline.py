"""``domino bench --pipeline-model-parallel-size P``: pipeline schedules side by side.

Each schedule runs the same GPT (the same weights: every part is drawn from its own seeded
stream) over the same pipeline micro-batches, interleaved round by round
(``domino.timing.time_rotated``). Per schedule it reports the step time (slowest rank), the
measured bubble (1 - a stage's busy time / the step time, averaged over stages; busy = its F, B
and W passes), the schedule's theoretical bubble (a backward costing two forwards, free
communication), the pipeline micro-batches a stage holds at most, and each stage's peak step
memory; one traced step per schedule becomes a timeline with a row per stage.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from domino.bench.hooks import BenchHook
from domino.bench.timeline import Timeline
from domino.parallel_state import ParallelState
from domino.pipeline.model import PipelineModel
from domino.pipeline.partition import Layout, partition
from domino.pipeline.runtime import PipelineRunner
from domino.pipeline.schedules import check_schedule, theoretical_bubble
from domino.plan import Plan
from domino.timing import device_sync, time_rotated

DEFAULT_SCHEDULES = "gpipe,1f1b,interleaved,zero_bubble"
PIPELINE_MICRO_BATCHES = 8  # --pipeline-micro-batches when not given
PIPELINE_PLAN = "m2:cross"  # --plan when not given


def layouts(spec: dict[str, Any]) -> dict[str, Layout]:
    """Each schedule's layout (interleaved: chunks of ``layers_per_virtual_stage``)."""
    out = {}
    counts = spec.get("stage_layers")
    for schedule in spec["schedules"]:
        per = spec["layers_per_virtual_stage"] if schedule == "interleaved" else None
        layout = partition(spec["num_layers"], spec["pipeline_model_parallel_size"], per,
                           None if per or counts is None else tuple(counts))
        check_schedule(schedule, layout.stages, spec["pipeline_micro_batches"], layout.chunks)
        out[schedule] = layout
    return out


class _PipelineBench:
    """A model and runner per layout, the step's pipeline micro-batches, one step per call."""

    def __init__(self, spec: dict[str, Any], state: ParallelState) -> None:
        from domino.bench.worker import build_config

        self.spec, self.state = spec, state
        config = build_config(spec)
        self.layouts = layouts(spec)
        plan = Plan.parse(spec["plan"])
        self.models: dict[tuple, PipelineModel] = {}
        self.runners: dict[str, PipelineRunner] = {}
        m, s, b = spec["pipeline_micro_batches"], spec["seq_length"], spec["micro_batch_size"]
        for schedule, layout in self.layouts.items():
            key = layout.bounds
            if key not in self.models:
                torch.manual_seed(spec["seed"])
                self.models[key] = PipelineModel(config, state, layout, plan=plan)
            self.runners[schedule] = PipelineRunner(self.models[key], schedule, m, s, b,
                                                    record=True)
        gen = torch.Generator().manual_seed(spec["seed"] + 1)
        self.batches = []
        for _ in range(m):
            ids = torch.randint(0, spec["vocab_size"], (b, s + 1), generator=gen)
            self.batches.append({k: v.to(state.device) for k, v in {
                "tokens": ids[:, :-1], "labels": ids[:, 1:],
                "loss_mask": torch.ones(b, s), "position_ids": torch.arange(s).expand(b, s),
            }.items()})
        self.scale = 1.0 / (m * b * s)
        self.busy: dict[str, list[float]] = {name: [] for name in self.runners}
        self.held: dict[str, int] = {}

    def step(self, schedule: str) -> None:
        runner = self.runners[schedule]
        runner.model.zero_grad(set_to_none=True)
        _loss, stats = runner.step(self.batches, self.scale)
        device_sync(self.state.device)
        self.busy[schedule].append(sum(t1 - t0 for _name, t0, t1 in stats.spans))
        self.held[schedule] = stats.peak_held

    def traced(self, schedule: str) -> dict[str, Any]:
        """One step recorded on a timeline: its passes, and the pipeline's transfers."""
        tl = Timeline(self.state.pp.rank)
        runner = self.runners[schedule]
        self.state.pp.hook = BenchHook(timeline=tl)
        try:
            self.state.world.barrier()
            runner.model.zero_grad(set_to_none=True)
            _loss, stats = runner.step(self.batches, self.scale)
        finally:
            self.state.pp.hook = None
        for name, t0, t1 in stats.spans:
            mb = int(name[1:].split(".")[0])
            tl.record(name, "compute", t0, t1, mb=mb)
        return tl.to_dict()


def _peak_memory(bench: _PipelineBench, schedule: str) -> int:
    """Peak bytes allocated during one step (beyond what lives across steps)."""
    device = bench.state.device
    for model in bench.models.values():
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        bench.step(schedule)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        bench.step(schedule)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def measure_pipeline(spec: dict[str, Any], device: torch.device) -> dict[str, Any] | None:
    """The worker's side: every rank times, rank 0 returns the raw results."""
    from domino.bench.worker import _quiet_fd2

    state = ParallelState.build(spec["tensor_model_parallel_size"],
                                spec["pipeline_model_parallel_size"], device=device,
                                shared_memory=spec.get("shared_memory_comm", True))
    bench = _PipelineBench(spec, state)
    names = list(bench.runners)
    rows = time_rotated(len(names), lambda i: bench.step(names[i]), spec["warmup"],
                        spec["steps"], state.world, device)
    busy = {n: bench.busy[n][-spec["steps"]:] for n in names}  # the measured rounds
    with _quiet_fd2():
        memory = {n: _peak_memory(bench, n) for n in names}
    traces = {n: bench.traced(n) for n in names} if spec["trace"] else {}
    mine = {"times": dict(zip(names, rows, strict=True)), "busy": busy, "memory": memory,
            "held": bench.held, "traces": traces, "stage": state.pp.rank, "tp": state.tp.rank}
    gathered = state.world.all_gather_json(mine)
    if state.world.rank != 0:
        return None
    return {"device": str(device), "ranks": gathered,
            "layouts": {n: [list(b) for b in lay.bounds] for n, lay in bench.layouts.items()}}


def results(raw: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One figures row per schedule."""
    ranks = raw["ranks"]
    p, m = spec["pipeline_model_parallel_size"], spec["pipeline_micro_batches"]
    tokens = m * spec["micro_batch_size"] * spec["seq_length"]
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
        out.append({
            "schedule": name, "step_time_s": statistics.median(step), "step_times_s": step,
            "tokens_per_s": tokens / statistics.median(step),
            "bubble": statistics.median(bubbles), "bubbles": bubbles,
            "theoretical_bubble": theoretical_bubble(name, p, m, chunks),
            "layers": layout, "chunks": chunks,
            "held_micro_batches_per_stage": [stage_ranks[s]["held"][name] for s in range(p)],
            "peak_mem_bytes_per_stage": [stage_ranks[s]["memory"][name] for s in range(p)],
            "timeline_png": None,
        })
    return out


def format_table(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"domino bench (pipeline): GPT {c['num_layers']} layers, hidden {c['hidden_size']}, "
             f"{c['num_attention_heads']} heads, seq {c['seq_length']}, micro-batch "
             f"{c['micro_batch_size']}, {c['pipeline_micro_batches']} pipeline micro-batches, "
             f"PP={c['pipeline_model_parallel_size']} x TP={c['tensor_model_parallel_size']} "
             f"(Domino plan {c['plan']} in each stage), {c['dtype']}, {c['device']}, link "
             f"{c['link']}, {c['steps']} steps after {c['warmup']} warm-up"]
    head = ("schedule", "step ms", "tokens/s", "bubble", "theory", "held mb/stage",
            "peak MiB/stage")
    body = [(r["schedule"] + (f" (x{r['chunks']} chunks)" if r["chunks"] > 1 else ""),
             f"{r['step_time_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}",
             f"{r['bubble'] * 100:.0f}%", f"{r['theoretical_bubble'] * 100:.0f}%",
             "/".join(map(str, r["held_micro_batches_per_stage"])),
             "/".join(f"{b / 2**20:.1f}" for b in r["peak_mem_bytes_per_stage"]))
            for r in report["results"]]
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    for row in (head, *body):
        lines.append("  ".join([row[0].ljust(widths[0])]
                               + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]))
    return "\n".join(lines)


# ---- the runner's side ----------------------------------------------------------------------


def validate_pipeline(args) -> dict[str, Any]:
    """The worker spec of a pipeline comparison (ValueError before any process starts)."""
    from domino.bench.runner import _resolve_device, check_link
    from domino.bench.worker import build_config

    if args.modes is not None:
        raise ValueError("--modes picks the Domino modes of a TP comparison; a pipeline "
                         "comparison (--pipeline-model-parallel-size > 1) compares --schedules "
                         "with one --plan inside each stage: drop --modes")
    if args.pipeline_micro_batches is None:
        args.pipeline_micro_batches = PIPELINE_MICRO_BATCHES
    if args.plan is None:
        args.plan = PIPELINE_PLAN
    plan = Plan.parse(args.plan)
    p, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    for name in ("pipeline_model_parallel_size", "pipeline_micro_batches", "steps",
                 "threads_per_rank", "tensor_model_parallel_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.simulate_link is not None:
        raise ValueError("--simulate-link times TP all-reduces; the pipeline bench runs on "
                         "loopback or --emulate-link")
    schedules = [s.strip() for s in (args.schedules or DEFAULT_SCHEDULES).split(",") if s.strip()]
    per = args.num_layers_per_virtual_pipeline_stage
    if per is None and "interleaved" in schedules:
        if args.num_layers % (2 * p):
            raise ValueError(f"the interleaved schedule needs --num-layers as a multiple of 2 x "
                             f"PP = {2 * p} (two chunks per stage), or "
                             "--num-layers-per-virtual-pipeline-stage; or drop it from "
                             "--schedules")
        per = args.num_layers // (2 * p)
    spec: dict[str, Any] = {
        k: getattr(args, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
            "vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "pipeline_micro_batches", "steps", "warmup", "threads_per_rank", "dtype", "seed",
            "timeout", "plan", "shared_memory_comm")}
    counts = None
    if args.pipeline_stage_layers:
        try:
            counts = [int(x) for x in args.pipeline_stage_layers.split(",")]
        except ValueError:
            raise ValueError(f"--pipeline-stage-layers={args.pipeline_stage_layers!r} must be "
                             "comma-separated layer counts, e.g. 5,3") from None
    spec.update(kind="pipeline", model="gpt", schedules=schedules, layers_per_virtual_stage=per,
                stage_layers=counts,
                world_size=p * tp, ranks_per_host=tp, hosts=p, trace=args.out_dir is not None)
    build_config(spec).validate_parallel(tp)
    plan.check_fits(args.micro_batch_size, what=f"--plan {args.plan}",
                    batch_name="--micro-batch-size")
    layouts(spec)  # every schedule fits the layers and pipeline micro-batches
    spec["device"] = _resolve_device(args.device, p * tp)
    check_link(args, spec, hosts=p)
    return spec


def run_pipeline(args) -> dict[str, Any]:
    """``domino bench --pipeline-model-parallel-size P``: print the table, return the report."""
    import json
    import os

    from domino.bench.runner import execute

    spec = validate_pipeline(args)
    if args.out_dir is not None:
        os.makedirs(args.out_dir, exist_ok=True)
    raw = execute(spec)
    rows = results(raw, spec)
    link = spec.get("link", "loopback")
    config = {**{k: v for k, v in vars(args).items() if not k.startswith("_")},
              "schedules": spec["schedules"], "device": raw["device"], "link": link,
              "layers_per_virtual_stage": spec["layers_per_virtual_stage"]}
    report = {"config": config, "results": rows}
    if args.out_dir is not None:
        _render(raw, rows, args.out_dir, link, spec)
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(format_table(report), flush=True)
    return report


def _render(raw: dict[str, Any], rows: list[dict[str, Any]], out_dir: str, link: str,
            spec: dict[str, Any]) -> None:
    import os

    from domino.bench.timeline import render_png, to_chrome_trace

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
