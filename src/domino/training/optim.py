"""Optimiser pieces: AdamW groups, LR schedule, global-norm clipping and dynamic loss scaling
(the DP gradient reduction is :mod:`domino.training.grad_sync`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from domino.precision import zeros_grad
from domino.tensor_parallel import CommGroup, placement_of
from domino.tensor_parallel.placement import NamedGroups, counts_in_norm, sum_over_norm_groups
from domino.training.adamw import AdamW
from domino.training.arguments import TrainArgs
from domino.training.fsdp import Sharded, ShardingPlan, shard


def build_optimizer(model: nn.Module, args: TrainArgs) -> AdamW:
    """AdamW; biases and norm weights (every 1-D parameter) get no weight decay (Megatron)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return AdamW([g for g in groups if g["params"]], lr=args.lr,
                 betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)


def build_sharded(model: nn.Module, params: list[nn.Parameter], state, plan: ShardingPlan,
                  args: TrainArgs, runner=None,
                  overlap_param_gather: bool | None = None) -> Sharded:
    """A run's gradient reduction and optimizer as ``plan`` shards them over data
    parallelism, with the run's AdamW settings (``fsdp.shard``); a plain
    :func:`build_optimizer` where nothing is sharded. ``overlap_param_gather``: default the
    run's flag. Returns the :class:`~domino.training.fsdp.Sharded`, its optimizer set."""
    built = shard(model, params, state, plan, lr=args.lr,
                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                  weight_decay=args.weight_decay, overlap=args.overlap_grad_reduce,
                  runner=runner, reduce_dtype=args.grad_reduce_dtype(),
                  overlap_param_gather=(args.overlap_param_gather if overlap_param_gather is None
                                        else overlap_param_gather))
    return Sharded(built.reducer, built.optimizer or build_optimizer(model, args), built.gathers)


def learning_rate(step: int, args: TrainArgs) -> float:
    """LR for optimizer step ``step`` (1-based): linear warm-up, then decay to min_lr."""
    warmup = args.lr_warmup_iters
    if warmup and step <= warmup:
        return args.lr * step / warmup
    if args.lr_decay_style == "constant":
        return args.lr
    decay_iters = args.lr_decay_iters or args.train_iters
    span = max(decay_iters - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if args.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_lr + coeff * (args.lr - args.min_lr)


def set_lr(optimizer: AdamW, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter's gradient, materialising zeros for unused ones so that all ranks
    reduce the same buffers."""
    out = []
    for p in params:
        if p.grad is None:
            p.grad = zeros_grad(p)
        out.append(p.grad)
    return out


def global_grad_norm(params: Sequence[nn.Parameter], state: NamedGroups) -> float:
    """L2 norm of the full model's gradient, equal to the single-process model's norm.

    Each parameter's placement says where it counts (``placement.counts_in_norm``): a sharded
    parameter on every rank of its group, a replicated one (norms, row-parallel biases, position
    embeddings) only on rank 0 of the groups replicating it, a pipeline's tied copy of the word
    table nowhere (it equals the first stage's). The squares are summed over the norm groups
    (TP, PP, and EP when > 1), so the result is identical on every rank of them. Gradients are
    already reduced over their gradient group: no DP sum.
    """
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None and counts_in_norm(placement_of(p), state):
            total += torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32).double() ** 2
    sum_over_norm_groups(total, state)
    return float(total.sqrt())


def clip_coeff(max_norm: float, norm: float) -> float:
    """The factor clipping to ``max_norm`` scales gradients of global norm ``norm`` by."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def clip_grads(params: Sequence[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale gradients by max_norm / norm when the global norm exceeds max_norm."""
    coeff = clip_coeff(max_norm, norm)
    if coeff < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coeff)


def agree(flags: Sequence[bool], group: CommGroup, device: torch.device) -> list[bool]:
    """Each flag, true when it is set on any rank of ``group`` (one small collective)."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
    group.all_reduce(t, op=dist.ReduceOp.MAX, name="agree")
    return [bool(v > 0) for v in t.tolist()]


class DynamicLossScaler:
    """fp16 loss scaling: halve on overflow (the step is skipped), double after ``window``
    clean steps."""

    def __init__(self, initial: float = 2.0 ** 16, window: int = 1000, min_scale: float = 1.0):
        self.scale, self.window, self.min_scale = float(initial), window, min_scale
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of AdamW moments (and steps) this rank holds; a distributed optimizer's are its
    chunks' (in its ``inner`` AdamW), with its ``chunks`` of the fp32 master weights."""
    inner = getattr(optimizer, "inner", optimizer)
    masters = sum(c.numel() * c.element_size() for c in getattr(optimizer, "chunks", ()))
    return masters + sum(v.numel() * v.element_size() for st in inner.state.values()
                         for v in st.values() if isinstance(v, torch.Tensor))


def model_state_bytes(model: nn.Module, params: Sequence[torch.Tensor], optimizer) -> dict:
    """This rank's model state by part, in bytes, as held now: ``weights`` (every parameter,
    frozen ones included, and their compute copies; a fully sharded unit's while gathered
    only), ``grads`` (the main gradients held, and a reducer's sharded sums) and
    ``optimizer`` (:func:`optimizer_state_bytes`)."""
    copies = [getattr(p, "_domino_compute_copy", None) for p in model.parameters()]
    # Each storage once, at its size now: fully sharded units' are empty while freed.
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters() if p.untyped_storage().nbytes()}
    weights = sum(storages.values()) + sum(
        c[1].numel() * c[1].element_size() for c in copies if c is not None)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    reducer = getattr(optimizer, "reducer", None)
    if reducer is not None and reducer.accumulate:
        grads += sum(b.total.numel() * b.total.element_size() for b in reducer.buckets
                     if b.total is not None)
    return {"weights": weights, "grads": grads, "optimizer": optimizer_state_bytes(optimizer)}
