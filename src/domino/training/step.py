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
from domino.transformer.context import BackwardContext
from domino.transformer.moe.op import micro_batch_tokens, moe_ops, step_end


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
    model_state_bytes: list[dict] = field(default_factory=list)  # per rank, by part
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


class _LossScale:
    """What a step's summed token losses are multiplied by before their backward: the fp16
    scale over the global number of loss tokens (the DP sum of the gradients is then the exact
    global mean, whatever the DP size or accumulation layout). The count is summed over DP
    asynchronously and waited for at first use (the first backward): DP collectives finish in
    order, so behind ZeRO's parameter all-gathers of the last step, which the first forward
    overlaps."""

    def __init__(self, batches, dp: CommGroup, scale: float) -> None:
        self.tokens = torch.stack([b["loss_mask"].sum() for b in batches]).sum().double()
        self.tokens = self.tokens.reshape(1)
        self.counted = dp.all_reduce(self.tokens, async_op=True, name="token count")
        self.scale, self.denom = scale, None

    def __call__(self) -> float:
        if self.denom is None:
            self.counted.wait()
            self.denom = float(self.tokens.clamp(min=1))
        return self.scale / self.denom


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
    dp, tp = state.dp_cp, state.tp
    # Time blocked on DP collectives: the token count's, the gradient groups', ZeRO's gathers.
    dp_groups = _distinct([dp, *(reducer.groups() if reducer is not None else [])])
    comm0 = tp.stats.wait_s
    loss_scale = _LossScale(batches, dp, scaler.scale if scaler is not None else 1.0)
    gather0 = _waited(dp_groups)  # ZeRO's parameter all-gathers waited in the forward
    optimizer.zero_grad(set_to_none=False)
    experts = moe_ops(model)
    overlap = reducer is not None and reducer.overlap
    if reducer is not None and reducer.accumulate:
        reducer.begin_step()  # (sharded gradients: each micro-step reduces; see grad_sync)
    pipeline_wait = 0.0
    if runner is None:
        loss_sum = _micro_steps(model, batches, state, loss_scale, experts,
                                reducer if overlap else None)
    else:
        if overlap:
            reducer.begin()  # each chunk's last backward launches its blocks' buckets
        loss_sum, stats = runner.step(batches, loss_scale(), reducer=reducer if overlap else None)
        pipeline_wait = stats.recv_wait_s
    exposed = tp.stats.wait_s - comm0
    # (zeros for unused parameters: every rank reduces the same; ZeRO reads its own chunks)
    grads = [] if isinstance(optimizer, DistributedAdamW) else grads_of(params)
    if reducer is None or not reducer.accumulate or runner is not None:
        _reduce_grads(model, state, runner, reducer, overlap)
    exposed_dp = _waited(dp_groups) - gather0
    dp.all_reduce(loss_sum, name="loss")
    norm, overflow, agreed, exposed_step = _update(optimizer, params, grads, scaler,
                                                   loss_scale.scale, args, state, requests,
                                                   dp_groups)
    # A pipeline's stages hold different MoE layers: the metrics are summed over them.
    stages = state.pp if runner is not None and runner.has_moe else None
    return StepOutcome(float(loss_sum) / loss_scale.denom, norm, exposed, overflow, agreed,
                       pipeline_wait, exposed_dp + exposed_step,
                       step_end(experts, state.dp, stages))


def _micro_steps(model, batches, state: ParallelState, loss_scale: _LossScale, experts: list,
                 reducer: GradReducer | None) -> torch.Tensor:
    """Forward and backward of each micro-batch (gradient accumulation: the schedule adds into
    ``.grad``) -> the summed token losses. With ``reducer`` (overlapped), the last micro-batch's
    backward launches the DP buckets as its blocks are final. Each micro-batch's MoE auxiliary
    losses weigh as much as its loss tokens (its step context's ``aux_loss_scale``)."""
    loss_sum = torch.zeros(1, dtype=torch.float64, device=state.device)
    tokens = micro_batch_tokens(batches, state.cp) if experts else []
    every = reducer is not None and reducer.accumulate  # sharded gradients: each reduces
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        armed = (reducer.armed() if reducer is not None and (last or every)
                 else contextlib.nullcontext())
        with armed as context:
            if experts and context is None:
                context = BackwardContext()
            lsum = forward_loss(model, batch, context)
            if experts:  # set once the step's tokens are counted (the first backward waits)
                context.aux_loss_scale = tokens[i] * loss_scale()
            (lsum * loss_scale()).backward()
        if every:
            reducer.finish()
        loss_sum += lsum.detach().double()
    return loss_sum


def _reduce_grads(model, state: ParallelState, runner, reducer: GradReducer | None,
                  overlap: bool) -> None:
    """The gradients summed over their groups: a pipeline's tied word table over its first and
    last stage, then the reducer's buckets (launched now unless the backward overlapped them),
    waited for."""
    if runner is not None:
        for table in model.tied_word_tables():  # first and last stage: one tied weight
            if table.requires_grad:  # (a LoRA run's frozen base has no gradient)
                state.embedding.all_reduce(table.grad, name="tied embedding grads")
    if reducer is not None:
        if not overlap:
            reducer.begin()  # everything is launched at finish
        reducer.finish()


def _update(optimizer, params, grads: list[torch.Tensor], scaler, scale: float,
            args: TrainArgs, state: ParallelState, requests: Sequence[bool],
            dp_groups: list[CommGroup]) -> tuple[float, bool, list[bool], float]:
    """The optimizer's update from the summed gradients ``grads`` (of ``params``): unscaled
    (fp16: by ``scale``), their global norm, skipped where it is not finite (every rank
    agrees, with the caller's ``requests``), else clipped and applied -> (norm, skipped, the
    agreed requests, time blocked on DP)."""
    zero = isinstance(optimizer, DistributedAdamW)
    if scaler is not None:
        if zero:
            optimizer.scale_grads(1.0 / scale)
        else:
            for grad in grads:
                grad.mul_(1.0 / scale)
    norm = optimizer.grad_norm(state) if zero else global_grad_norm(params, state)
    # Every rank must agree to skip, or the replicas would diverge.
    overflow, *agreed = agree([not math.isfinite(norm), *requests], state.world, state.device)
    exposed_dp = 0.0
    if not overflow and zero:
        before = _waited(dp_groups)
        optimizer.step(clip_coeff(args.clip_grad, norm))
        exposed_dp = _waited(dp_groups) - before  # its parameter all-gathers, when waited here
    elif not overflow:
        clip_grads(params, args.clip_grad, norm)
        optimizer.step()
    if scaler is not None:
        scaler.update(overflow)
    return norm, overflow, agreed, exposed_dp


def _distinct(groups: list[CommGroup]) -> list[CommGroup]:
    out: list[CommGroup] = []
    for g in groups:
        if all(g is not seen for seen in out):
            out.append(g)
    return out


def _waited(groups: list[CommGroup]) -> float:
    return sum(g.stats.wait_s for g in groups)
