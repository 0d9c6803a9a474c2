"""One benchmark rank: ``python -m domino.bench.worker SPEC.json`` (started by ``execute.py``).

Every rank builds the same model from the same seed, then times one fwd+bwd step per mode per
round (``domino.timing.time_rotated``: mode order rotated each round, a barrier before each
step), measures each mode's peak memory in one extra step, and traces one more step per traced
mode. Rank 0 writes the raw measurements (step times already reduced to the max over ranks) to
``spec["result_path"]``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from domino.bench.figures import compile_figures
from domino.bench.hooks import BenchHook, SimulatedLink
from domino.bench.memory import quiet_fd2
from domino.bench.modes import Mode, parse_mode
from domino.bench.probe import probe_allreduce, probe_exchange
from domino.bench.spec import build_config, build_runtime, compiled_runtime, with_attention
from domino.bench.timeline import Timeline
from domino.context_parallel import shard_sequence
from domino.distributed import init_distributed, shutdown_distributed
from domino.enums import AttnMaskType
from domino.flops import rank_gemms, train_flops_per_step
from domino.gemm_rate import peak_flops
from domino.host_memory import keep_freed_memory
from domino.memory import peak_bytes, reset_peak
from domino.parallel_state import ParallelState
from domino.timing import time_rotated
from domino.transformer import DominoTransformer
from domino.transformer.attention_paths import attention_text
from domino.transformer.stack import compile_cost, stacks_of, using_plan, using_runtime

__all__ = ["main", "measure"]

CPU_MEMORY_METHOD = (
    "CPU: torch profiler memory events (profile_memory=True) over one extra fwd+bwd step with "
    "gradients freed beforehand; peak_mem_bytes = peak bytes of tensors allocated in the step and "
    "alive at once (activations, gradients, temporaries, comm buffers), excluding the weights and "
    "inputs that live across steps. peak_rss_bytes = the process's VmHWM during that step after "
    "resetting it via /proc/self/clear_refs (whole process, includes allocator caching)."
)
CUDA_MEMORY_METHOD = (
    "CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() before one extra fwd+bwd "
    "step with gradients freed beforehand (weights and inputs excluded)."
)


class _Bench:
    """The model (and, for ``:compiled`` modes, its compiled twin with the same weights), its
    fixed inputs and a one-step function that runs any mode."""

    def __init__(self, spec: dict[str, Any], state: ParallelState,
                 compiled: bool = False) -> None:
        self.spec, self.state = spec, state
        self.models: dict[bool, torch.nn.Module] = {}
        self._losses: dict[bool, Callable[[], torch.Tensor]] = {}
        for twin in (False, True) if compiled else (False,):
            self.models[twin], self._losses[twin] = self._build(
                compiled_runtime(spec) if twin else build_runtime(spec))
        self.link: SimulatedLink | None = None
        if spec.get("simulate_link"):
            from domino.netem import rate_bits_per_s

            self.link = SimulatedLink(rate_bits_per_s(spec["simulate_link"]))
        # The rank's one link: TP's and the experts' transfers queue on it.
        for g in self._linked():
            g.hook = BenchHook(link=self.link) if self.link is not None else None
        self.param_bytes = sum(p.numel() * p.element_size()
                               for p in self.models[False].parameters())

    def _linked(self) -> list:
        """The groups whose transfers a simulated link times: TP's, and EP's where it is one."""
        return [self.state.tp, *([self.state.ep] if self.state.ep.size > 1 else [])]

    def _build(self, runtime) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
        spec, state = self.spec, self.state
        config = build_config(spec)
        s, b, h = spec["seq_length"], spec["micro_batch_size"], spec["hidden_size"]
        device, dtype = state.device, config.params_dtype
        torch.manual_seed(spec["seed"])  # the same weights for every model built
        state.rng.seed(spec["seed"])
        # Inputs come from their own generator so every TP rank draws identical (replicated)
        # data; data-parallel ranks (expert parallelism) draw their own.
        gen = torch.Generator().manual_seed(spec["seed"] + 1 + 1000 * state.dp.rank)
        if spec["model"] in ("stack", "moe"):
            kind = DominoTransformer if spec["model"] == "stack" else _MoEBlocks
            stack = kind(config, state, self_attn_mask_type=AttnMaskType.causal, runtime=runtime)
            x = torch.randn(s, b, h, generator=gen).to(device, dtype)  # [s, b, h]
            w = torch.randn(s, b, h, generator=gen).to(device, dtype)
            x, w = _cp_shard(x, state, 0), _cp_shard(w, state, 0)  # this CP rank's chunks

            def loss() -> torch.Tensor:
                if stack.sequence_parallel_active():  # the stack takes this rank's shard
                    return (stack(state.tp.seq_shard(x), None)
                            * state.tp.seq_shard(w)).float().sum()
                return (stack(x, None) * w).float().sum()

            return stack, loss
        from domino.models.gpt import GPTModel

        gpt = GPTModel(config, parallel_state=state, runtime=runtime)
        ids = torch.randint(0, spec["vocab_size"], (b, s + 1), generator=gen).to(device)
        tokens, labels = ids[:, :-1], ids[:, 1:]  # [b, s]
        pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
        tokens, labels, pos = (_cp_shard(t, state, 1) for t in (tokens, labels, pos))
        return gpt, lambda: gpt(tokens, pos, None, labels=labels).float().mean()

    def zero_grad(self) -> None:
        """Free every model's gradients."""
        for model in self.models.values():
            model.zero_grad(set_to_none=True)

    def step(self, mode: Mode) -> None:
        """Zero grads, forward, backward under ``mode``."""
        if self.link is not None:
            self.link.free_at = 0.0  # each step starts on an idle link
        comm = contextlib.ExitStack()
        if not mode.comm:  # every collective of the step: TP's, the experts', the CP ring's
            comm.enter_context(self.state.tp.disabled())
            comm.enter_context(self.state.ep.disabled())
            comm.enter_context(self.state.cp.disabled())
        model = self.models[mode.compiled]
        if self.state.cp.size > 1:  # sync waits for each ring transfer; Domino overlaps it
            comm.enter_context(_ring_overlap(model, mode.is_domino))
        with using_plan(model, mode.plan), comm, \
                using_runtime(model, sequence_parallel=mode.sequence_parallel):
            model.zero_grad(set_to_none=True)
            self._losses[mode.compiled]().backward()

    def traced_step(self, mode: Mode, rank: int) -> dict[str, Any]:
        """One step of ``mode`` recorded on a timeline (as a dict)."""
        tl = Timeline(rank)
        state = self.state
        groups = [state.tp, *_exchange_groups(state)]  # TP, EP, CP
        linked = self._linked()
        before = [g.hook for g in groups]
        for g in groups:
            timed = any(g is other for other in linked)  # (the groups, not equal ones)
            g.hook = BenchHook(timeline=tl, link=self.link if timed else None)
        try:
            state.world.barrier()  # every rank starts the traced step together
            self.step(mode)
        finally:
            for g, hook in zip(groups, before, strict=True):
                g.hook = hook
        return tl.to_dict()


@contextlib.contextmanager
def _ring_overlap(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """The enclosed code with ``model``'s ring context parallelism overlapping its transfers
    (``on``) or waiting for each first (the sync baseline); as before afterwards."""
    stacks = stacks_of(model)
    saved = [s.ring_overlap for s in stacks]
    try:
        for s in stacks:
            s.set_ring_overlap(on)
        yield
    finally:
        for s, before in zip(stacks, saved, strict=True):
            s.set_ring_overlap(before)


class _MoEBlocks(DominoTransformer):
    """``--model moe``: the stack's MoE MLP blocks only (norm, MoE layer, residual), the unit
    Megatron's MoELayer is (its attention weights exist but never run)."""

    def blocks(self):
        return [b for b in super().blocks() if b.kind == "mlp"]


def _time_modes(bench: _Bench, modes: list[Mode], warmup: int, steps: int
                ) -> tuple[dict[str, list], dict[str, list]]:
    """Per mode, this rank's time of each measured round, and the CPU time its process spent
    in that step (``time.process_time``: every thread's, with the kernel work charged to the
    process): what a mode's communication costs the host's CPUs, hidden or not."""
    cpu: list[list[float]] = [[] for _ in modes]

    def step(i: int) -> None:
        start = time.process_time()
        bench.step(modes[i])
        cpu[i].append(time.process_time() - start)
    rows = time_rotated(len(modes), step, warmup, steps, bench.state.world, bench.state.device)
    # (each mode runs once per round: its first ``warmup`` steps are the warm-up rounds')
    return ({m.name: row for m, row in zip(modes, rows, strict=True)},
            {m.name: c[warmup:] for m, c in zip(modes, cpu, strict=True)})


def _sent(state: ParallelState) -> int:
    """Bytes this rank's step collectives sent: TP's, the experts' (EP) all-to-alls and the
    context-parallel (CP) attention's transfers."""
    return state.tp.stats.bytes + _exchanged(state)


def _exchanged(state: ParallelState) -> int:
    """Of those, the bytes sent in exchanges (EP's all-to-alls, CP's transfers) rather than
    TP's all-reduces and their kin."""
    return sum(g.stats.bytes for g in _exchange_groups(state))


def _exchange_groups(state: ParallelState) -> list:
    return [g for g in (state.ep, state.cp) if g.size > 1]


def _reset_sent(state: ParallelState) -> None:
    for group in (state.tp, state.ep, state.cp):
        group.stats.reset()


def _measure_memory(bench: _Bench, modes: list[Mode]) -> dict[str, dict[str, int | None]]:
    """Per mode, this rank's peak step memory (see CPU/CUDA_MEMORY_METHOD)."""
    device = bench.state.device
    out: dict[str, dict[str, int | None]] = {}
    if device.type == "cuda":
        for mode in modes:
            bench.zero_grad()
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            _reset_sent(bench.state)
            bench.step(mode)
            torch.cuda.synchronize(device)
            out[mode.name] = {"peak_bytes": torch.cuda.max_memory_allocated(device) - base,
                              "peak_rss_bytes": None,
                              "allreduce_bytes": _sent(bench.state) if mode.comm else 0,
                              "exchange_bytes": _exchanged(bench.state) if mode.comm else 0}
        return out
    from torch.profiler import ProfilerActivity, profile, record_function

    rss: dict[str, int | None] = {}
    sent: dict[str, int] = {}
    exchanged: dict[str, int] = {}
    # One profiler session for all modes (starting one costs about a second); each mode's step
    # is a labelled range whose memory events are summed separately.
    with quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for mode in modes:
            # Free the gradients outside the range: frees of memory allocated before a range
            # would otherwise offset its allocations (every model's: a twin's must not stay).
            bench.zero_grad()
            gc.collect()
            hwm_ok = reset_peak(torch.device("cpu"))
            _reset_sent(bench.state)
            with record_function(f"domino-bench-mem:{mode.name}"):
                bench.step(mode)
            sent[mode.name] = _sent(bench.state) if mode.comm else 0
            exchanged[mode.name] = _exchanged(bench.state) if mode.comm else 0
            rss[mode.name] = peak_bytes(torch.device("cpu")) if hwm_ok else None
    events = list(prof.profiler.kineto_results.events())
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    for mode in modes:
        rng = next(e for e in events if e.name() == f"domino-bench-mem:{mode.name}")
        t0, t1 = rng.start_ns(), rng.start_ns() + rng.duration_ns()
        # Memory events carry +bytes on allocation and -bytes on free: the running sum over
        # the range peaks at the step's peak.
        cur = peak = 0
        for e in mem:
            if t0 <= e.start_ns() <= t1:
                cur += e.nbytes()
                peak = max(peak, cur)
        out[mode.name] = {"peak_bytes": peak, "peak_rss_bytes": rss[mode.name],
                          "allreduce_bytes": sent[mode.name],
                          "exchange_bytes": exchanged[mode.name]}
    return out


def measure(spec: dict[str, Any], device: torch.device,
            state: ParallelState) -> dict[str, Any] | None:
    """Run the whole measurement on this rank; rank 0 returns the raw results."""
    modes = [parse_mode(name) for name in spec["modes"]]
    spec = with_attention(spec, state)  # --attention-backend auto: measured, all ranks at once
    bench = _Bench(spec, state, compiled=any(m.compiled for m in modes))
    config = build_config(spec)
    tokens = spec["micro_batch_size"] * spec["seq_length"]  # per TP group
    state.world.barrier()  # the ranks time their GEMM shapes together, as they run (CPU)
    peak, peak_what = peak_flops(device, config.params_dtype,
                                 rank_gemms(config, tokens, state.tp.size),
                                 spec.get("peak_tflops"))
    allreduce = probe_allreduce(state.tp)
    # The exchanges' probe on the EP (else CP) group: where both are > 1 their ranks differ,
    # the cost per byte does not.
    groups = _exchange_groups(state)
    exchange = probe_exchange(groups[0]) if groups else None
    if len(bench.models) > 1 or spec.get("compile"):
        for mode in modes:  # each mode's first step compiles its pieces: before any timing
            bench.step(mode)
    compiled = compile_cost(*bench.models.values())
    times, cpu = _time_modes(bench, modes, spec["warmup"], spec["steps"])
    recompiled = compile_cost(*bench.models.values())[0] - compiled[0]  # 0 unless a new shape
    memory = _measure_memory(bench, modes)
    traces: dict[str, dict[str, Any]] = {}
    if spec["trace"]:
        for mode in modes:
            if mode.comm:  # comm-free runs have nothing to overlap: not worth a picture
                traces[mode.name] = bench.traced_step(mode, state.world.rank)
    mine = {"times": times, "cpu": cpu, "memory": memory, "traces": traces,
            "param_bytes": bench.param_bytes, "peak": peak, "compile": compiled + [recompiled]}
    gathered = state.world.all_gather_json(mine)
    if state.world.rank != 0:
        return None
    names = [m.name for m in modes]
    return {
        "device": str(device),
        # What a step's model FLOPs are (all TP ranks), and the per-rank peak MFU is taken
        # against (the ranks' mean where each measured its own).
        "model_flops_per_step": state.dp.size * train_flops_per_step(
            config, tokens, tp=state.tp.size, head=spec["model"] == "gpt",
            attention=spec["model"] != "moe"),
        "peak_flops_per_s": (None if any(g["peak"] is None for g in gathered)
                             else sum(g["peak"] for g in gathered) / len(gathered)),
        "peak_what": peak_what,
        "attention": (None if spec["model"] == "moe"  # (its attention never runs)
                      else attention_text(build_runtime(spec), state.cp.size)),
        **compile_figures(gathered),
        "transports": state.transports(),
        "allreduce_8mib_s": None if allreduce is None else allreduce["seconds"],
        "allreduce_8mib_cpu_s": None if allreduce is None else allreduce["cpu_s"],
        "exchange_8mib_s": None if exchange is None else exchange["seconds"],
        "exchange_8mib_cpu_s": None if exchange is None else exchange["cpu_s"],
        "allreduce_bytes_per_step": {n: gathered[0]["memory"][n]["allreduce_bytes"] for n in names},
        "exchange_bytes_per_step": {n: gathered[0]["memory"][n]["exchange_bytes"] for n in names},
        "memory_method": CUDA_MEMORY_METHOD if device.type == "cuda" else CPU_MEMORY_METHOD,
        "param_bytes": [g["param_bytes"] for g in gathered],
        # The step time of a round is its slowest rank's: the TP group moves at that pace.
        "step_times_s": {n: [max(vals) for vals in zip(*(g["times"][n] for g in gathered),
                                                       strict=True)]
                         for n in names},
        "per_rank_step_times_s": {n: [g["times"][n] for g in gathered] for n in names},
        "per_rank_step_cpu_s": {n: [g["cpu"][n] for g in gathered] for n in names},
        "peak_bytes": {n: [g["memory"][n]["peak_bytes"] for g in gathered] for n in names},
        "peak_rss_bytes": {n: [g["memory"][n]["peak_rss_bytes"] for g in gathered] for n in names},
        "traces": {n: [g["traces"][n] for g in gathered] for n in traces},
    }


def _cp_shard(x: torch.Tensor, state: ParallelState, dim: int) -> torch.Tensor:
    """This CP rank's head and tail chunks of ``x`` along its sequence dim ``dim``."""
    cp = state.cp
    return x if cp.size == 1 else shard_sequence(x, cp.rank, cp.size, dim).contiguous()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m domino.bench.worker SPEC.json (started by domino bench)",
              file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads_per_rank"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    init_distributed(device, timeout_s=spec["timeout"])
    kept = device.type == "cpu" and keep_freed_memory()
    state = None
    try:
        state = ParallelState.build(spec["tensor_model_parallel_size"],
                                    spec.get("pipeline_model_parallel_size", 1), device=device,
                                    shared_memory=spec.get("shared_memory_comm", True),
                                    expert_model_parallel_size=spec.get(
                                        "expert_model_parallel_size", 1),
                                    context_parallel_size=spec.get("context_parallel_size", 1))
        if spec.get("kind") == "pipeline":
            from domino.bench.pipeline import measure_pipeline

            raw = measure_pipeline(spec, device, state)
        elif spec.get("kind") == "data_parallel":
            from domino.bench.data_parallel import measure_data_parallel

            raw = measure_data_parallel(spec, device, state)
        else:
            raw = measure(spec, device, state)
        if raw is not None:
            raw["host_malloc"] = "freed memory kept" if kept else "default"
        state.close()  # its transports' threads stop before the process group goes
        if raw is not None:
            tmp = spec["result_path"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump(raw, f)
            os.replace(tmp, spec["result_path"])
    except BaseException:
        if state is not None:
            state.close(wait=False)  # a transport thread may be waiting on a dead peer
        raise
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
