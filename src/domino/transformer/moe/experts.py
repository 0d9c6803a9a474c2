"""The experts of an MoE layer and the local token shuffle around them.

:class:`GroupedExperts` holds a rank's experts as two stacked weights, ``fc1`` [E, h, f'] (f' =
2 x ffn for SwiGLU: ``[gate | up]``) and ``fc2`` [E, ffn, h], and computes every expert's GEMM in
one ``torch.nn.functional.grouped_mm`` over the tokens sorted by expert (``offs``: where each
expert's rows end; :mod:`.grouped`, whose backward can defer the weight gradients). On CUDA
that is PyTorch's grouped GEMM kernel; on a CPU PyTorch runs it as a loop over the groups inside
one operator (measured here: the same time as a Python loop of ``matmul``), so the code is the
same on both and a rank with many experts is one call.

:func:`permute` sorts a piece's (token, slot) assignments by expert (stable: in token order
within an expert) and applies the capacity, if any: an expert keeps at most ``capacity``
assignments, the first ones in token order (``drop_policy="position"``) or those with the highest
weights (``"probs"``, Megatron's default); the rest are dropped (their slot adds nothing to the
token's output). With ``pad`` every expert's group is padded with zero rows to exactly
``capacity``, a fixed shape. :func:`unpermute` weights the experts' outputs and adds them back into
their tokens. Expert parallelism will exchange the sorted rows between these two steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from domino.precision import compute
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.layers import WgradStash, init_sharded
from domino.tensor_parallel.placement import Placement, place
from domino.transformer.kernels import activation
from domino.transformer.moe.grouped import grouped_linear
from domino.utils import divide

DROP_POLICIES = ("probs", "position")


def capacity_of(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Assignments an expert keeps of ``tokens`` tokens (a sequence's, in a model):
    ``ceil(tokens * topk / num_experts * factor)``."""
    if not factor > 0:
        raise ValueError(f"capacity factor {factor} must be > 0 (or None for dropless)")
    return max(1, math.ceil(tokens * topk / num_experts * factor))


@dataclass
class Permuted:
    """A piece's assignments sorted by expert: ``x`` [N, h] the rows the experts read, ``counts``
    [E] rows per expert (long), and for each row its token (``tokens``) and weight (``weights``;
    padding rows: token 0, weight 0). ``dropped``: assignments the capacity dropped."""

    x: torch.Tensor
    counts: torch.Tensor
    tokens: torch.Tensor
    weights: torch.Tensor
    dropped: int


def _sorted(flat_e: torch.Tensor, flat_w: torch.Tensor, capacity: int | None,
            drop_policy: str) -> torch.Tensor:
    """The (token, slot) assignments in expert order: within an expert in token order, or with
    a capacity under ``"probs"`` best weight first (ties: token order), so the capacity keeps
    the first ones."""
    if capacity is not None and drop_policy == "probs":
        rank_in = torch.argsort(flat_w.detach(), descending=True, stable=True)
        return rank_in[torch.argsort(flat_e[rank_in], stable=True)]
    return torch.argsort(flat_e, stable=True)


def _positions(key: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Each element's place among the elements of its key, in the order given."""
    by_key = torch.argsort(key, stable=True)
    in_key = torch.bincount(key, minlength=num_keys)
    starts = torch.cumsum(in_key, 0) - in_key
    position = torch.empty_like(key)
    position[by_key] = torch.arange(key.numel(), device=key.device) - starts[key[by_key]]
    return position


def capacity_keep(experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                  capacity: int, drop_policy: str = "probs", sequences: int = 1) -> torch.Tensor:
    """Which of the assignments ``experts`` / ``weights`` [T, k] an expert keeps (bool [T x k],
    in (token, slot) order): the rule :func:`permute` applies, decided for all T tokens of a
    block. Ranks that hold parts of the same sequences (sequence parallelism) decide on the
    gathered routing and keep their own part."""
    t, k = experts.shape
    flat_e = experts.reshape(-1)
    flat_t = torch.arange(t, device=experts.device).repeat_interleave(k)
    order = _sorted(flat_e, weights.reshape(-1), capacity, drop_policy)
    key = flat_e[order] * sequences + flat_t[order] % sequences
    keep = torch.empty(t * k, dtype=torch.bool, device=experts.device)
    keep[order] = _positions(key, num_experts * sequences) < capacity
    return keep


def permute(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
            capacity: int | None = None, drop_policy: str = "probs",
            pad: bool = False, sequences: int = 1, keep: torch.Tensor | None = None) -> Permuted:
    """x [T, h], experts / weights [T, k] -> the rows sorted by expert (see the module doc).
    With ``sequences`` > 1 the T tokens are a flattened [s, sequences] block (token t belongs
    to sequence ``t % sequences``) and ``capacity`` is per expert and sequence. ``keep`` (bool
    [T x k], :func:`capacity_keep`): the capacity's decision, made where more tokens are seen
    (every rank's part of the sequences); padding then fills this block's rows up to it."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r} must be one of {', '.join(DROP_POLICIES)}")
    t, k = experts.shape
    flat_e = experts.reshape(-1)
    flat_w = weights.reshape(-1)
    flat_t = torch.arange(t, device=x.device).repeat_interleave(k)
    order = _sorted(flat_e, flat_w, capacity, drop_policy)
    sorted_e = flat_e[order]
    counts = torch.bincount(flat_e, minlength=num_experts)
    dropped = 0
    if capacity is not None:
        # Each (expert, sequence) keeps its first ``capacity`` rows in the expert's order.
        n_keys = num_experts * sequences
        if keep is None:
            kept = _positions(sorted_e * sequences + flat_t[order] % sequences, n_keys) < capacity
        else:
            kept = keep[order]
        dropped = int((~kept).sum())
        order, sorted_e = order[kept], sorted_e[kept]
        counts = torch.bincount(sorted_e, minlength=num_experts)
        if pad:
            # each kept row's place in [E, sequences, capacity]
            sequence = flat_t[order] % sequences
            slot = sequence * capacity + _positions(sorted_e * sequences + sequence, n_keys)
            per_expert = capacity * sequences
            rows = sorted_e * per_expert + slot
            n = num_experts * per_expert
            tokens = torch.zeros(n, dtype=torch.long, device=x.device)
            tokens[rows] = flat_t[order]
            w = flat_w.new_zeros(n).index_put((rows,), flat_w[order])
            xs = x.new_zeros(n, x.shape[-1]).index_put((rows,), x[flat_t[order]])
            full = torch.full_like(counts, per_expert)
            return Permuted(xs, full, tokens, w, dropped)
    tokens = flat_t[order]
    return Permuted(x[tokens], counts, tokens, flat_w[order], dropped)


def unpermute(y: torch.Tensor, permuted: Permuted, num_tokens: int) -> torch.Tensor:
    """The experts' outputs y [N, h] (rows as :func:`permute` sorted them), each weighted and
    added into its token -> [T, h] (fp32 weights applied in y's dtype)."""
    out = y.new_zeros(num_tokens, y.shape[-1])
    return out.index_add(0, permuted.tokens, y * permuted.weights.to(y.dtype).unsqueeze(-1))


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs h -> ffn -> h (GELU or SwiGLU) as stacked weights; with
    expert parallelism, the ``ep.size``-th share of them this rank holds (``ep.rank``'s, in
    order), initialised as that slice of the unsharded experts (the same model at any EP).
    ``bias``: each expert's fc1 and fc2 have a bias (``fc1_bias`` [E, f'], ``fc2_bias`` [E, h],
    zeros at first: GPT-OSS's); ``glu``: the activation's (alpha, offset, clamp)
    (:func:`~domino.transformer.kernels.activation`)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 swiglu: bool, gelu_approximate: str = "none", init_method_std: float = 0.02,
                 output_std: float | None = None, params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, ep: CommGroup | None = None,
                 bias: bool = False, glu: tuple = (1.0, 0.0, None)) -> None:
        super().__init__()
        ep = ep if ep is not None else CommGroup()
        self.swiglu, self.gelu_approximate, self.glu = swiglu, gelu_approximate, glu
        self.num_experts = divide(num_experts, ep.size)  # this rank's
        width = ffn_hidden_size * (2 if swiglu else 1)
        std2 = init_method_std if output_std is None else output_std
        self.fc1 = nn.Parameter(init_sharded((num_experts, hidden_size, width), _normal(
            init_method_std), 0, ep, params_dtype, device))
        self.fc2 = nn.Parameter(init_sharded((num_experts, ffn_hidden_size, hidden_size),
                                             _normal(std2), 0, ep, params_dtype, device))
        self.fc1_bias = self.fc2_bias = None
        if bias:
            local = self.num_experts
            self.fc1_bias = nn.Parameter(torch.zeros(local, width, dtype=params_dtype,
                                                     device=device))
            self.fc2_bias = nn.Parameter(torch.zeros(local, hidden_size, dtype=params_dtype,
                                                     device=device))
        for p in (self.fc1, self.fc2, self.fc1_bias, self.fc2_bias):
            if p is not None:  # reduced over expert-DP, sharded over EP by expert
                place(p, Placement(shard="ep" if ep.size > 1 else None,
                                   grad_group="expert_dp"))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, stash: WgradStash | None = None,
                experts: slice = slice(None)) -> torch.Tensor:
        """x [N, h] sorted by expert, ``counts`` rows per expert of ``experts`` (this rank's;
        all of them by default) -> [N, h]; ``stash`` defers the weight-gradient GEMMs."""
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = self._biased(self._linear("fc1", x, offs, experts, stash), self.fc1_bias,
                         counts, experts)
        h = activation(h, self.swiglu, self.gelu_approximate, False, *self.glu)
        return self._biased(self._linear("fc2", h, offs, experts, stash), self.fc2_bias,
                            counts, experts)

    def _linear(self, name: str, x: torch.Tensor, offs: torch.Tensor, experts: slice,
                stash: WgradStash | None) -> torch.Tensor:
        """The grouped GEMM by ``fc1`` or ``fc2``, plus its LoRA adapters' (``self.lora``:
        :class:`~domino.transformer.moe.lora.ExpertLora`, when the run has them)."""
        y = grouped_linear(x, getattr(self, name), offs, experts, stash)
        lora = getattr(self, "lora", None)
        delta = None if lora is None else lora.delta(name, x, offs, experts)
        return y if delta is None else y + delta

    @staticmethod
    def _biased(y: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor,
                experts: slice) -> torch.Tensor:
        """y [N, n] (rows sorted by expert, ``counts`` each) + each row's expert's bias."""
        if bias is None:
            return y
        rows = compute(bias)[experts].to(y.dtype)
        return y + rows.repeat_interleave(counts, dim=0, output_size=y.shape[0])


def _normal(std: float):
    return lambda t: t.normal_(0.0, std)
