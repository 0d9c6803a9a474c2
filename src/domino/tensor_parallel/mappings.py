"""Tier 2: autograd-aware moves of tensors into and out of the tensor-parallel region.

Each Function's backward is the adjoint of its forward, so gradients are right whatever the
caller does with the result. ``group`` is a :class:`~domino.tensor_parallel.comm.CommGroup`.
"""

from __future__ import annotations

import torch

from domino.tensor_parallel.comm import CommGroup


def _summed(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """A copy of ``x`` all-reduced (summed) over ``group``."""
    out = x.clone()
    group.all_reduce(out)
    return out


class _CopyToRegion(torch.autograd.Function):
    """Forward identity; backward all-reduce (the input fans out to every rank's shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward all-reduce (sum of partial results); backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOver(_CopyToRegion):
    """Forward all-reduce; backward all-reduce (:class:`_CopyToRegion`'s): every rank's input
    reaches every rank's result, and each rank's result feeds its own different work (a norm
    over features split across the ranks), so each input's gradient is the sum of all ranks'
    gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _summed(x, group)


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim; backward: gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return group.split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather_last_dim(grad.contiguous()), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: concatenate every rank's slice of the last dim; backward: split."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return group.all_gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.split_last_dim(grad), None


class _SumGrads(torch.autograd.Function):
    """Identity on tensors replicated over ``group`` whose gradients each rank computes only in
    part (a per-head norm's weights, each rank holding other heads): backward sums them over
    ``group`` in one all-reduce."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        ctx.like = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([(g if g is not None else torch.zeros(shape, dtype=dtype,
                                                               device=device)).reshape(-1)
                          for g, (shape, dtype, device) in zip(grads, ctx.like, strict=True)])
        ctx.group.all_reduce(flat, name="replicated grads (sum)")
        parts = flat.split([shape.numel() for shape, _, _ in ctx.like])
        return (None, *(p.view(shape) for p, (shape, _, _) in zip(parts, ctx.like,
                                                                   strict=True)))


def sum_grads_over(tensors: list[torch.Tensor], group: CommGroup) -> list[torch.Tensor]:
    """``tensors`` as they are, their gradients summed over ``group`` in backward."""
    if group.size == 1 or not torch.is_grad_enabled() or not any(
            t.requires_grad for t in tensors):
        return list(tensors)
    return list(_SumGrads.apply(group, *tensors))


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` exchanged over ``group`` (``in_splits[q]`` rows to rank q,
    ``out_splits[q]`` rows from it); backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, name):
        ctx.group, ctx.splits, ctx.name = group, (out_splits, in_splits), name
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        group.all_to_all(out, x.contiguous(), out_splits, in_splits, name=name)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        ctx.group.all_to_all(back, grad.contiguous(), in_splits, out_splits,
                             name=ctx.name + " (backward)")
        return back, None, None, None, None


def all_to_all_rows(x: torch.Tensor, group: CommGroup, out_splits: list[int],
                    in_splits: list[int], name: str = "all_to_all") -> torch.Tensor:
    """Differentiable uneven all-to-all of ``x``'s rows (see :class:`_AllToAll`)."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits), name)


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return _CopyToRegion.apply(x, group) if group.size > 1 else x


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group) if group.size > 1 else x


def sum_over(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """The sum of ``x`` over ``group``'s ranks, differentiable (see :class:`_SumOver`)."""
    return _SumOver.apply(x, group) if group.size > 1 else x


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return _ScatterToRegion.apply(x, group) if group.size > 1 else x


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return _GatherFromRegion.apply(x, group) if group.size > 1 else x


# -- sequence parallelism: the sequence dim (first of [s, b, h]) is split over the TP ranks ------

class _GatherFromSequence(torch.autograd.Function):
    """Forward: every rank's sequence shard -> the whole sequence, for work every rank repeats
    on it (the pooler); its gradient is then the same on every rank, which keeps its shard.
    (What feeds a TP region instead reduce-scatters its partial gradient: the LM head's
    ``linear_reduce_input_grad(..., sequence_parallel=True)``, the schedule's own pieces.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return group.all_gather_seq(x)[0]

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.seq_shard(grad).clone(), None


def gather_from_sequence_parallel_region(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """[s / tp, ...] shards -> [s, ...] (see :class:`_GatherFromSequence`)."""
    return _GatherFromSequence.apply(x, group) if group.size > 1 else x
