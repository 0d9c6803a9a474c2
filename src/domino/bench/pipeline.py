"""The ranks' side of ``domino bench --pipeline-model-parallel-size P``: pipeline schedules side by
side (started by ``worker.py``; the figures are ``pipeline_report.py``'s).

Each schedule runs the same GPT (the same weights: every part is drawn from its own seeded
stream) over the same pipeline micro-batches, interleaved round by round
(``domino.timing.time_rotated``). Every rank measures its step times, its busy time (its F, B and
W passes), the pipeline micro-batches it holds at most and its peak step memory; one traced step
per schedule becomes a timeline with a row per stage.
"""

from __future__ import annotations

from typing import Any

import torch

from domino.bench.figures import compile_figures
from domino.bench.hooks import BenchHook
from domino.bench.memory import quiet_fd2
from domino.bench.spec import build_config, build_runtime, layouts, with_attention
from domino.bench.timeline import Timeline
from domino.flops import rank_gemms, train_flops_per_step
from domino.gemm_rate import peak_flops
from domino.parallel_state import ParallelState
from domino.pipeline.model import PipelineModel
from domino.pipeline.runtime import PipelineRunner
from domino.plan import Plan
from domino.timing import device_sync, time_rotated
from domino.transformer.attention_paths import attention_text
from domino.transformer.stack import compile_cost


class PipelineBench:
    """A model and runner per layout, the step's pipeline micro-batches, one step per call."""

    def __init__(self, spec: dict[str, Any], state: ParallelState) -> None:
        self.spec, self.state = spec, state
        config = build_config(spec)
        self.layouts = layouts(spec)
        runtime = build_runtime(spec, Plan.parse(spec["plan"]))
        self.models: dict[tuple, PipelineModel] = {}
        self.runners: dict[str, PipelineRunner] = {}
        m, s, b = spec["pipeline_micro_batches"], spec["seq_length"], spec["micro_batch_size"]
        for schedule, layout in self.layouts.items():
            key = layout.bounds
            if key not in self.models:
                torch.manual_seed(spec["seed"])
                self.models[key] = PipelineModel(config, state, layout, runtime=runtime)
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


def _peak_memory(bench: PipelineBench, schedule: str) -> int:
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


def measure_pipeline(spec: dict[str, Any], device: torch.device,
                     state: ParallelState) -> dict[str, Any] | None:
    """The worker's side: every rank times, rank 0 returns the raw results."""
    spec = with_attention(spec, state)  # --attention-backend auto: measured, all ranks at once
    bench = PipelineBench(spec, state)
    config = build_config({**spec, "model": "gpt"})
    tokens = spec["micro_batch_size"] * spec["seq_length"]
    state.world.barrier()  # the ranks time their GEMM shapes together, as they run (CPU)
    peak, peak_what = peak_flops(device, config.params_dtype,
                                 rank_gemms(config, tokens, state.tp.size), spec.get("peak_tflops"))
    names = list(bench.runners)
    if spec.get("compile"):
        for name in names:  # each schedule's first step compiles its pieces: before timing
            bench.step(name)
    compiled = compile_cost(*bench.models.values())
    rows = time_rotated(len(names), lambda i: bench.step(names[i]), spec["warmup"],
                        spec["steps"], state.world, device)
    recompiled = compile_cost(*bench.models.values())[0] - compiled[0]  # 0 unless a new shape
    busy = {n: bench.busy[n][-spec["steps"]:] for n in names}  # the measured rounds
    with quiet_fd2():
        memory = {n: _peak_memory(bench, n) for n in names}
    traces = {n: bench.traced(n) for n in names} if spec["trace"] else {}
    mine = {"times": dict(zip(names, rows, strict=True)), "busy": busy, "memory": memory,
            "held": bench.held, "traces": traces, "stage": state.pp.rank, "tp": state.tp.rank,
            "peak": peak, "compile": compiled + [recompiled]}
    gathered = state.world.all_gather_json(mine)
    if state.world.rank != 0:
        return None
    peaks = [g["peak"] for g in gathered]
    return {"device": str(device), "ranks": gathered,
            "model_flops_per_step": train_flops_per_step(
                config, spec["pipeline_micro_batches"] * tokens, tp=state.tp.size),
            "peak_flops_per_s": None if None in peaks else sum(peaks) / len(peaks),
            "peak_what": peak_what,
            "attention": attention_text(build_runtime(spec), state.cp.size),
            **compile_figures(gathered),
            "layouts": {n: [list(b) for b in lay.bounds] for n, lay in bench.layouts.items()}}
