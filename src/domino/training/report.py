"""What a training run tells its user (rank 0 prints it): the start-up lines (model, parallel
layout, batching, FLOPs, data), what --compile compiled, the memory line, the summary at the
end, and the sample."""

from __future__ import annotations

import math
from pathlib import Path

from domino.data.packed import packing_text
from domino.inference.sampling import generate
from domino.memory import method as memory_method
from domino.parallel_dims import DIMS
from domino.parallel_state import ParallelState
from domino.pipeline.partition import Layout
from domino.plan import Plan
from domino.runtime import RuntimeConfig
from domino.safe_files import write_atomic
from domino.training.data import data_sources
from domino.training.logging import RunLogger
from domino.training.prepare import Run
from domino.training.step import TrainResult
from domino.transformer.attention_paths import attention_text
from domino.transformer.stack import compile_cost

# How the start-up line names the groups of ParallelState.transports().
_GROUP_NAMES = {"tp": "TP", "dp": "DP", "embedding": "tied-embedding sums",
                "ep": "EP all-to-alls"}
_ALWAYS_SHOWN = ("tp", "dp")  # the layout's other axes only when they have more than one rank


def layout_text(state: ParallelState) -> str:
    """The rank mesh as a product: ``TP=2 x PP=2 x DP=1`` (an axis of one rank left out)."""
    axes = [d.name for d in DIMS if d.mesh_axis is not None]
    sizes = {name: state.group(name).size for name in axes}
    return " x ".join(f"{name.upper()}={sizes[name]}" for name in axes
                      if sizes[name] > 1 or name in _ALWAYS_SHOWN)


def batching_text(run: Run, state: ParallelState, plan: Plan,
                  pipeline: tuple[str, Layout] | None) -> str:
    """How a global batch is cut: micro-batches x DP x accumulation (or pipeline micro-batches,
    ``pipeline``: the schedule and layout), and the split inside each micro-batch."""
    args, dp, tp = run.args, state.dp.size, state.tp.size
    accum = args.global_batch_size // (dp * args.micro_batch_size)
    split = ("each micro-batch runs unsplit (one TP rank)" if tp == 1 else
             f"Domino plan {plan} inside each micro-batch")
    if args.sequence_parallel:
        split += (", sequence parallel (1/TP of each sequence between TP regions)"
                  if tp > 1 else ", sequence parallel (no effect with one TP rank)")
    head = f"micro-batch {args.micro_batch_size} x DP {dp} x {accum}"
    if pipeline is not None:
        schedule, layout = pipeline
        return (f"{head} pipeline micro-batches | pipeline: {schedule}, {layout.describe()} | "
                f"{split}")
    return f"{head} accumulation step(s) | {split}"


def startup_lines(run: Run, state: ParallelState, parameters: int, batching: str,
                  flops_per_step: float, peak: float | None, peak_what: str,
                  runtime: RuntimeConfig | None = None) -> list[str]:
    """The lines a run starts with: model and layout, FLOPs and MFU's denominator, the
    attention's paths (``runtime``'s), data."""
    args = run.args
    transports = "".join(f" | {_GROUP_NAMES[k]} over {v}"
                         for k, v in state.transports().items() if v != "-")
    lines = [
        f"model: {parameters:,} parameters | {layout_text(state)} | global batch "
        f"{args.global_batch_size} x {args.seq_length} tokens = {batching} | "
        f"{len(run.train_ds):,} train samples | device {state.device}{transports}"]
    rate = "" if peak is None else f" ({peak / 1e12:.3g} TFLOP/s per rank)"
    lines.append(f"model FLOPs: {flops_per_step / 1e12:.4g} TFLOP per step (3 x forward: GEMMs, "
                 f"attention, LM head; docs/performance.md); MFU {peak_what}{rate}")
    if runtime is not None:
        lines.append(f"attention {attention_text(runtime, state.cp.size)}")
    sources = data_sources(args)
    if sources is not None:
        lines.append(f"data: {sources.describe()}")
    packing = packing_text(run.train_ds) if args.pack_documents else None
    if packing is not None:
        lines.append(packing)
    return lines


def state_line(strategy: str, implied: dict[str, int]) -> str:
    """The start-up line of the model state per rank the sharding strategy implies."""
    mib = {k: v / 2**20 for k, v in implied.items()}
    return (f"model state per rank implied by --data-parallel-sharding-strategy {strategy}: "
            f"{sum(mib.values()):.1f} MiB (weights {mib['weights']:.1f} + gradients "
            f"{mib['grads']:.1f} + optimizer {mib['optimizer']:.1f}; docs/data-parallel.md)")


class CompileReport:
    """--compile: what each kind of call ("training" or "evaluation") compiled. Each kind
    compiles in its first call (the evaluation's no-grad variants apart); any later compile (a
    new shape) is reported as a recompile."""

    def __init__(self, log: RunLogger) -> None:
        self.log = log
        self.done = [0, 0.0]  # forward graphs, seconds so far
        self.kinds: set[str] = set()  # the kinds that compiled

    def after(self, step: int, model, result: TrainResult, kind: str) -> None:
        """Report what ``step``'s ``kind`` compiled (into ``result`` and the log)."""
        done, self.done = self.done, compile_cost(model)
        graphs, seconds = self.done[0] - done[0], self.done[1] - done[1]
        if not graphs:
            return
        what = "recompiled (a new shape)" if kind in self.kinds else "compiled"
        self.kinds.add(kind)
        result.compiled.append((step, kind, graphs, seconds))
        where = ("; their backward graphs compile in the first backward; all in the step's "
                 "time" if kind == "training" else "; not in the step's time")
        self.log.print(f"--compile: step {step} {kind} {what} {graphs} forward graphs in "
                       f"{seconds:.1f} s (rank 0's pieces{where})")


def memory_line(device, peaks: list[int], states: list[int], sharded: bool,
                models: list[dict] | None = None) -> str:
    """Peak memory, optimizer state and (``models``: ``optim.model_state_bytes`` per rank)
    model state per rank (MiB)."""
    line = (f"peak memory per rank ({memory_method(device)}): "
            + ", ".join(f"{p / 2**20:.0f}" for p in peaks) + " MiB; optimizer state per rank: "
            + ", ".join(f"{b / 2**20:.1f}" for b in states) + " MiB"
            + (" (sharded over DP)" if sharded else ""))
    if models:
        line += "; model state per rank (weights + gradients + optimizer): " + ", ".join(
            f"{sum(m.values()) / 2**20:.1f} ({m['weights'] / 2**20:.1f} + "
            f"{m['grads'] / 2**20:.1f} + {m['optimizer'] / 2**20:.1f})" for m in models) + " MiB"
    return line


def summary(log: RunLogger, result: TrainResult, run_dir: Path) -> None:
    """The end-of-run summary (and the loss plot)."""
    plot = log.plot()
    lines = ["", "=== summary ==="]
    if result.losses:
        k = min(10, len(result.losses))
        lines.append(f"loss: first {result.losses[0]:.4f} -> last {result.losses[-1]:.4f} "
                     f"(mean of last {k}: {sum(result.losses[-k:]) / k:.4f})")
    if result.val_losses:
        step, val = result.val_losses[-1]
        lines.append(f"validation at step {step}: loss {val:.4f}, perplexity "
                     f"{math.exp(min(val, 50.0)):.3f}")
    if result.skipped:
        lines.append(f"skipped steps (overflow): {result.skipped}")
    lines.append(f"wall time (this rank, after start-up): {result.wall_s:.1f} s")
    lines.append(f"run folder: {run_dir}" + (f"  (loss curve: {plot.name})" if plot else ""))
    log.print("\n".join(lines))


def sample(model, state: ParallelState, run: Run, log: RunLogger, run_dir: Path) -> str:
    """Generate from the trained model (DP rank 0's TP and EP groups); rank 0 prints it and
    writes sample.txt."""
    args, config, tokenizer = run.args, run.config, run.tokenizer
    prompt = tokenizer.encode(args.sample_prompt) or [tokenizer.eod]
    learned = config.position_embedding_type == "learned_absolute"
    max_context = config.max_position_embeddings if learned else config.seq_length
    ids = generate(model, state, prompt, args.sample_tokens, tokenizer.vocab_size, max_context,
                   args.top_k, args.temperature, args.seed, banned=tokenizer.stop_ids)
    text = args.sample_prompt + tokenizer.decode(ids)
    if log.active:
        kind = "greedy" if args.top_k == 1 else f"top-k {args.top_k}, T={args.temperature}"
        log.print(f"\n--- sample ({len(ids)} tokens, {kind}, KV cache) ---\n{text}\n---")
        write_atomic(run_dir / "sample.txt", text)
    return text
