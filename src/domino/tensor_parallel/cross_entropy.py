"""Vocab-parallel cross entropy: the loss over logits whose vocabulary is split across TP ranks.

Never gathers the logits: three all-reduces of [tokens]-sized tensors (max, target logit, sum of
exps, plus the logit sum for label smoothing). Computed in fp32 and shifted by the global max, so
it is stable for any logit scale. Label smoothing follows ``torch.nn.functional.cross_entropy``:
``(1 - eps) * nll + eps * mean_j(-log p_j)`` over the *real* vocabulary (padding excluded).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from domino.tensor_parallel.comm import CommGroup


def _real_columns(part: int, rank: int, vocab_size: int) -> int:
    """How many of this rank's ``part`` vocabulary columns are real (not padding)."""
    return max(0, min(part, vocab_size - rank * part))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group, vocab_size):
        logits = logits.float()
        part = logits.shape[-1]
        start = group.rank * part
        real = _real_columns(part, group.rank, vocab_size)

        logits_max = logits.max(dim=-1).values
        group.all_reduce(logits_max, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + part)
        local = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        stats = torch.stack([predicted, sum_exp])
        if label_smoothing > 0:
            stats = torch.cat([stats, shifted[..., :real].sum(dim=-1).unsqueeze(0)])
        group.all_reduce(stats)
        predicted, sum_exp = stats[0], stats[1]
        log_z = sum_exp.log()
        loss = log_z - predicted
        if label_smoothing > 0:
            mean_log_p = stats[2] / vocab_size - log_z
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_p

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        ctx.label_smoothing, ctx.real, ctx.vocab_size = label_smoothing, real, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        if eps > 0:
            grad[..., :ctx.real] -= eps / ctx.vocab_size
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, group: CommGroup,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss [...] from logits [..., vocab/tp] (this rank's slice) and ids [...].

    ``vocab_size`` is the real vocabulary (default: all columns); padded columns must already hold
    a very negative value (see :func:`mask_padded_logits`) so they take no probability mass.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1).")
    full = vocab_parallel_logits.shape[-1] * group.size
    vocab_size = full if vocab_size is None else vocab_size
    if not 0 < vocab_size <= full:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {full}] (the logits' width).")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing),
                                            group, vocab_size)


def mask_padded_logits(logits: torch.Tensor, vocab_size: int, group: CommGroup) -> torch.Tensor:
    """Fill the padded vocabulary columns of this rank's logits with the dtype's minimum.

    exp(min - max) is exactly 0, so padding takes no probability mass, and the gradient into those
    columns is zero (masked_fill is not differentiable through the filled entries).
    """
    part = logits.shape[-1]
    real = _real_columns(part, group.rank, vocab_size)
    if real == part:
        return logits
    pad = torch.zeros(part, dtype=torch.bool, device=logits.device)
    pad[real:] = True
    return logits.masked_fill(pad, torch.finfo(logits.dtype).min)
