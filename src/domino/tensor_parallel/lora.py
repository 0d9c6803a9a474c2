"""Tier 3: LoRA adapters on the tensor-parallel linears, laid out so they add no collective.

A LoRA adapter adds ``scale * B A x`` (``A`` [r, in], ``B`` [out, r], ``scale = alpha / r``)
to a linear's output. Its factors follow the linear's TP layout:

* column-parallel (output rows split): ``B`` is split with the output rows (and the weight's
  stride: SwiGLU's gate and up rows), ``A`` is replicated. Each rank computes ``A x`` on the
  replicated input and its own rows of ``B A x``: the output shard the weight's own is.
* row-parallel (input columns split): ``A`` is split with the input columns, ``B`` is
  replicated. ``B A_r x_r`` is this rank's share of ``B A x``; it joins the weight's partial sum
  and the exit's all-reduce sums both.

So the forward and the schedule's collectives are the linear's own. The replicated factor
(``A`` of a column-parallel linear, ``B`` of a row-parallel one) meets a TP-split gradient,
so each rank holds a partial gradient of it: :class:`~domino.transformer.sp_grads.ShardGrads`
sums those over TP as each block finishes its backward (a placement with
``tp_partial_grad``), as it sums the norms' under sequence parallelism.

Dropout on the adapter's input draws its mask for the whole (unsplit) input from the
replicated stream, and a row-parallel rank keeps its columns: under the same Domino plan (the
micro-batch split decides the draws, as for the hidden dropout) the masks do not depend on the
TP size, and full recomputation replays them with the other dropout streams.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from domino.precision import compute
from domino.tensor_parallel.placement import Placement, place
from domino.tensor_parallel.random import RNGTracker

# Where a linear keeps its adapter (``linear.lora``), and its factors' names below it.
ATTRIBUTE = "lora"
FACTORS = ("a", "b")


class LoraAdapter(nn.Module):
    """The adapter of one column- or row-parallel linear (``kind``), holding this rank's
    parts of A and B (see the module docstring); B starts at zero, so a new adapter changes
    nothing."""

    def __init__(self, kind: str, full_in: int, full_out: int, rank: int, alpha: float,
                 dropout: float, tp_rank: int, tp_size: int, rng: RNGTracker,
                 stride: int = 1, device: torch.device | None = None) -> None:
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"LoraAdapter(kind={kind!r}): 'column' or 'row'")
        self.kind, self.rank, self.alpha, self.dropout = kind, rank, alpha, dropout
        self.scale = alpha / rank
        self.tp_rank, self.tp_size, self.rng = tp_rank, tp_size, rng
        self.full_in, self.full_out, self.stride = full_in, full_out, stride
        column = kind == "column"
        a_in = full_in if column else full_in // tp_size
        b_out = full_out // tp_size if column else full_out
        self.a = nn.Parameter(torch.zeros(rank, a_in, dtype=torch.float32, device=device))
        self.b = nn.Parameter(torch.zeros(b_out, rank, dtype=torch.float32, device=device))
        if column:
            place(self.a, Placement(tp_partial_grad=tp_size > 1))
            place(self.b, Placement("tp", 0, stride))
        else:
            place(self.a, Placement("tp", 1))
            place(self.b, Placement(tp_partial_grad=tp_size > 1))
        self._mask: tuple[weakref.ref, torch.Tensor] | None = None

    def extra_repr(self) -> str:
        return f"{self.kind}, rank={self.rank}, alpha={self.alpha:g}, dropout={self.dropout:g}"

    @torch.no_grad()
    def reset(self, generator: torch.Generator) -> None:
        """PEFT's start: A Kaiming-uniform (a = sqrt(5), over the full input), B zero; A is
        drawn whole from ``generator`` and this rank keeps its part (TP-invariant)."""
        full = torch.empty(self.rank, self.full_in, dtype=torch.float32)
        bound = 1.0 / math.sqrt(self.full_in)  # kaiming_uniform_ with a = sqrt(5)
        full.uniform_(-bound, bound, generator=generator)
        if self.kind == "row" and self.tp_size > 1:
            full = full.chunk(self.tp_size, dim=1)[self.tp_rank]
        self.a.copy_(full)
        self.b.zero_()

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """``A x`` (this rank's share of it for a row-parallel adapter), dropout applied to x."""
        return torch.matmul(self._dropped(x), compute(self.a).t().to(x.dtype))

    def up(self, ax: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """``scale * B (A x)``, for only some of B's output rows with ``rows``."""
        b = compute(self.b)
        b = b if rows is None else b[rows]
        return torch.matmul(ax, b.t().to(ax.dtype)) * self.scale

    def forward(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        return self.up(self.down(x), rows)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        keep = self._keep(x)
        return x * keep * (1.0 / (1.0 - self.dropout))

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        """The dropout mask of ``x``: one per input tensor (a row-parallel exit calls the
        adapter once per column chunk on the same input), drawn for the full width."""
        if self._mask is not None and self._mask[0]() is x:
            return self._mask[1]
        width = x.shape[-1] * (self.tp_size if self.kind == "row" else 1)
        keep = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
        keep.bernoulli_(1.0 - self.dropout, generator=self.rng.replicated(x.device))
        if self.kind == "row" and self.tp_size > 1:
            keep = keep.chunk(self.tp_size, dim=-1)[self.tp_rank].clone()
        self._mask = (weakref.ref(x), keep)
        return keep


def adapter_of(linear: nn.Module) -> LoraAdapter | None:
    """The adapter a linear carries, or None."""
    return getattr(linear, ATTRIBUTE, None)
