"""The ranks' side of ``domino bench --data-parallel-size D``: data-parallel sharding strategies
side by side (started by ``worker.py``; the figures are ``data_parallel_report.py``'s).

Every strategy trains its own copy of the same GPT (the same seed, so the same weights), built
as ``domino train`` builds a run: :func:`domino.training.fsdp.shard` then
:func:`domino.training.step.train_step`, on synthetic tokens (step ``k`` of every strategy reads
the same global batch, each DP replica its rows). The strategies take turns step by step in
rounds (``domino.timing.time_rotated``: the order rotated each round, a barrier before each
step), so each runs with its parameter all-gathers waited for inside its own optimizer step
(``overlap_param_gather`` off): a gather left in flight would otherwise run in the next
strategy's step. Then each strategy's model state per rank (as held, and as
:func:`~domino.training.fsdp.implied_state` says) and its peak memory in one more step.
"""

from __future__ import annotations

from typing import Any

import torch

from domino.bench.memory import quiet_fd2
from domino.bench.spec import build_config, build_runtime
from domino.flops import rank_gemms, train_flops_per_step
from domino.gemm_rate import peak_flops
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState
from domino.plan import Plan
from domino.runtime import RuntimeConfig
from domino.timing import device_sync, time_rotated
from domino.training.arguments import TrainArgs
from domino.training.fsdp import ShardingPlan, implied_state
from domino.training.optim import build_sharded, model_state_bytes
from domino.training.step import StepOutcome, train_step
from domino.transformer.attention_paths import (
    AttentionShapes,
    attention_text,
    resolve_attention,
)

CPU_PEAK_METHOD = (
    "model state held at the step's start (model_state_bytes: weights, gradients, optimizer) "
    "plus the step's peak of tensors allocated above it (torch profiler memory events over one "
    "more train_step)")
CUDA_PEAK_METHOD = (
    "model state held at the step's start (model_state_bytes) plus the step's "
    "torch.cuda.max_memory_allocated() above memory_allocated() before it")


class _Strategy:
    """One strategy's model, sharding and optimizer; :meth:`step` runs the next train_step."""

    def __init__(self, name: str, spec: dict[str, Any], state: ParallelState,
                 runtime: RuntimeConfig, args: TrainArgs) -> None:
        self.name, self.state, self.args = name, state, args
        torch.manual_seed(spec["seed"])  # the same weights for every strategy
        state.rng.seed(spec["seed"])
        self.model = GPTModel(build_config(spec), parallel_state=state, runtime=runtime)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        plan = ShardingPlan(strategy=name, unit_layers=spec["fsdp_unit_layers"],
                            prefetch=spec["fsdp_prefetch"])
        built = build_sharded(self.model, self.params, state, plan, args,
                              overlap_param_gather=False)
        self.reducer, self.gathers, self.optimizer = built.reducer, built.gathers, built.optimizer
        self.outcomes: list[StepOutcome] = []

    def step(self, batches: list[dict[str, torch.Tensor]]) -> None:
        out = train_step(self.model, self.params, self.optimizer, None, batches, self.args,
                         self.state, reducer=self.reducer)
        self.outcomes.append(out)

    def implied(self, prefetch: int) -> dict[str, int]:
        return implied_state(self.name, self.model, self.params, self.optimizer, self.gathers,
                             prefetch)

    def held(self) -> dict[str, int]:
        return model_state_bytes(self.model, self.params, self.optimizer)


class _Data:
    """Synthetic tokens: the global batch of step ``k`` (the same for every strategy), this DP
    replica's rows of it, as one micro-batch."""

    def __init__(self, spec: dict[str, Any], state: ParallelState) -> None:
        self.spec, self.state = spec, state
        self.cache: dict[int, list[dict[str, torch.Tensor]]] = {}

    def __call__(self, k: int) -> list[dict[str, torch.Tensor]]:
        if k not in self.cache:
            spec, dp = self.spec, self.state.dp
            b, s = spec["micro_batch_size"], spec["seq_length"]
            gen = torch.Generator().manual_seed(spec["seed"] + 1 + k)
            ids = torch.randint(0, spec["vocab_size"], (dp.size * b, s + 1), generator=gen)
            ids = ids[dp.rank * b:(dp.rank + 1) * b]
            self.cache[k] = [{key: v.to(self.state.device) for key, v in {
                "tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(b, s),
                "position_ids": torch.arange(s).expand(b, s)}.items()}]
        return self.cache[k]


def _runtime(spec: dict[str, Any], state: ParallelState) -> RuntimeConfig:
    """How every strategy's GPT runs: the spec's plan, bf16 compute with ``--bf16``, the
    attention path measured (``--attention-backend auto``) as domino train does."""
    plan = Plan.parse(spec["plan"])
    runtime = build_runtime(spec, plan)
    if spec.get("bf16"):
        runtime = runtime.replace(compute_dtype=torch.bfloat16)
    config = build_config(spec)
    shapes = AttentionShapes.of_run(config, spec["micro_batch_size"], state.tp.size,
                                    plan.micro_batches, _compute_dtype(spec), state.device)
    return resolve_attention(runtime, shapes, state.world)


def _compute_dtype(spec: dict[str, Any]) -> torch.dtype:
    return torch.bfloat16 if spec.get("bf16") else torch.float32


def _step_peak(run: _Strategy, step) -> int:
    """Peak bytes allocated during ``step()`` above what was allocated at its start."""
    device = run.state.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:  # +bytes on allocation, -bytes on free: the running sum peaks with the step
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _memory(runs: list[_Strategy], data: _Data, prefetch: int) -> dict[str, dict[str, Any]]:
    """Per strategy: its model state per rank as held between steps and as implied, and its
    peak memory over one more step (held state + the step's peak above it)."""
    out = {}
    for run in runs:
        held = run.held()
        k = len(run.outcomes)
        step_peak = _step_peak(run, lambda r=run, k=k: r.step(data(k)))
        out[run.name] = {"held": held, "implied": run.implied(prefetch), "step_peak": step_peak,
                         "peak": sum(held.values()) + step_peak}
    return out


def _peak(spec: dict[str, Any], state: ParallelState) -> tuple[float | None, str]:
    """MFU's denominator: the rate one rank reaches on its GEMM shapes (CPU, timed by every
    rank at once), the device's peak (CUDA) or --peak-tflops."""
    config = build_config(spec)
    tokens = spec["micro_batch_size"] * spec["seq_length"]
    state.world.barrier()
    return peak_flops(state.device, _compute_dtype(spec),
                      rank_gemms(config, tokens, state.tp.size), spec.get("peak_tflops"))


def measure_data_parallel(spec: dict[str, Any], device: torch.device,
                          state: ParallelState) -> dict[str, Any] | None:
    """The worker's side: every rank trains and times every strategy; rank 0 returns the raw
    results (the others None)."""
    args = TrainArgs(seed=spec["seed"], bf16=bool(spec.get("bf16")))
    runtime = _runtime(spec, state)
    peak, peak_what = _peak(spec, state)
    runs = [_Strategy(name, spec, state, runtime, args) for name in spec["strategies"]]
    data = _Data(spec, state)
    rows = time_rotated(len(runs), lambda i: runs[i].step(data(len(runs[i].outcomes))),
                        spec["warmup"], spec["steps"], state.world, device)
    device_sync(device)
    memory = _memory(runs, data, spec["fsdp_prefetch"])
    measured = slice(spec["warmup"], spec["warmup"] + spec["steps"])
    mine = {"times": {r.name: t for r, t in zip(runs, rows, strict=True)},
            "exposed_dp": {r.name: [o.exposed_dp_s for o in r.outcomes[measured]] for r in runs},
            "memory": memory, "peak": peak, "dp": state.dp.rank, "tp": state.tp.rank}
    gathered = state.world.all_gather_json(mine)
    if state.world.rank != 0:
        return None
    config = build_config(spec)
    tokens = state.dp.size * spec["micro_batch_size"] * spec["seq_length"]
    peaks = [g["peak"] for g in gathered]
    return {"device": str(device), "ranks": gathered,
            # Every step's global loss and gradient norm (every rank agrees on them).
            "losses": {r.name: [o.loss for o in r.outcomes] for r in runs},
            "grad_norms": {r.name: [o.grad_norm for o in r.outcomes] for r in runs},
            "model_flops_per_step": train_flops_per_step(config, tokens, tp=state.tp.size),
            "peak_flops_per_s": None if None in peaks else sum(peaks) / len(peaks),
            "peak_what": peak_what, "attention": attention_text(runtime),
            "transports": state.transports(),
            "peak_method": CUDA_PEAK_METHOD if device.type == "cuda" else CPU_PEAK_METHOD}
