"""Tier 3: tensor-parallel layers (Megatron-style) over a CommGroup.

Initialisation is TP-invariant: every rank draws the *full* weight from the default generator
(on CPU, so the device does not change the numbers) and keeps its slice, so a given seed yields
the same full model at any TP size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from domino.precision import compute, compute_copy, grad_dtype, zeros_grad
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.lora import adapter_of
from domino.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from domino.tensor_parallel.placement import Placement, place, placement_of
from domino.utils import divide, even_splits

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def shard_of_full(full: torch.Tensor, dim: int, group: CommGroup, stride: int = 1) -> torch.Tensor:
    """This rank's part of ``full`` along ``dim``.

    With ``stride`` s the dimension is viewed as s equal blocks and the rank takes its slice of
    each (e.g. SwiGLU's [gate; up] weight: stride 2 gives every rank matching gate and up rows).
    """
    if group.size == 1:
        return full
    blocks = full.chunk(stride, dim=dim)
    parts = [b.chunk(group.size, dim=dim)[group.rank] for b in blocks]
    return torch.cat(parts, dim=dim).contiguous()


def init_sharded(full_shape: tuple[int, ...], init_method: InitMethod, dim: int,
                 group: CommGroup, dtype: torch.dtype, device: torch.device | None,
                 stride: int = 1, valid_rows: int | None = None) -> torch.Tensor:
    """Draw the full tensor with ``init_method`` and return this rank's shard.

    ``valid_rows`` (vocabulary padding): only the first rows are drawn, the rest are zero, so the
    random stream - and thus every real row - does not depend on how much padding TP needs.
    """
    if device is not None and torch.device(device).type == "meta":  # shapes only (sizing)
        shape = list(full_shape)
        shape[dim] //= group.size
        return torch.empty(shape, dtype=dtype, device="meta")
    rows = full_shape[0] if valid_rows is None else valid_rows
    full = torch.zeros(full_shape, dtype=torch.float32)
    with torch.no_grad():
        drawn = torch.empty((rows, *full_shape[1:]), dtype=torch.float32)
        init_method(drawn)
        full[:rows] = drawn
    shard = shard_of_full(full, dim, group, stride)
    return shard.to(device=device, dtype=dtype)


def gather_full(tensor: torch.Tensor, like: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard ``tensor`` of parameter ``like``
    (the inverse of :func:`shard_of_full`) over ``group``, the group its placement shards it
    over; replicated parameters are returned as they are."""
    placement = placement_of(like)
    if group.size == 1 or placement.shard is None:
        return tensor
    dim, stride = placement.dim, placement.stride
    moved = tensor.movedim(dim, -1).contiguous()
    full = group.all_gather_last_dim(moved)  # [..., size * shard]
    per_rank = full.chunk(group.size, dim=-1)
    blocks = [torch.cat([r.chunk(stride, dim=-1)[i] for r in per_rank], dim=-1)
              for i in range(stride)]
    return torch.cat(blocks, dim=-1).movedim(-1, dim)


class WgradStash(list):
    """Weight-gradient GEMMs deferred by the parallel linears for a schedule to run later,
    under an all-reduce, as ``(weight, bias, grad_output, input, rows)`` items (``rows``: the
    slice of the weight's output rows the GEMM used, or None for all), or as callables that
    accumulate a gradient themselves (an MoE layer's grouped expert GEMMs)."""

    @torch.no_grad()  # gradients are data: a W pass may run with grad mode on (pipelines)
    def run(self) -> None:
        """Compute and accumulate every deferred weight/bias gradient, then empty the stash."""
        for item in self:
            if callable(item):
                item()
                continue
            weight, bias, grad, x, rows = item
            wgrad = _wgrad(grad, x, grad_dtype(weight))
            if rows is None:
                _accumulate(weight, wgrad)
            else:
                if weight.grad is None:
                    weight.grad = zeros_grad(weight)
                weight.grad[rows] += wgrad
            if bias is not None:
                _accumulate(bias, grad.reshape(-1, grad.shape[-1]).sum(0).to(grad_dtype(bias)))
        self.clear()


def _wgrad(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    g2 = grad.reshape(-1, grad.shape[-1])
    return g2.t().matmul(x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(dtype)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _Linear(torch.autograd.Function):
    """y = x W[rows]^T + b whose backward computes dL/dx first and then either

    * all-reduces dL/dx asynchronously while it computes dL/dW (``group`` given: a standalone
      column-parallel layer), or
    * leaves dL/dx as it is and defers dL/dW to a :class:`WgradStash` (``stash`` given): a Domino
      schedule launches the all-reduce itself and runs the stash while it is in flight.

    With ``group`` and ``late`` (a schedule's :class:`~domino.transformer.late_work.LateWork`),
    dL/dW is computed in row chunks only while the all-reduce is in flight; the remaining chunks
    go to ``late``, for the stack's backward to run under its own last all-reduces.

    The forward multiplies by the weight's compute copy (:mod:`domino.precision`); the weight
    gradient is computed in the incoming gradient's dtype and accumulated in the weight's own
    (fp32 master gradients under mixed precision).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, stash, rows, late=None, seq=False):
        if seq:  # sequence parallel: x is this rank's shard; the GEMM needs the whole sequence
            x = group.all_gather_seq(x, name="fwd all_gather (head)")[0]
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.stash, ctx.bias, ctx.rows, ctx.late = group, stash, bias, rows, late
        ctx.seq = seq
        w = compute_copy(weight)  # the master's compute copy (precision.py); grads go to weight
        return F.linear(x, w if rows is None else w[rows], compute_copy(bias))

    @staticmethod
    def backward(ctx, grad):
        none = (None,) * 7
        x, weight = ctx.saved_tensors
        w = compute_copy(weight)
        w = w if ctx.rows is None else w[ctx.rows]
        grad_input = grad.matmul(w.to(grad.dtype))
        frozen = not weight.requires_grad  # LoRA's base weight: no dL/dW (nor its bias's)
        if ctx.stash is not None:
            if not frozen:
                ctx.stash.append((weight, ctx.bias, grad, x, ctx.rows))
            return grad_input, *none
        handle = None
        if ctx.group is not None and ctx.seq:  # the shard's summed gradient
            grad_input, handle = ctx.group.reduce_scatter_seq(
                grad_input, async_op=True, name="dgrad_reduce_scatter")
        elif ctx.group is not None:
            handle = ctx.group.all_reduce(grad_input, async_op=True, name="dgrad_all_reduce")
        if frozen:
            if handle is not None:
                handle.wait()
            return grad_input, *none
        if ctx.late is not None and ctx.rows is None:
            _split_wgrad(weight, ctx.bias, grad, x, handle, ctx.late)
            if handle is not None:
                handle.wait()
            return grad_input, *none
        grad_weight = _wgrad(grad, x, grad_dtype(weight))  # runs while dL/dx is being reduced
        if ctx.rows is not None:
            full = zeros_grad(weight)
            full[ctx.rows] = grad_weight
            grad_weight = full
        grad_bias = None
        if ctx.bias is not None:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(grad_dtype(ctx.bias))
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


# Row chunks of a weight gradient split between its own all-reduce and a schedule's late work.
LATE_WGRAD_CHUNKS = 4


def _split_wgrad(weight, bias, grad, x, handle, late) -> None:
    """dL/dW (and dL/db) into ``late``'s staged gradients (see ``LateWork``): row chunks while
    ``handle`` is in flight (all of them without one), the rest as ``late`` work. Each chunk
    fills its own rows, so the result does not depend on where the split fell."""
    target = late.stage(weight)
    if bias is not None:
        late.stage(bias).add_(grad.reshape(-1, grad.shape[-1]).sum(0).to(grad_dtype(bias)))
    chunks = column_chunks(weight.shape[0], LATE_WGRAD_CHUNKS)

    def rows_grad(rows: slice) -> None:
        target[rows] += _wgrad(grad[..., rows], x, grad_dtype(weight))

    for i, rows in enumerate(chunks):
        if handle is not None and handle.ready():
            for r in chunks[i:]:
                late.add(_RowsTask(rows_grad, r))
            return
        rows_grad(rows)


@dataclass(eq=False)
class _RowsTask:
    """Late work: one row chunk of a weight gradient."""

    fn: Callable[[slice], None]
    rows: slice

    @torch.no_grad()
    def run(self) -> None:
        self.fn(self.rows)


def column_chunks(width: int, chunks: int) -> list[slice]:
    """``chunks`` contiguous slices covering ``range(width)``, sizes differing by at most one
    (fewer when ``width`` is smaller)."""
    return [slice(a, b) for a, b in even_splits(width, min(chunks, width))]


def linear_reduce_input_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             group: CommGroup, late=None,
                             sequence_parallel: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a column-parallel weight shard whose input is replicated:
    backward all-reduces dL/dx over ``group``, launched before and waited for after the
    weight-gradient GEMM, so the GEMM hides it (what a copy-to-region + linear pair would run
    one after the other). With ``late`` (a schedule's ``LateWork``) the part of the GEMM the
    all-reduce does not need to hide is left to the schedule (see :class:`_Linear`).

    ``sequence_parallel``: x is this rank's sequence shard [s / tp, ...]; it is all-gathered
    for the GEMM, and dL/dx is reduce-scattered back to the shard instead of all-reduced."""
    seq = sequence_parallel and group.size > 1
    grad_on = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if grad_on and (group.size > 1 or late is not None):
        return _Linear.apply(x, weight, bias, group if group.size > 1 else None, None, None,
                             late, seq)
    if seq:
        x = group.all_gather_seq(x, name="fwd all_gather (head)")[0]
    return F.linear(x, compute(weight), compute(bias))


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (output columns) over the TP group.

    Returns ``(output, bias)``; ``bias`` is not None only with ``skip_bias_add`` (the caller fuses
    it later). ``gather_output`` concatenates the shards; otherwise each rank keeps ``out/tp``.
    """

    def __init__(self, input_size: int, output_size: int, *, group: CommGroup,
                 bias: bool = True, gather_output: bool = False, skip_bias_add: bool = False,
                 init_method: InitMethod, stride: int = 1,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | None = None):
        super().__init__()
        self.group, self.gather_output, self.skip_bias_add = group, gather_output, skip_bias_add
        self.stride = stride
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, group.size)
        self.weight = nn.Parameter(init_sharded((output_size, input_size), init_method, 0, group,
                                                params_dtype, device, stride))
        self.bias = (nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype,
                                              device=device)) if bias else None)
        place(self.weight, Placement("tp", 0, stride))
        if self.bias is not None:
            place(self.bias, Placement("tp", 0, stride))

    def forward(self, x: torch.Tensor, reduce_input_grad: bool = True,
                wgrad_stash: WgradStash | None = None):
        """``reduce_input_grad=False`` leaves dL/dx partial: a Domino schedule reduces it (and
        may pass ``wgrad_stash`` to run the weight-gradient GEMM under that all-reduce)."""
        bias = None if self.skip_bias_add else self.bias
        grad_on = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if grad_on and wgrad_stash is not None:
            out = _Linear.apply(x, self.weight, bias, None, wgrad_stash, None)
        elif reduce_input_grad:
            out = linear_reduce_input_grad(x, self.weight, bias, self.group)
        else:
            out = F.linear(x, compute(self.weight), compute(bias))
        lora = adapter_of(self)
        if lora is not None:
            out = out + lora(x)
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.group)
            if self.stride > 1 and self.group.size > 1:
                # Ranks hold [block0 part r, block1 part r, ...]: restore the full order.
                lead, width = out.shape[:-1], out.shape[-1]
                out = out.reshape(*lead, self.group.size, self.stride,
                                  width // (self.group.size * self.stride))
                out = out.transpose(-3, -2).reshape(*lead, width)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (input rows); partial sums are all-reduced.

    Returns ``(output, bias)`` like :class:`ColumnParallelLinear`. The bias is replicated and
    added after the reduction (once, not once per rank). ``input_is_parallel`` is Megatron's
    spelling; only True (the input is already split, as a column-parallel layer leaves it) is
    supported.
    """

    def __init__(self, input_size: int, output_size: int, *, group: CommGroup,
                 bias: bool = True, input_is_parallel: bool = True, skip_bias_add: bool = False,
                 init_method: InitMethod, params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None):
        super().__init__()
        if not input_is_parallel:
            raise ValueError("RowParallelLinear(input_is_parallel=False) is not supported: "
                             "feed it the split input a ColumnParallelLinear produces (or "
                             "scatter_to_tensor_model_parallel_region(x, group)) with "
                             "input_is_parallel=True.")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, group.size)
        self.weight = nn.Parameter(init_sharded((output_size, input_size), init_method, 1, group,
                                                params_dtype, device))
        self.bias = (nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
                     if bias else None)
        place(self.weight, Placement("tp", 1))

    def partial(self, x: torch.Tensor, columns: slice | None = None,
                wgrad_stash: WgradStash | None = None) -> torch.Tensor:
        """This rank's partial sum X_r A_r^T (optionally only some output columns), no bias.
        With ``wgrad_stash`` the weight-gradient GEMM is deferred to it (see :class:`_Linear`)."""
        if wgrad_stash is not None and torch.is_grad_enabled():
            out = _Linear.apply(x, self.weight, None, None, wgrad_stash, columns)
        else:
            weight = compute(self.weight)
            out = F.linear(x, weight if columns is None else weight[columns])
        lora = adapter_of(self)
        return out if lora is None else out + lora(x, columns)

    def forward(self, x: torch.Tensor):
        out = reduce_from_tensor_model_parallel_region(self.partial(x), self.group)
        if self.skip_bias_add or self.bias is None:
            return out, self.bias
        return out + compute(self.bias), None


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary is split over the TP group.

    Each rank looks up the ids in its vocabulary range and the partial results are all-reduced.
    Rows past ``real_num_embeddings`` are padding: zero, never looked up.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: CommGroup,
                 init_method: InitMethod, real_num_embeddings: int | None = None,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | None = None):
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.real_num_embeddings = real_num_embeddings or num_embeddings
        self.per_partition = divide(num_embeddings, group.size)
        self.vocab_start = group.rank * self.per_partition
        self.vocab_end = self.vocab_start + self.per_partition
        self.weight = nn.Parameter(init_sharded((num_embeddings, embedding_dim), init_method, 0,
                                                group, params_dtype, device,
                                                valid_rows=self.real_num_embeddings))
        place(self.weight, Placement("tp", 0, rows=self.real_num_embeddings))

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's lookups (zero for ids outside its vocabulary range): summed over the TP
        group they are the embeddings (a schedule launches that all-reduce itself)."""
        if self.group.size == 1:
            return F.embedding(ids, compute(self.weight))
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        return F.embedding(local, compute(self.weight)).masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(self.partial(ids), self.group)

