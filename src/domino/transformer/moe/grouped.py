"""The experts' grouped GEMM, with a weight gradient a schedule can defer.

``grouped_linear(x, weight, offs, experts, stash)`` is ``F.grouped_mm(x, weight[experts],
offs=offs)`` for rows ``x`` [N, k] sorted by expert and stacked weights [E, k, n]; its backward
computes the input gradient at once (the exchange back to the token's rank waits for it) and the
weight gradient, per expert ``x_e^T g_e``, either then or - with a
:class:`~domino.tensor_parallel.layers.WgradStash` - later, when the Domino schedule would
otherwise wait on an all-to-all (the experts' analogue of the deferred dW GEMMs of the TP
layers). Like those, it multiplies by the weight's compute copy (:mod:`domino.precision`) and
accumulates the gradient in the weight's own gradient dtype.

On CUDA both directions are PyTorch's grouped GEMM kernels; on a CPU PyTorch runs each as a
loop over the groups inside one operator, and the weight gradient is a loop of GEMMs that
accumulate into the gradient themselves (``addmm_``: no temporary and no extra pass over the
gradient per micro-batch).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from domino.precision import compute_copy, grad_dtype, zeros_grad
from domino.tensor_parallel.layers import WgradStash

# grouped_mm reads a [k, N] view of the rows for the weight gradient: its row stride (N
# elements) must be a multiple of 16 bytes, so N is padded with zero rows up to one.
_STRIDE_BYTES = 16


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offs, experts, stash):
        ctx.save_for_backward(x, offs)
        ctx.weight, ctx.experts, ctx.stash = weight, experts, stash
        return F.grouped_mm(x, compute_copy(weight)[experts], offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs = ctx.saved_tensors
        grad = grad.contiguous()
        w = compute_copy(ctx.weight)[ctx.experts]
        grad_x = F.grouped_mm(grad, w.transpose(-2, -1).to(grad.dtype), offs=offs)
        task = partial(_weight_grad, ctx.weight, ctx.experts, x, grad, offs)
        if not ctx.weight.requires_grad:  # frozen (LoRA's base): no weight gradient
            pass
        elif ctx.stash is not None:
            ctx.stash.append(task)
        else:
            task()
        return grad_x, None, None, None, None


@torch.no_grad()
def _weight_grad(weight: torch.Tensor, experts: slice, x: torch.Tensor, grad: torch.Tensor,
                 offs: torch.Tensor) -> None:
    """weight.grad[experts] += x_e^T grad_e for every expert e (its rows end at ``offs[e]``)."""
    if x.device.type == "cpu" and grad.dtype == grad_dtype(weight):
        _weight_grad_in_place(weight, experts, x.to(grad.dtype), grad, offs)
        return
    if weight.grad is None:
        weight.grad = zeros_grad(weight)
    n = x.shape[0]
    if n == 0:
        return
    step = max(1, _STRIDE_BYTES // x.element_size())
    pad = -n % step
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        grad = torch.cat([grad, grad.new_zeros(pad, grad.shape[1])])
    wgrad = F.grouped_mm(x.t().to(grad.dtype), grad, offs=offs)
    weight.grad[experts] += wgrad.to(grad_dtype(weight))


def _weight_grad_in_place(weight: torch.Tensor, experts: slice, x: torch.Tensor,
                          grad: torch.Tensor, offs: torch.Tensor) -> None:
    """:func:`_weight_grad` on a CPU, where ``grouped_mm`` is a loop of GEMMs anyway: each
    expert's GEMM writes (the step's first) or accumulates (``addmm_``) into its gradient
    itself, with no padded copies of the rows, no temporary and no pass adding it (a Domino
    split runs this once per micro-batch: that pass would grow with the split)."""
    local = range(weight.shape[0])[experts]
    first = weight.grad is None and len(local) == weight.shape[0]
    if weight.grad is None:  # (a group of experts: the others' gradients start at zero)
        weight.grad = (torch.empty(weight.shape, dtype=grad_dtype(weight), device=weight.device)
                       if first else zeros_grad(weight))
    start = 0
    for e, end in zip(local, offs.tolist(), strict=True):
        xe, ge = x[start:end].t(), grad[start:end]
        if first:
            torch.mm(xe, ge, out=weight.grad[e])
        else:
            weight.grad[e].addmm_(xe, ge)
        start = end


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                   experts: slice = slice(None), stash: WgradStash | None = None) -> torch.Tensor:
    """x [N, k] (rows sorted by expert; expert e's end at ``offs[e]``) times the experts
    ``weight[experts]`` [E', k, n] -> [N, n]; ``stash`` defers the weight gradient."""
    return _GroupedLinear.apply(x, weight, offs, experts, stash)
