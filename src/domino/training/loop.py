"""The training run of one rank: set-up and resume, the step loop with evaluation, logging and
checkpoints, and the finish (final checkpoint, summary, sample).

Ranks agree on every decision that changes what they do next (skip a step, stop on a signal,
save on the clock, stop on a diverged loss) in one small collective per step, so they never
disagree and hang.
"""

from __future__ import annotations

import json
import math
import signal
import statistics
import time
from pathlib import Path

import torch

import domino
from domino.checkpoint import Meta, load_model, load_optimizer, load_rng, save
from domino.flops import rank_gemms, train_flops_per_step, utilisation
from domino.gemm_rate import peak_flops
from domino.inference.sampling import generate
from domino.memory import method as memory_method
from domino.memory import peak_bytes
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState
from domino.pipeline.model import PipelineModel
from domino.pipeline.runtime import PipelineRunner
from domino.plan import SYNC, Plan
from domino.safe_files import write_atomic
from domino.tensor_parallel import placement_of
from domino.training.data import data_sources, state_batches
from domino.training.dist_optim import DistributedAdamW
from domino.training.grad_sync import make_reducer
from domino.training.logging import RunLogger
from domino.training.optim import (
    DynamicLossScaler,
    agree,
    build_optimizer,
    learning_rate,
    optimizer_state_bytes,
    set_lr,
)
from domino.training.prepare import Run
from domino.training.progress import Progress, StopRequest
from domino.training.step import TrainResult, evaluate, forward_loss, train_step
from domino.transformer.autotune import autotune, candidate_plans, moe_groups, regime_of
from domino.transformer.stack import compile_cost, set_plan, stacks_of


class TrainingDiverged(RuntimeError):
    """The loss or the gradients stayed NaN/inf for ``--max-nonfinite-steps`` steps."""


class Trainer:
    """One rank's run: set-up in the constructor (model, optimiser, resume, logger), then
    :meth:`fit` (the step loop, with evaluation and checkpoints) and :meth:`finish` (final
    checkpoint, summary, sample). The process group is initialised."""

    def __init__(self, run: Run, state: ParallelState | None = None,
                 stop: StopRequest | None = None, progress: Progress | None = None) -> None:
        self.wall0 = time.perf_counter()
        args = run.args
        assert run.run_dir is not None, "the run folder is known before training starts"
        self.run, self.args, self.run_dir = run, args, Path(run.run_dir)
        self.stop = stop if stop is not None else StopRequest()
        self.progress = progress if progress is not None else Progress()
        self.state = state if state is not None else ParallelState.build(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            device=args.device, shared_memory=args.shared_memory_comm,
            expert_model_parallel_size=args.expert_model_parallel_size,
            context_parallel_size=args.context_parallel_size)
        dp, tp, pp = self.state.dp, self.state.tp, self.state.pp
        torch.manual_seed(args.seed)  # same on every rank: TP-invariant init, equal DP replicas
        self.state.rng.seed(args.seed)
        self.runner = None
        if pp.size > 1:
            layout = args.pipeline_layout()
            self.model: torch.nn.Module = PipelineModel(run.config, self.state, layout,
                                                        runtime=run.runtime)
            self.pipeline_micro_batches = args.global_batch_size // (
                args.micro_batch_size * dp.size)
            self.runner = PipelineRunner(self.model, args.schedule(),
                                         self.pipeline_micro_batches, args.seq_length,
                                         args.micro_batch_size)
        else:
            self.model = GPTModel(run.config, parallel_state=self.state, runtime=run.runtime)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The gradient reduction, overlapped or not (make_reducer decides); ZeRO-1 with DP > 1.
        self.reducer = make_reducer(self.model, self.params, self.state,
                                    distributed_optimizer=args.use_distributed_optimizer,
                                    overlap=args.overlap_grad_reduce, runner=self.runner,
                                    reduce_dtype=args.grad_reduce_dtype())
        zero = self.reducer is not None and self.reducer.shard
        self.optimizer = (DistributedAdamW(self.reducer, args.lr, (args.adam_beta1,
                                                                   args.adam_beta2),
                                           args.adam_eps, args.weight_decay,
                                           args.overlap_param_gather and self.runner is None)
                          if zero else build_optimizer(self.model, args))
        if zero and self.optimizer.overlap_param_gather:
            self.optimizer.attach(self.model)
        self.scaler = (DynamicLossScaler(args.initial_loss_scale, args.loss_scale_window)
                       if args.fp16 else None)
        self.rank0 = self.state.world.rank == 0
        self.start, self.consumed = 0, 0
        notes = self._resume() if run.resume is not None else []
        self.log = RunLogger(self.run_dir, args.train_iters, self.start, self.rank0,
                             args.tensorboard)
        self.last_saved = self.start if run.resume is not None and self.start else None
        self.last_save_t = time.monotonic()
        self.bad_since: int | None = None  # first step of the current NaN/inf streak
        self.compiled = [0, 0.0]  # --compile: forward graphs, seconds so far
        self.compiled_kinds: set[str] = set()  # ... and of what ("training", "evaluation")
        count = torch.tensor([float(sum(
            p.numel() * (self.state.group(pl.shard).size if pl.shard else 1)
            for p in self.params if not (pl := placement_of(p)).tied_copy))],
            device=self.state.device)
        pp.all_reduce(count, name="parameter count")
        # MFU: the model FLOPs of a step (all ranks) over the peak one rank can reach; on CPU the
        # ranks time their GEMM shapes together, as they will run (cached per machine).
        self.flops_per_step = train_flops_per_step(
            run.config, args.global_batch_size * args.seq_length, tp=tp.size)
        compute = args.compute_dtype() or run.config.params_dtype
        self.state.world.barrier()
        self.peak, self.peak_what = peak_flops(
            self.state.device, compute,
            rank_gemms(run.config, args.micro_batch_size * args.seq_length // self.state.cp.size,
                       tp.size),
            args.peak_tflops)
        if self.rank0:
            for note in notes:
                self.log.print(note)
            accum = args.global_batch_size // (dp.size * args.micro_batch_size)
            split = ("each micro-batch runs unsplit (one TP rank)" if tp.size == 1 else
                     f"Domino plan {self.plan} inside each micro-batch")
            if args.sequence_parallel:
                split += (", sequence parallel (1/TP of each sequence between TP regions)"
                          if tp.size > 1 else ", sequence parallel (no effect with one TP rank)")
            if self.runner is not None:
                batching = (f"micro-batch {args.micro_batch_size} x DP {dp.size} x {accum} "
                            f"pipeline micro-batches | pipeline: {args.schedule()}, "
                            f"{self.model.layout.describe()} | {split}")
            else:
                batching = (f"micro-batch {args.micro_batch_size} x DP {dp.size} x {accum} "
                            f"accumulation step(s) | {split}")
            self.log.print(
                f"model: {int(count.item()):,} parameters | TP={tp.size} x "
                + (f"PP={pp.size} x " if pp.size > 1 else "") + (f"CP={self.state.cp.size} x " if self.state.cp.size > 1 else "") + f"DP={dp.size} | global batch {args.global_batch_size} x {args.seq_length} "
                f"tokens = {batching} | {len(run.train_ds):,} train samples | device "
                f"{self.state.device}" + "".join(
                    f" | {_GROUP_NAMES[k]} over {v}"
                    for k, v in self.state.transports().items() if v != "-"))
            peak = "" if self.peak is None else f" ({self.peak / 1e12:.3g} TFLOP/s per rank)"
            self.log.print(f"model FLOPs: {self.flops_per_step / 1e12:.4g} TFLOP per step "
                           f"(3 x forward: GEMMs, attention, LM head; docs/performance.md); "
                           f"MFU {self.peak_what}{peak}")
            sources = data_sources(args)
            if sources is not None:
                self.log.print(f"data: {sources.describe()}")

    @property
    def plan(self) -> Plan:
        return stacks_of(self.model)[0].plan

    def _resume(self) -> list[str]:
        resume = self.run.resume
        assert resume is not None
        load_model(resume.step_dir, resume.meta, self.model, self.state, self.optimizer)
        if resume.weights_only:
            return [f"initialised from the weights of {resume.step_dir} (no optimizer state): a "
                    "new run from step 0"]
        load_optimizer(resume.step_dir, resume.meta, self.optimizer, self.model, self.state)
        load_rng(resume.step_dir, resume.meta, self.state)
        if self.scaler is not None and resume.meta.scaler:
            self.scaler.load_state_dict(resume.meta.scaler)
        self.start, self.consumed = resume.start_step, resume.consumed
        same = resume.meta.layout["tp"] == self.state.tp.size
        return [f"resumed from {resume.step_dir} (step {self.start}, saved at TP="
                f"{resume.meta.layout['tp']} x DP={resume.meta.layout['dp']}"
                + ("" if same else "; resharded, TP-distinct dropout streams restart") + ")"]

    # -- the step loop ------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train from the resumed step to ``--train-iters`` (or ``--exit-interval``, or a
        SIGTERM / Ctrl-C, which checkpoint at the step boundary)."""
        args, run = self.args, self.run
        if args.domino_autotune and self.start < args.train_iters:
            self._choose_plan()
        result = TrainResult()
        g, s = args.global_batch_size, args.seq_length
        window: dict[str, float] = {}
        for step in range(self.start + 1, args.train_iters + 1):
            t0 = time.perf_counter()
            self.progress.at(step, "training step")
            set_lr(self.optimizer, lr := learning_rate(step, args))
            dp = self.state.dp_cp  # the gradient reduction's group (its exposed time)
            batches = state_batches(run.train_ds, self.consumed, g, args.micro_batch_size,
                                    self.state)
            clock_due = bool(args.save_interval_minutes
                             and time.monotonic() - self.last_save_t
                             >= args.save_interval_minutes * 60)
            out = train_step(self.model, self.params, self.optimizer, self.scaler, batches, args,
                             self.state, requests=(self.stop.signum is not None, clock_due),
                             runner=self.runner, reducer=self.reducer)
            stop_requested, save_due = out.requests
            self.consumed += g
            result.skipped += out.skipped
            step_time = time.perf_counter() - t0
            result.losses.append(out.loss)
            result.grad_norms.append(out.grad_norm)
            self.log.step(step, out.loss)
            self._compile_report(step, result, "training")
            for key, value in (("loss", out.loss), ("time", step_time),
                               ("comm", out.exposed_comm_s), ("pipe", out.pipeline_wait_s),
                               ("dp", out.exposed_dp_s), ("n", 1.0)):
                window[key] = window.get(key, 0.0) + value
            bad = not math.isfinite(out.loss) or (out.skipped and (
                self.scaler is None or self.scaler.scale <= self.scaler.min_scale))
            self.bad_since = (self.bad_since or step) if bad else None
            bad_since = self.bad_since
            if bad_since is not None and args.max_nonfinite_steps \
                    and step - bad_since + 1 >= args.max_nonfinite_steps:
                self.log.close()
                raise TrainingDiverged(
                    f"the loss or the gradients were NaN/inf for {step - bad_since + 1} "
                    f"consecutive steps ({bad_since}-{step}); stopped without saving (the last "
                    f"checkpoint, {self._last_checkpoint()}, is untouched). Lower --lr, check "
                    "the data, or raise --max-nonfinite-steps")
            rec: dict[str, float | int] = {}
            exit_now = bool(args.exit_interval and step % args.exit_interval == 0)
            last = exit_now or step == args.train_iters
            if run.valid_ds is not None and not stop_requested and (
                    (args.eval_interval and step % args.eval_interval == 0) or last):
                self.progress.at(step, "evaluation")
                val, _ = evaluate(self.model, run.valid_ds, args, self.state)
                result.val_losses.append((step, val))
                rec.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)))
                self._compile_report(step, result, "evaluation")
            if rec or last or stop_requested or step % args.log_interval == 0:
                n = window["n"]
                rec = {"step": step, "loss": window["loss"] / n, "lr": lr,
                       "grad_norm": out.grad_norm, "tokens_per_s": g * s * n / window["time"],
                       "step_time_s": window["time"] / n, "exposed_comm_s": window["comm"] / n,
                       "skipped": result.skipped, **out.moe, **rec}
                per_rank, mfu = utilisation(self.flops_per_step, self.state.world.size,
                                            rec["step_time_s"], self.peak)
                rec["model_tflops_per_rank"] = per_rank / 1e12
                if mfu is not None:
                    rec["mfu"] = mfu
                if self.scaler is not None:
                    rec["loss_scale"] = self.scaler.scale
                if self.runner is not None:
                    rec["pipeline_wait_s"] = window["pipe"] / n
                if dp.size > 1:
                    rec["exposed_dp_comm_s"] = window["dp"] / n
                peak = peak_bytes(self.state.device)
                if peak is not None:
                    rec["peak_mem_bytes"] = peak  # this rank's (rank 0 writes the log)
                self.log.record(rec)
                window = {}
            if stop_requested:
                self.save(step)
                result.stopped_at = step
                break
            if exit_now:
                break
            if not last and ((args.save_interval and step % args.save_interval == 0)
                             or save_due):
                self.save(step)
        return result

    def _compile_report(self, step: int, result: TrainResult, kind: str) -> None:
        """--compile: what the step's ``kind`` ("training" or "evaluation") compiled. Each kind
        compiles in its first call (the evaluation's no-grad variants apart); any later compile
        (a new shape) is reported as a recompile."""
        if not self.args.compile:
            return
        done, self.compiled = self.compiled, compile_cost(self.model)
        graphs, seconds = self.compiled[0] - done[0], self.compiled[1] - done[1]
        if not graphs:
            return
        what = "recompiled (a new shape)" if kind in self.compiled_kinds else "compiled"
        self.compiled_kinds.add(kind)
        result.compiled.append((step, kind, graphs, seconds))
        where = ("; their backward graphs compile in the first backward; all in the step's "
                 "time" if kind == "training" else "; not in the step's time")
        self.log.print(f"--compile: step {step} {kind} {what} {graphs} forward graphs in "
                       f"{seconds:.1f} s (rank 0's pieces{where})")

    def finish(self, result: TrainResult) -> TrainResult:
        """Final checkpoint, summary and (DP rank 0's TP and EP groups) the sample."""
        if isinstance(self.optimizer, DistributedAdamW):
            self.optimizer.wait_params()  # the last step's parameters, whatever follows
        device = self.state.device
        peaks = self.state.world.all_gather_json(peak_bytes(device))
        states = self.state.world.all_gather_json(optimizer_state_bytes(self.optimizer))
        result.peak_mem_bytes, result.optimizer_state_bytes = peaks, states
        if self.rank0 and all(p is not None for p in peaks):
            self.log.print(f"peak memory per rank ({memory_method(device)}): "
                           + ", ".join(f"{p / 2**20:.0f}" for p in peaks) + " MiB; optimizer "
                           "state per rank: " + ", ".join(f"{b / 2**20:.1f}" for b in states)
                           + " MiB" + (" (sharded over DP)" if isinstance(
                               self.optimizer, DistributedAdamW) else ""))
        self.log.close()
        if result.losses and result.stopped_at is None:
            self.save(self.start + len(result.losses))
        result.wall_s = time.perf_counter() - self.wall0
        if self.rank0:
            _summary(self.log, result, self.run_dir)
        if result.stopped_at is not None:
            if self.rank0:
                name = signal.Signals(self.stop.signum).name if self.stop.signum else "a signal"
                self.log.print(f"stopped by {name} after step {result.stopped_at}; resume with "
                               f"--load {self.run_dir}")
        elif self.args.sample_tokens and self.state.dp_cp.rank < self.state.ep.size:
            # the first replica: its TP ranks and EP peers (their experts) take part
            result.sample = _sample(self.model, self.state, self.run.tokenizer, self.run.config,
                                    self.args, self.log, self.run_dir)
        return result

    # -- checkpoints ------------------------------------------------------------------------
    def save(self, step: int) -> bool:
        """Checkpoint ``step`` (every rank calls this); False when the step's loss or the
        weights are NaN/inf (the previous checkpoint stays the latest)."""
        if self.last_saved == step:
            return True
        if isinstance(self.optimizer, DistributedAdamW):
            self.optimizer.wait_params()  # the step's updated parameters, all of them
        if self.bad_since is not None:  # agreed: every rank saw the same global loss
            self.log.print(f"not saving step {step}: its loss or gradients are NaN/inf (the "
                           f"last checkpoint, {self._last_checkpoint()}, stays the latest)")
            return False
        finite = all(bool(torch.isfinite(p).all()) for p in self.params)
        (broken,) = agree([not finite], self.state.world, self.state.device)
        if broken:
            self.log.print(f"not saving step {step}: the weights are NaN/inf (the last "
                           f"checkpoint, {self._last_checkpoint()}, stays the latest)")
            return False
        t0 = time.perf_counter()
        self.progress.at(step, "saving a checkpoint")
        meta = Meta(step=step, consumed_samples=self.consumed, config=self.run.config.to_dict(),
                    layout={}, tensors={}, files={}, plan=str(self.plan),
                    args=self.args.to_dict(),
                    scaler=self.scaler.state_dict() if self.scaler is not None else None,
                    library_version=domino.__version__)
        folder = save(self.run_dir, step, self.state, self.model, self.optimizer, meta,
                      keep=self.args.keep_checkpoints, tokenizer=self.run.tokenizer)
        self.last_saved, self.last_save_t = step, time.monotonic()
        if self.rank0:
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            self.log.note(step, f"checkpoint {folder.name}: {size / 2**20:.1f} MiB in "
                                f"{time.perf_counter() - t0:.2f} s")
        return True

    def _last_checkpoint(self) -> str:
        return f"step {self.last_saved}" if self.last_saved is not None else "none"

    def _choose_plan(self) -> None:
        """``--domino-autotune``: a resumed run keeps the plan it was tuned to (the same plan
        is what makes the resume exact); a new one times the candidates on this rank's first
        micro-batch and keeps the fastest (gradients and RNG states are restored)."""
        resume = self.run.resume
        if resume is not None and not resume.weights_only and resume.meta.plan:
            plan = Plan.parse(resume.meta.plan)
            set_plan(self.model, plan)
            self.log.print(f"autotune: keeping the checkpoint's plan {plan}")
            return
        args, state = self.args, self.state
        batch = state_batches(self.run.train_ds, self.consumed, args.global_batch_size,
                              args.micro_batch_size, state)[0]

        def fwd_bwd() -> None:
            forward_loss(self.model, batch).backward()

        best, times = autotune(self.model, fwd_bwd, state,
                               candidate_plans(args.micro_batch_size,
                                               groups=moe_groups(args.num_experts, state.ep.size)))
        medians = {str(p): statistics.median(t) for p, t in times.items()}
        splits = [statistics.median(t) for p, t in times.items() if p.splits]
        regime = (regime_of(medians[str(SYNC)], t_best_split=min(splits))
                  if splits and str(SYNC) in medians else None)
        self.log.print("autotune (median fwd+bwd ms of one micro-batch, slowest rank): "
                       + ", ".join(f"{n} {t * 1e3:.0f}" for n, t in medians.items())
                       + (f"; regime {regime}" if regime else "")
                       + f" -> training with {best}")
        if self.rank0:
            write_atomic(self.run_dir / "autotune.json", json.dumps(
                {"chosen": str(best), "regime": regime.name if regime else None,
                 "median_s": medians,
                 "times_s": {str(p): t for p, t in times.items()}}, indent=2) + "\n")


_GROUP_NAMES = {"tp": "TP", "dp": "DP", "embedding": "tied-embedding sums",
                "ep": "EP all-to-alls"}


def train(run: Run, state: ParallelState | None = None, stop: StopRequest | None = None,
          progress: Progress | None = None) -> TrainResult:
    """Train on this rank (the process group is initialised); returns what this rank saw;
    ``progress`` is kept at the step and phase it is in."""
    trainer = Trainer(run, state, stop, progress)
    try:
        result = trainer.finish(trainer.fit())
    except BaseException:
        if state is None:  # leaving on an error: do not wait for a worker a peer may hold
            trainer.state.close(wait=False)
        raise
    if state is None:  # the trainer built it: its transports end with the run
        trainer.state.close()
    return result


def _sample(model, state: ParallelState, tokenizer, config, args, log: RunLogger,
            run_dir: Path) -> str:
    """Generate from the trained model (DP rank 0's TP and EP groups); rank 0 prints it."""
    prompt = tokenizer.encode(args.sample_prompt) or [tokenizer.eod]
    learned = config.position_embedding_type == "learned_absolute"
    max_context = config.max_position_embeddings if learned else config.seq_length
    ids = generate(model, state, prompt, args.sample_tokens, tokenizer.vocab_size, max_context,
                   args.top_k, args.temperature, args.seed, banned=(tokenizer.eod,))
    text = args.sample_prompt + tokenizer.decode(ids)
    if log.active:
        kind = "greedy" if args.top_k == 1 else f"top-k {args.top_k}, T={args.temperature}"
        log.print(f"\n--- sample ({len(ids)} tokens, {kind}, KV cache) ---\n{text}\n---")
        write_atomic(run_dir / "sample.txt", text)
    return text


def _summary(log: RunLogger, result: TrainResult, run_dir: Path) -> None:
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
