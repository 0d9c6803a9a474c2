"""The training loop of one rank: data, model, optimisation steps, evaluation, checkpoint,
summary and the final sample."""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState
from domino.tensor_parallel import is_partitioned
from domino.training.arguments import TrainArgs
from domino.training.checkpoint import load_checkpoint, save_checkpoint
from domino.training.data import rank_batches
from domino.training.generate import generate
from domino.training.logging import RunLogger
from domino.training.optim import (
    DynamicLossScaler,
    allreduce_grads,
    any_rank_true,
    build_optimizer,
    clip_grads,
    global_grad_norm,
    grads_of,
    learning_rate,
    set_lr,
)
from domino.training.prepare import Run
from domino.transformer.autotune import autotune, candidate_plans

FAIL_RANK_ENV = "DOMINO_TEST_FAIL_RANK"  # test hook: this global rank raises at FAIL_STEP
FAIL_STEP_ENV = "DOMINO_TEST_FAIL_STEP"


@dataclass
class TrainResult:
    """What a rank saw: per-step global losses and grad norms, validation, sample, timing."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    sample: str | None = None
    wall_s: float = 0.0
    skipped: int = 0


def _autocast(args: TrainArgs, device: torch.device):
    if args.bf16 or args.fp16:
        dtype = torch.bfloat16 if args.bf16 else torch.float16
        return torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext()


def _maybe_fail(step: int, rank: int) -> None:
    if os.environ.get(FAIL_RANK_ENV) == str(rank) and step == int(
            os.environ.get(FAIL_STEP_ENV, "1")):
        raise RuntimeError(f"injected failure on rank {rank} at step {step} ({FAIL_RANK_ENV})")


def _forward_loss(model, batch, args, device) -> torch.Tensor:
    """Sum of the masked per-token losses of one micro-batch (fp32)."""
    with _autocast(args, device):
        per_token = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                          labels=batch["labels"])  # [b, s]
    return (per_token.float() * batch["loss_mask"]).sum()


@torch.no_grad()
def evaluate(model, dataset, args: TrainArgs, state: ParallelState) -> float:
    """Mean loss per token over the fixed validation batches (all DP ranks contribute)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=state.device)
    for k in range(args.eval_iters):
        for batch in rank_batches(dataset, k, args.global_batch_size, state.dp.size,
                                  state.dp.rank, args.micro_batch_size, state.device):
            total[0] += _forward_loss(model, batch, args, state.device).double()
            total[1] += batch["loss_mask"].sum().double()
    state.dp.all_reduce(total, name="eval loss")
    model.train()
    return float(total[0] / total[1].clamp(min=1))


def _train_step(model, params, optimizer, scaler, batches, args: TrainArgs,
                state: ParallelState) -> tuple[float, float, float, bool]:
    """One optimizer step over this rank's micro-batches; returns (global mean loss, global
    grad norm, seconds blocked on TP collectives in forward/backward, skipped)."""
    dp, tp, device = state.dp, state.tp, state.device
    comm0 = tp.stats.wait_s
    # Normalise by the global number of loss tokens: the DP sum of the gradients is then the
    # exact global mean, whatever the DP size or accumulation layout.
    n_tokens = torch.stack([b["loss_mask"].sum() for b in batches]).sum().double().reshape(1)
    dp.all_reduce(n_tokens, name="token count")
    denom = float(n_tokens.clamp(min=1))
    scale = scaler.scale if scaler is not None else 1.0
    optimizer.zero_grad(set_to_none=False)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    for batch in batches:  # gradient accumulation: the schedule adds into .grad
        lsum = _forward_loss(model, batch, args, device)
        (lsum * (scale / denom)).backward()
        loss_sum += lsum.detach().double()
    exposed = tp.stats.wait_s - comm0
    grads = grads_of(params)
    allreduce_grads(grads, dp)
    dp.all_reduce(loss_sum, name="loss")
    if scaler is not None:
        for grad in grads:
            grad.mul_(1.0 / scale)
    norm = global_grad_norm(params, tp)
    # Every rank must agree to skip, or the replicas would diverge.
    overflow = any_rank_true(not math.isfinite(norm), (tp, dp), device)
    if not overflow:
        clip_grads(params, args.clip_grad, norm)
        optimizer.step()
    if scaler is not None:
        scaler.update(overflow)
    return float(loss_sum) / denom, norm, exposed, overflow


class Trainer:
    """One rank's run: set-up in the constructor (model, optimiser, resume, logger), then
    :meth:`fit` (the step loop, with evaluation and periodic checkpoints) and :meth:`finish`
    (final checkpoint, summary, sample). The process group is initialised."""

    def __init__(self, run: Run, state: ParallelState | None = None) -> None:
        self.wall0 = time.perf_counter()
        args = run.args
        assert run.run_dir is not None, "the run folder is known before training starts"
        self.run, self.args, self.run_dir = run, args, Path(run.run_dir)
        self.state = state if state is not None else ParallelState.build(
            args.tensor_model_parallel_size, device=args.device)
        dp, tp = self.state.dp, self.state.tp
        torch.manual_seed(args.seed)  # same on every rank: TP-invariant init, equal DP replicas
        self.state.rng.seed(args.seed)
        self.model = GPTModel(run.config, parallel_state=self.state, plan=run.plan)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, args)
        self.scaler = (DynamicLossScaler(args.initial_loss_scale, args.loss_scale_window)
                       if args.fp16 else None)
        self.start = self._resume() if args.load else 0
        self.rank0 = self.state.world.rank == 0
        self.log = RunLogger(self.run_dir, args.train_iters, self.start, self.rank0,
                             args.tensorboard)
        if self.rank0:
            full = sum(p.numel() * (tp.size if is_partitioned(p) else 1) for p in self.params)
            accum = args.global_batch_size // (dp.size * args.micro_batch_size)
            self.log.print(
                f"model: {full:,} parameters | TP={tp.size} x DP={dp.size} | global batch "
                f"{args.global_batch_size} x {args.seq_length} tokens = micro-batch "
                f"{args.micro_batch_size} x DP {dp.size} x {accum} accumulation step(s) | "
                f"{len(run.train_ds):,} train samples | Domino plan {run.plan}"
                + (" (one TP rank: runs unsplit)" if tp.size == 1 else "")
                + f" | device {self.state.device}")

    def _resume(self) -> int:
        ckpt = load_checkpoint(self.args.load, self.state)
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.state.rng.load_state_dict(ckpt["rng"])
        return int(ckpt["iteration"])

    def _batches(self, index: int) -> list[dict[str, torch.Tensor]]:
        args, dp = self.args, self.state.dp
        return rank_batches(self.run.train_ds, index, args.global_batch_size, dp.size, dp.rank,
                            args.micro_batch_size, self.state.device)

    def fit(self) -> TrainResult:
        """Train from the resumed step to ``--train-iters`` (or ``--exit-interval``)."""
        args, run = self.args, self.run
        if args.domino_autotune and self.start < args.train_iters:
            self._autotune()
        result = TrainResult()
        g, s = args.global_batch_size, args.seq_length
        window: dict[str, float] = {}
        for step in range(self.start + 1, args.train_iters + 1):
            t0 = time.perf_counter()
            set_lr(self.optimizer, lr := learning_rate(step, args))
            batches = self._batches(step - 1)
            _maybe_fail(step, self.state.world.rank)
            loss, norm, exposed, overflow = _train_step(
                self.model, self.params, self.optimizer, self.scaler, batches, args, self.state)
            result.skipped += overflow
            step_time = time.perf_counter() - t0
            result.losses.append(loss)
            result.grad_norms.append(norm)
            self.log.step(step, loss)
            for key, value in (("loss", loss), ("time", step_time), ("comm", exposed),
                               ("n", 1.0)):
                window[key] = window.get(key, 0.0) + value
            rec: dict[str, float | int] = {}
            stop = bool(args.exit_interval and step % args.exit_interval == 0)
            last = stop or step == args.train_iters
            if run.valid_ds is not None and ((args.eval_interval
                                              and step % args.eval_interval == 0) or last):
                val = evaluate(self.model, run.valid_ds, args, self.state)
                result.val_losses.append((step, val))
                rec.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)))
            if rec or last or step % args.log_interval == 0:
                n = window["n"]
                rec = {"step": step, "loss": window["loss"] / n, "lr": lr, "grad_norm": norm,
                       "tokens_per_s": g * s * n / window["time"],
                       "step_time_s": window["time"] / n, "exposed_comm_s": window["comm"] / n,
                       "skipped": result.skipped, **rec}
                if self.scaler is not None:
                    rec["loss_scale"] = self.scaler.scale
                self.log.record(rec)
                window = {}
            if stop:
                break
            if args.save_interval and step % args.save_interval == 0 and not last:
                self._save(step)
        return result

    def finish(self, result: TrainResult) -> TrainResult:
        """Final checkpoint, summary and (DP rank 0's TP group) the sample."""
        self.log.close()
        if result.losses:
            self._save(self.start + len(result.losses))
        result.wall_s = time.perf_counter() - self.wall0
        if self.rank0:
            _summary(self.log, result, self.run_dir)
        if self.args.sample_tokens and self.state.dp.rank == 0:
            result.sample = _sample(self.model, self.state, self.run.tokenizer, self.run.config,
                                    self.args, self.log, self.run_dir)
        return result

    def _autotune(self) -> None:
        """Time the candidate plans on this rank's first micro-batch of the first step and
        train with the fastest (gradients and RNG states are restored: training is unchanged
        but for the plan)."""
        args, state = self.args, self.state
        batch = self._batches(self.start)[0]

        def fwd_bwd() -> None:
            _forward_loss(self.model, batch, args, state.device).backward()

        best, times = autotune(self.model, fwd_bwd, state, candidate_plans(args.micro_batch_size))
        medians = {str(p): statistics.median(t) for p, t in times.items()}
        self.log.print("autotune (median fwd+bwd ms of one micro-batch, slowest rank): "
                       + ", ".join(f"{n} {t * 1e3:.0f}" for n, t in medians.items())
                       + f" -> training with {best}")
        if self.rank0:
            (self.run_dir / "autotune.json").write_text(json.dumps(
                {"chosen": str(best), "median_s": medians,
                 "times_s": {str(p): t for p, t in times.items()}}, indent=2) + "\n")

    def _save(self, step: int) -> None:
        save_checkpoint(self.run_dir, step, self.state, {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": self.state.rng.state_dict(), "args": self.args.to_dict()})


def train(run: Run, state: ParallelState | None = None) -> TrainResult:
    """Train on this rank (the process group is initialised); returns what this rank saw."""
    trainer = Trainer(run, state)
    return trainer.finish(trainer.fit())


def _sample(model, state: ParallelState, tokenizer, config, args: TrainArgs, log: RunLogger,
            run_dir: Path) -> str:
    """Generate from the trained model (the TP group of DP rank 0); rank 0 prints it."""
    prompt = tokenizer.encode(args.sample_prompt) or [tokenizer.eod]
    learned = config.position_embedding_type == "learned_absolute"
    max_context = config.max_position_embeddings if learned else config.seq_length
    ids = generate(model, state, prompt, args.sample_tokens, tokenizer.vocab_size, max_context,
                   args.top_k, args.temperature, args.seed, banned=(tokenizer.eod,))
    text = args.sample_prompt + tokenizer.decode(ids)
    if log.active:
        kind = "greedy" if args.top_k == 1 else f"top-k {args.top_k}, T={args.temperature}"
        log.print(f"\n--- sample ({len(ids)} tokens, {kind}, KV cache) ---\n{text}\n---")
        (run_dir / "sample.txt").write_text(text, encoding="utf-8")
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
