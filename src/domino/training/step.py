"""One optimisation step and one evaluation pass of a rank: the math of training, without the
bookkeeping (that is :mod:`domino.training.loop`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from domino.parallel_state import ParallelState
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.placement import GRAD_GROUPS
from domino.training.arguments import TrainArgs
from domino.training.data import state_batches
from domino.training.dist_optim import DistributedAdamW
from domino.training.grad_sync import GradReducer
from domino.training.optim import agree, clip_coeff, clip_grads, global_grad_norm, grads_of
from domino.transformer.moe.op import micro_batch_tokens, moe_ops, set_loss_scale, step_end


@dataclass
class TrainResult:
    """What a rank saw: per-step global losses and grad norms, validation, sample, timing."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    sample: str | None = None
    wall_s: float = 0.0
    skipped: int = 0
    stopped_at: int | None = None  # the step a SIGTERM / Ctrl-C stopped the run after
    peak_mem_bytes: list[int | None] = field(default_factory=list)  # per rank (domino.memory)
    optimizer_state_bytes: list[int] = field(default_factory=list)  # per rank
    # --compile: (step, "training" | "evaluation", graphs, seconds) of what this rank compiled
    compiled: list[tuple[int, str, int, float]] = field(default_factory=list)


@dataclass
class StepOutcome:
    """One step as every rank agrees it went."""

    loss: float  # global mean loss per token
    grad_norm: float  # global gradient norm (NaN/inf: the step was skipped)
    exposed_comm_s: float  # this rank's time blocked on TP collectives in forward/backward
    skipped: bool
    requests: list[bool]  # the caller's requests, true when any rank made them
    pipeline_wait_s: float = 0.0  # this rank's time waiting for other pipeline stages
    exposed_dp_s: float = 0.0  # this rank's time blocked on the DP gradient reduction
    moe: dict[str, float] = field(default_factory=dict)  # router metrics (MoE models)


def forward_loss(model, batch, context=None) -> torch.Tensor:
    """Sum of the masked per-token losses of one micro-batch (fp32). ``context``: the
    backward context for this forward's backward (a ``GradReducer``'s, to overlap it)."""
    extra = {} if context is None else {"context": context}
    # --bf16 / --fp16: the model computes in that dtype itself (RuntimeConfig.compute_dtype).
    per_token = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                      labels=batch["labels"], **extra)  # [b, s]
    return (per_token.float() * batch["loss_mask"]).sum()


@torch.no_grad()
def evaluate(model, dataset, args: TrainArgs, state: ParallelState,
             iters: int | None = None) -> tuple[float, int]:
    """(mean loss per token, tokens) over the first ``iters`` (default ``--eval-iters``)
    global batches of ``dataset`` (all DP and CP ranks contribute: each its share)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=state.device)
    g = args.global_batch_size
    for k in range(args.eval_iters if iters is None else iters):
        for batch in state_batches(dataset, k * g, g, args.micro_batch_size, state):
            total[0] += forward_loss(model, batch).double()
            total[1] += batch["loss_mask"].sum().double()
    state.dp_cp.all_reduce(total, name="eval loss")
    model.train(was_training)
    return float(total[0] / total[1].clamp(min=1)), int(total[1])


def train_step(model, params, optimizer, scaler, batches, args: TrainArgs, state: ParallelState,
               requests: Sequence[bool] = (), runner=None,
               reducer: GradReducer | None = None) -> StepOutcome:
    """One optimizer step over this rank's micro-batches (through ``runner``, a
    PipelineRunner, when the model is a pipeline). ``requests`` (e.g. "stop after this step")
    are agreed on by every rank in the same collective as the overflow check. ``reducer`` (the
    run's, from :func:`~domino.training.grad_sync.make_reducer`; None only when no gradient
    group has more than one rank) sums the gradients over their groups: during the last
    micro-batch's backward when it was built to overlap, else after the backward."""
    if reducer is None and any(state.group(name).size > 1 for name in GRAD_GROUPS):
        raise ValueError("train_step needs a GradReducer with data parallelism: build it with "
                         "domino.training.grad_sync.make_reducer")
    # Under CP a rank's batches hold its shards of the samples: its loss tokens are counted
    # and its loss summed over DP x CP, so every token counts once (dp_cp is dp at CP = 1).
    dp, tp, device = state.dp_cp, state.tp, state.device
    # Time blocked on DP collectives: the token count's, the gradient groups', ZeRO's gathers.
    dp_groups = _distinct([dp, *(reducer.groups() if reducer is not None else [])])
    comm0 = tp.stats.wait_s
    # Normalise by the global number of loss tokens: the DP sum of the gradients is then the
    # exact global mean, whatever the DP size or accumulation layout.
    n_tokens = torch.stack([b["loss_mask"].sum() for b in batches]).sum().double().reshape(1)
    # Waited for at the first backward: DP collectives finish in order, so behind ZeRO's
    # parameter all-gathers of the last step (which the first forward overlaps).
    counted = dp.all_reduce(n_tokens, async_op=True, name="token count")
    gather0 = _waited(dp_groups)  # ZeRO's parameter all-gathers waited in the forward
    denom = None
    scale = scaler.scale if scaler is not None else 1.0

    def loss_scale() -> float:
        nonlocal denom
        if denom is None:
            counted.wait()
            denom = float(n_tokens.clamp(min=1))
        return scale / denom
    optimizer.zero_grad(set_to_none=False)
    experts = moe_ops(model)
    pipeline_wait = 0.0
    zero = isinstance(optimizer, DistributedAdamW)
    overlap = reducer is not None and reducer.overlap
    if runner is None:
        loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
        tokens = micro_batch_tokens(batches, state.cp) if experts else []
        for i, batch in enumerate(batches):  # gradient accumulation: the schedule adds into .grad
            last = i == len(batches) - 1
            with reducer.armed() if overlap and last else contextlib.nullcontext() as context:
                lsum = forward_loss(model, batch, context)
                if experts:  # the auxiliary losses weigh as much as this micro-batch's tokens
                    set_loss_scale(experts, tokens[i] * loss_scale())
                (lsum * loss_scale()).backward()
            loss_sum += lsum.detach().double()
    else:
        if overlap:
            reducer.begin()  # each chunk's last backward launches its blocks' buckets
        loss_sum, stats = runner.step(batches, loss_scale(), reducer=reducer if overlap else None)
        pipeline_wait = stats.recv_wait_s
    exposed = tp.stats.wait_s - comm0
    grads = grads_of(params)
    if runner is not None:
        for table in model.tied_word_tables():  # first and last stage: one tied weight
            state.embedding.all_reduce(table.grad, name="tied embedding grads")
    if reducer is not None:
        if not overlap:
            reducer.begin()  # everything is launched at finish
        reducer.finish()
    exposed_dp = _waited(dp_groups) - gather0
    dp.all_reduce(loss_sum, name="loss")
    if scaler is not None:
        if zero:
            optimizer.scale_grads(1.0 / scale)
        else:
            for grad in grads:
                grad.mul_(1.0 / scale)
    norm = optimizer.grad_norm(state) if zero else global_grad_norm(params, state)
    # Every rank must agree to skip, or the replicas would diverge.
    overflow, *agreed = agree([not math.isfinite(norm), *requests], state.world, device)
    if not overflow and zero:
        before = _waited(dp_groups)
        optimizer.step(clip_coeff(args.clip_grad, norm))
        exposed_dp += _waited(dp_groups) - before  # its parameter all-gathers, when waited here
    elif not overflow:
        clip_grads(params, args.clip_grad, norm)
        optimizer.step()
    if scaler is not None:
        scaler.update(overflow)
    # A pipeline's stages hold different MoE layers: the metrics are summed over them.
    stages = state.pp if runner is not None and runner.has_moe else None
    return StepOutcome(float(loss_sum) / denom, norm, exposed, overflow, agreed, pipeline_wait,
                       exposed_dp, step_end(experts, state.dp, stages))


def _distinct(groups: list[CommGroup]) -> list[CommGroup]:
    out: list[CommGroup] = []
    for g in groups:
        if all(g is not seen for seen in out):
            out.append(g)
    return out


def _waited(groups: list[CommGroup]) -> float:
    return sum(g.stats.wait_s for g in groups)
