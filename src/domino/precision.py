"""Mixed precision: fp32 master weights, computed in bf16 (or fp16).

A model's parameters keep their own dtype (fp32): they are the master weights the optimizer
updates and checkpoints hold, and their ``.grad`` is the fp32 main gradient every micro-batch's
and piece's weight gradient is added into. Modules multiply by the parameter's *compute copy*
instead (:func:`compute`, or :func:`compute_copy` inside a custom autograd function): the
parameter cast to the model's compute dtype once after each change - an optimizer step, a
checkpoint load, ZeRO's all-gather - and reused by every micro-batch and piece of the step, where
autocast would cast every weight again at every use. Gradients flowing back through a compute
copy are cast to the parameter's dtype where they are accumulated.

The compute dtype is a run-time choice (``RuntimeConfig.compute_dtype``); the model constructors
mark their parameters with it (:func:`set_compute_dtype`). A parameter without a mark, or whose
dtype already is the compute dtype (a model built in bf16), is used as it is.

Under ZeRO-1 the fp32 masters are sharded with the optimizer instead
(:class:`~domino.training.dist_optim.DistributedAdamW`): :func:`to_compute_dtype` turns the
parameters themselves into bf16 (no compute copies), while their ``.grad`` stays the fp32 main
gradient through PyTorch's ``Tensor.grad_dtype`` (the autograd engine casts each incoming
gradient to it before adding). Code that makes a gradient asks :func:`grad_dtype`.
"""

from __future__ import annotations

import torch
from torch import nn

# The precisions a command names (``--precision``) -> the compute dtype (None: the parameters').
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}


def precision_of(bf16: bool, fp16: bool) -> str:
    """The precision ``--bf16`` / ``--fp16`` name (a key of :data:`PRECISIONS`)."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


_MARK = "domino_compute_dtype"
_COPY = "_domino_compute_copy"


def set_compute_dtype(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Mark every parameter of ``module`` to be computed in ``dtype`` (None: its own dtype)."""
    for p in module.parameters():
        if dtype is None or dtype == p.dtype:
            if hasattr(p, _MARK):
                delattr(p, _MARK)
        else:
            setattr(p, _MARK, dtype)
        if hasattr(p, _COPY):
            delattr(p, _COPY)


def compute_dtype_of(p: torch.Tensor, default: torch.dtype | None = None) -> torch.dtype:
    """The dtype ``p`` is computed in: its mark, else ``default`` (else its own dtype)."""
    return getattr(p, _MARK, p.dtype if default is None else default)


def compute_copy(p: torch.Tensor | None) -> torch.Tensor | None:
    """``p`` in its compute dtype, without a gradient path (``p`` itself when unmarked). The cast
    is made again only when ``p`` changed since the last one (its version counter or storage)."""
    if p is None:
        return None
    dtype = getattr(p, _MARK, None)
    if dtype is None or dtype == p.dtype:  # unmarked, or turned (to_compute_dtype)
        return p
    key = (p._version, p.data_ptr(), p.device)
    cached = getattr(p, _COPY, None)
    if cached is None or cached[0] != key:
        cached = (key, _cast(p, dtype))
        setattr(p, _COPY, cached)
    return cached[1]


def _cast(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return p.detach().to(dtype)


def grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s gradient (``p.grad_dtype``: fp32 main gradients of a bf16 parameter
    whose masters the optimizer holds; by default ``p``'s own)."""
    dtype = p.grad_dtype if p.is_leaf else None
    return p.dtype if dtype is None else dtype


def zeros_grad(p: torch.Tensor) -> torch.Tensor:
    """A zero gradient for ``p`` (in :func:`grad_dtype`)."""
    return torch.zeros(p.shape, dtype=grad_dtype(p), device=p.device)


@torch.no_grad()
def to_compute_dtype(params) -> list[torch.Tensor]:
    """Turn every marked parameter into its compute dtype in place, its gradient staying in its
    old dtype (``grad_dtype``): the caller now holds the masters. The mark stays (what the
    model computes in); the parameter is its own compute copy. Returns the parameters turned."""
    turned = []
    for p in params:
        dtype = getattr(p, _MARK, None)
        if dtype is None or dtype == p.dtype:
            continue
        master = p.dtype
        p.data = p.data.to(dtype)
        p.grad = None
        p.grad_dtype = master
        if hasattr(p, _COPY):
            delattr(p, _COPY)
        turned.append(p)
    return turned


class _Cast(torch.autograd.Function):
    """The compute copy in the forward; the gradient, cast back to the master's dtype, in the
    backward (autograd adds it into the master's fp32 ``.grad``)."""

    @staticmethod
    def forward(ctx, master, copy):
        ctx.dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def compute(p: torch.Tensor | None) -> torch.Tensor | None:
    """``p`` in its compute dtype, with its gradient going to ``p`` (see the module doc)."""
    copy = compute_copy(p)
    if copy is p or copy is None:
        return copy
    if torch.is_grad_enabled() and p.requires_grad:
        return _Cast.apply(p, copy)
    return copy
