"""The training run of one rank: set-up and resume, the step loop with evaluation, logging and
checkpoints, and the finish (final checkpoint, summary, sample).

Ranks agree on every decision that changes what they do next (skip a step, stop on a signal,
save on the clock, stop on a diverged loss) in one small collective per step, so they never
disagree and hang.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import domino
from domino.checkpoint import Meta, load_model, load_optimizer, load_rng, save
from domino.checkpoint import lora as checkpoint_lora
from domino.flops import rank_gemms, train_flops_per_step, utilisation
from domino.gemm_rate import peak_flops
from domino.memory import peak_bytes
from domino.models.gpt import GPTModel
from domino.models.lora import apply_lora
from domino.parallel_state import ParallelState
from domino.pipeline.model import PipelineModel
from domino.pipeline.runtime import PipelineRunner
from domino.plan import Plan
from domino.runtime import RuntimeConfig
from domino.tensor_parallel import placement_of
from domino.training import fsdp_flags, lora_flags, report
from domino.training.data import state_batches
from domino.training.dist_optim import DistributedAdamW
from domino.training.fsdp import ShardingPlan, implied_state
from domino.training.logging import RunLogger
from domino.training.optim import (
    DynamicLossScaler,
    agree,
    build_sharded,
    learning_rate,
    model_state_bytes,
    optimizer_state_bytes,
    set_lr,
)
from domino.training.plan_choice import choose_plan
from domino.training.prepare import Run
from domino.training.progress import Progress, StopRequest
from domino.training.step import StepOutcome, TrainResult, evaluate, train_step
from domino.transformer.attention_paths import AttentionShapes, resolve_attention
from domino.transformer.stack import plan_of


class TrainingDiverged(RuntimeError):
    """The loss or the gradients stayed NaN/inf for ``--max-nonfinite-steps`` steps."""


@dataclass
class _Window:
    """Sums over the steps since the last log record."""

    loss: float = 0.0
    time: float = 0.0
    comm: float = 0.0
    pipe: float = 0.0
    dp: float = 0.0
    n: float = 0.0

    def add(self, out: StepOutcome, step_time: float) -> None:
        self.loss += out.loss
        self.time += step_time
        self.comm += out.exposed_comm_s
        self.pipe += out.pipeline_wait_s
        self.dp += out.exposed_dp_s
        self.n += 1.0


class Trainer:
    """One rank's run: set-up in the constructor (model, optimiser, resume, logger), then
    :meth:`fit` (the step loop, with evaluation and checkpoints) and :meth:`finish` (final
    checkpoint, summary, sample). The process group is initialised and ``state`` built (the
    caller closes it)."""

    def __init__(self, run: Run, state: ParallelState, stop: StopRequest | None = None,
                 progress: Progress | None = None) -> None:
        self.wall0 = time.perf_counter()
        args = run.args
        assert run.run_dir is not None, "the run folder is known before training starts"
        self.run, self.args, self.run_dir, self.state = run, args, Path(run.run_dir), state
        self.stop = stop if stop is not None else StopRequest()
        self.progress = progress if progress is not None else Progress()
        torch.manual_seed(args.seed)  # same on every rank: TP-invariant init, equal DP replicas
        state.rng.seed(args.seed)
        self.runtime = self._resolve_attention()
        self._build_model()
        self._build_optimizer()
        self.rank0 = state.world.rank == 0
        self.start, self.consumed = 0, 0
        notes = self._resume() if run.resume is not None else []
        notes.append(report.state_line(self.strategy, implied_state(
            self.strategy, self.model, self.params, self.optimizer, self.gathers,
            args.fsdp_prefetch)))
        self.log = RunLogger(self.run_dir, args.train_iters, self.start, self.rank0,
                             args.tensorboard)
        self.last_saved = self.start if run.resume is not None and self.start else None
        self.last_save_t = time.monotonic()
        self.bad_since: int | None = None  # first step of the current NaN/inf streak
        self.compiles = report.CompileReport(self.log) if args.compile else None
        parameters = self._parameter_count()
        self._measure_peak()
        if self.rank0:
            pipeline = (args.schedule(), self.model.layout) if self.runner is not None else None
            batching = report.batching_text(run, state, self.plan, pipeline)
            for line in [*notes, *report.startup_lines(run, state, parameters, batching,
                                                       self.flops_per_step, self.peak,
                                                       self.peak_what, self.runtime)]:
                self.log.print(line)

    def _build_model(self) -> None:
        """The model (a pipeline stage's, with its runner, when PP > 1) and its parameters."""
        run, args, state = self.run, self.args, self.state
        self.runner = None
        if state.pp.size > 1:
            layout = args.pipeline_layout()
            self.model: torch.nn.Module = PipelineModel(run.config, state, layout,
                                                        runtime=self.runtime)
            self.pipeline_micro_batches = args.global_batch_size // (
                args.micro_batch_size * state.dp.size)
            self.runner = PipelineRunner(self.model, args.schedule(),
                                         self.pipeline_micro_batches, args.seq_length,
                                         args.micro_batch_size)
        else:
            self.model = GPTModel(run.config, parallel_state=state, runtime=self.runtime)
        self.lora = lora_flags.lora_spec(args)
        if self.lora is not None:  # the base frozen; the adapters are what trains
            apply_lora(self.model, self.lora, state, args.seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def _resolve_attention(self) -> RuntimeConfig:
        """The run's runtime with ``--attention-backend auto`` measured at the run's attention
        shapes (every rank at once, one choice for all: attention_paths); under context
        parallelism the ring's own kernels run instead, and nothing is measured."""
        run, args, state = self.run, self.args, self.state
        shapes = None if state.cp.size > 1 else AttentionShapes.of_run(
            run.config, args.micro_batch_size, state.tp.size, run.runtime.plan.micro_batches,
            args.compute_dtype() or run.config.params_dtype, state.device,
            masked=args.reset_attention_mask or args.pack_documents)
        return resolve_attention(run.runtime, shapes, state.world)

    def _build_optimizer(self) -> None:
        """The gradient reduction, the optimiser (sharded as --data-parallel-sharding-strategy
        says: ``fsdp.shard``; plain AdamW where nothing is sharded) and fp16's loss scaler."""
        args = self.args
        self.strategy = fsdp_flags.strategy(args)
        plan = ShardingPlan(self.strategy, args.fsdp_unit_layers, args.fsdp_prefetch,
                            args.fsdp_reshard_after_forward, args.data_parallel_shard_size)
        built = build_sharded(self.model, self.params, self.state, plan, args, self.runner)
        self.reducer, self.gathers, self.optimizer = built.reducer, built.gathers, built.optimizer
        self.scaler = (DynamicLossScaler(args.initial_loss_scale, args.loss_scale_window)
                       if args.fp16 else None)

    def _parameter_count(self) -> int:
        """The model's parameters, every shard counted once (summed over the stages)."""
        state = self.state
        count = torch.tensor([float(sum(
            p.numel() * (state.group(pl.shard).size if pl.shard else 1)
            for p in self.params if not (pl := placement_of(p)).tied_copy))],
            device=state.device)
        state.pp.all_reduce(count, name="parameter count")
        return int(count.item())

    def _measure_peak(self) -> None:
        """MFU: the model FLOPs of a step (all ranks) over the peak one rank can reach; on CPU
        the ranks time their GEMM shapes together, as they will run (cached per machine)."""
        run, args, state = self.run, self.args, self.state
        tp = state.tp.size
        self.flops_per_step = train_flops_per_step(
            run.config, args.global_batch_size * args.seq_length, tp=tp)
        compute = args.compute_dtype() or run.config.params_dtype
        state.world.barrier()
        self.peak, self.peak_what = peak_flops(
            state.device, compute,
            rank_gemms(run.config, args.micro_batch_size * args.seq_length // state.cp.size, tp),
            args.peak_tflops)

    def _lora_record(self) -> dict:
        """What a LoRA run's checkpoints say of the adapters and their base: the resumed
        checkpoint's record, or a new one naming the --load base."""
        resume = self.run.resume
        assert resume is not None and self.lora is not None  # (lora_flags.check_lora)
        if checkpoint_lora.spec_of(resume.meta) is not None:
            return resume.meta.extra[checkpoint_lora.KEY]
        return checkpoint_lora.record(self.lora, resume.step_dir, self.run_dir)

    @property
    def plan(self) -> Plan:
        return plan_of(self.model)

    def _resume(self) -> list[str]:
        resume = self.run.resume
        assert resume is not None
        load_model(resume.step_dir, resume.meta, self.model, self.state, self.optimizer)
        if resume.weights_only:
            why = "--finetune: weights only" if resume.finetune else "no optimizer state"
            return [f"initialised from the weights of {resume.step_dir} ({why}): a new run "
                    "from step 0"]
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
        args = self.args
        if args.domino_autotune and self.start < args.train_iters:
            choose_plan(self.model, self.run, self.state, self.consumed, self.log)
        result, window = TrainResult(), _Window()
        for step in range(self.start + 1, args.train_iters + 1):
            out, lr = self._step(step, result, window)
            stop_requested, save_due = out.requests
            exit_now = bool(args.exit_interval and step % args.exit_interval == 0)
            last = exit_now or step == args.train_iters
            rec = {} if stop_requested else self._validate(step, result, last)
            if rec or last or stop_requested or step % args.log_interval == 0:
                self.log.record(self._record(step, lr, out, result, window, rec))
                window = _Window()
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

    def _step(self, step: int, result: TrainResult, window: _Window) -> tuple[StepOutcome, float]:
        """One optimizer step, its outcome added to ``result`` and ``window``; the learning
        rate it ran at. Raises TrainingDiverged after too many NaN/inf steps."""
        args = self.args
        t0 = time.perf_counter()
        self.progress.at(step, "training step")
        set_lr(self.optimizer, lr := learning_rate(step, args))
        batches = state_batches(self.run.train_ds, self.consumed, args.global_batch_size,
                                args.micro_batch_size, self.state)
        clock_due = bool(args.save_interval_minutes
                         and time.monotonic() - self.last_save_t
                         >= args.save_interval_minutes * 60)
        out = train_step(self.model, self.params, self.optimizer, self.scaler, batches, args,
                         self.state, requests=(self.stop.signum is not None, clock_due),
                         runner=self.runner, reducer=self.reducer)
        self.consumed += args.global_batch_size
        result.skipped += out.skipped
        step_time = time.perf_counter() - t0
        result.losses.append(out.loss)
        result.grad_norms.append(out.grad_norm)
        self.log.step(step, out.loss)
        self._compile_report(step, result, "training")
        window.add(out, step_time)
        self._check_finite(step, out)
        return out, lr

    def _check_finite(self, step: int, out: StepOutcome) -> None:
        """Track the NaN/inf streak (a skipped step counts unless fp16's scaler can still
        shrink); stop once it reaches --max-nonfinite-steps."""
        bad = not math.isfinite(out.loss) or (out.skipped and (
            self.scaler is None or self.scaler.scale <= self.scaler.min_scale))
        self.bad_since = (self.bad_since or step) if bad else None
        since, limit = self.bad_since, self.args.max_nonfinite_steps
        if since is not None and limit and step - since + 1 >= limit:
            self.log.close()
            raise TrainingDiverged(
                f"the loss or the gradients were NaN/inf for {step - since + 1} consecutive "
                f"steps ({since}-{step}); stopped without saving (the last checkpoint, "
                f"{self._last_checkpoint()}, is untouched). Lower --lr, check the data, or raise "
                "--max-nonfinite-steps")

    def _validate(self, step: int, result: TrainResult, last: bool) -> dict[str, float]:
        """The validation loss and perplexity when one is due at ``step``, else nothing."""
        args = self.args
        due = (args.eval_interval and step % args.eval_interval == 0) or last
        if self.run.valid_ds is None or not due:
            return {}
        self.progress.at(step, "evaluation")
        val, _ = evaluate(self.model, self.run.valid_ds, args, self.state)
        result.val_losses.append((step, val))
        self._compile_report(step, result, "evaluation")
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}

    def _record(self, step: int, lr: float, out: StepOutcome, result: TrainResult,
                window: _Window, rec: dict[str, float]) -> dict[str, float | int]:
        """The metrics.jsonl record of the steps in ``window`` (means over them)."""
        n, tokens = window.n, self.args.global_batch_size * self.args.seq_length
        record: dict[str, float | int] = {
            "step": step, "loss": window.loss / n, "lr": lr, "grad_norm": out.grad_norm,
            "tokens_per_s": tokens * n / window.time, "step_time_s": window.time / n,
            "exposed_comm_s": window.comm / n, "skipped": result.skipped, **out.moe, **rec}
        per_rank, mfu = utilisation(self.flops_per_step, self.state.world.size,
                                    record["step_time_s"], self.peak)
        record["model_tflops_per_rank"] = per_rank / 1e12
        if mfu is not None:
            record["mfu"] = mfu
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.scale
        if self.runner is not None:
            record["pipeline_wait_s"] = window.pipe / n
        if self.state.dp_cp.size > 1:  # the gradient reduction's group (its exposed time)
            record["exposed_dp_comm_s"] = window.dp / n
        peak = peak_bytes(self.state.device)
        if peak is not None:
            record["peak_mem_bytes"] = peak  # this rank's (rank 0 writes the log)
        return record

    def finish(self, result: TrainResult) -> TrainResult:
        """Final checkpoint, summary and (DP rank 0's TP and EP groups) the sample."""
        if isinstance(self.optimizer, DistributedAdamW):
            self.optimizer.wait_params()  # the last step's parameters, whatever follows
        device = self.state.device
        peaks = self.state.world.all_gather_json(peak_bytes(device))
        states = self.state.world.all_gather_json(optimizer_state_bytes(self.optimizer))
        models = self.state.world.all_gather_json(
            model_state_bytes(self.model, self.params, self.optimizer))
        result.peak_mem_bytes, result.optimizer_state_bytes = peaks, states
        result.model_state_bytes = models
        if self.rank0 and all(p is not None for p in peaks):
            self.log.print(report.memory_line(device, peaks, states, isinstance(
                self.optimizer, DistributedAdamW), models))
        self.log.close()
        if result.losses and result.stopped_at is None:
            self.save(self.start + len(result.losses))
        result.wall_s = time.perf_counter() - self.wall0
        if self.rank0:
            report.summary(self.log, result, self.run_dir)
        if result.stopped_at is not None:
            if self.rank0:
                name = signal.Signals(self.stop.signum).name if self.stop.signum else "a signal"
                self.log.print(f"stopped by {name} after step {result.stopped_at}; resume with "
                               f"--load {self.run_dir}")
        elif self.args.sample_tokens:
            # Sharded layers are gathered whole on every rank first: one replica samples.
            with self.gathers.whole() if self.gathers else contextlib.nullcontext():
                if self.state.dp_cp.rank < self.state.ep.size:
                    # the first replica: its TP ranks and EP peers (their experts) take part
                    result.sample = report.sample(self.model, self.state, self.run, self.log,
                                                  self.run_dir)
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
        # (A distributed optimizer's chunks are the weights: sharded parameters hold nothing.)
        weights = (self.optimizer.chunks if isinstance(self.optimizer, DistributedAdamW)
                   else self.params)
        finite = all(bool(torch.isfinite(p).all()) for p in weights)
        (broken,) = agree([not finite], self.state.world, self.state.device)
        if broken:
            self.log.print(f"not saving step {step}: the weights are NaN/inf (the last "
                           f"checkpoint, {self._last_checkpoint()}, stays the latest)")
            return False
        t0 = time.perf_counter()
        self.progress.at(step, "saving a checkpoint")
        # An imported model's dtype stays its own through fine-tuning (`domino export` default).
        kept = {k: v for k, v in self.run.resume.meta.extra.items()
                if k == "dtype"} if self.run.resume is not None else {}
        if self.lora is not None:
            kept[checkpoint_lora.KEY] = self._lora_record()
        meta = Meta(step=step, consumed_samples=self.consumed, config=self.run.config.to_dict(),
                    layout={}, tensors={}, files={}, plan=str(self.plan),
                    args=self.args.to_dict(),
                    scaler=self.scaler.state_dict() if self.scaler is not None else None,
                    library_version=domino.__version__, extra=kept)
        folder = save(self.run_dir, step, self.state, self.model, self.optimizer, meta,
                      keep=self.args.keep_checkpoints, tokenizer=self.run.tokenizer)
        self.last_saved, self.last_save_t = step, time.monotonic()
        if self.rank0:
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            self.log.note(step, f"checkpoint {folder.name}: {size / 2**20:.1f} MiB in "
                                f"{time.perf_counter() - t0:.2f} s")
        return True

    def _compile_report(self, step: int, result: TrainResult, kind: str) -> None:
        if self.compiles is not None:
            self.compiles.after(step, self.model, result, kind)

    def _last_checkpoint(self) -> str:
        return f"step {self.last_saved}" if self.last_saved is not None else "none"


def train(run: Run, state: ParallelState, stop: StopRequest | None = None,
          progress: Progress | None = None) -> TrainResult:
    """Train on this rank (the process group is initialised, ``state`` built: the caller closes
    it); returns what this rank saw; ``progress`` is kept at the step and phase it is in."""
    trainer = Trainer(run, state, stop, progress)
    return trainer.finish(trainer.fit())
