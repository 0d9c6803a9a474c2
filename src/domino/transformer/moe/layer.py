"""The MoE MLP: a router, a rank's grouped experts and an optional shared expert, in place of
the dense MLP of a layer.

For each token: the router picks ``topk`` experts and their weights, the token's row goes to each
chosen expert (sorted by expert, capacity applied: :func:`~.experts.permute`), every expert's MLP
runs as one grouped GEMM, and the weighted outputs are added back into the token. A shared expert
(Qwen-MoE, DeepSeek) is a dense MLP every token goes through, optionally scaled by a sigmoid
gate of the token (Qwen's ``shared_expert_gate``); its output is added to the routed one.

With expert parallelism (``ep``, a group of ranks with different tokens) a rank holds 1/EP of
the experts and the sorted rows go to the ranks holding their experts and back
(:mod:`.dispatch`); routing, the capacity and the shared expert stay on the token's rank. At
TP > 1 the experts are whole on each rank (expert tensor parallelism 1) and, under sequence
parallelism, each TP rank routes the tokens of its own sequence shard; under context
parallelism each CP rank those of its chunks (``route(shards=...)``, :mod:`.shards`); the
schedule's edges (:mod:`.edges`) overlap the exchanges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from domino.precision import compute
from domino.tensor_parallel.comm import CommGroup
from domino.transformer.kernels import activation
from domino.transformer.moe.dispatch import combine, dispatch
from domino.transformer.moe.experts import (
    GroupedExperts,
    Permuted,
    capacity_keep,
    capacity_of,
    permute,
    unpermute,
)
from domino.transformer.moe.router import RouterStats, TopKRouter
from domino.transformer.moe.shards import TokenShards


class SharedExpert(nn.Module):
    """A dense MLP h -> ffn -> h every token goes through, with an optional sigmoid gate."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, swiglu: bool,
                 gelu_approximate: str = "none", gate: bool = False,
                 init_method_std: float = 0.02, params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, glu: tuple = (1.0, 0.0, None)) -> None:
        super().__init__()
        self.swiglu, self.gelu_approximate, self.glu = swiglu, gelu_approximate, glu
        width = ffn_hidden_size * (2 if swiglu else 1)

        def param(*shape: int) -> nn.Parameter:
            p = nn.Parameter(torch.empty(*shape, dtype=params_dtype, device=device))
            if not p.is_meta:
                with torch.no_grad():
                    p.normal_(0.0, init_method_std)
            return p

        self.fc1, self.fc2 = param(width, hidden_size), param(hidden_size, ffn_hidden_size)
        self.gate = param(1, hidden_size) if gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = activation(F.linear(x, compute(self.fc1)), self.swiglu, self.gelu_approximate,
                       False, *self.glu)
        out = F.linear(h, compute(self.fc2))
        if self.gate is not None:
            out = out * torch.sigmoid(F.linear(x, compute(self.gate)))
        return out


class MoEMLP(nn.Module):
    """Router + ``num_experts`` grouped experts (+ a shared expert); see the module docstring.
    ``capacity_factor`` None routes dropless; ``pad_to_capacity`` pads every expert's rows to its
    capacity (a fixed shape). ``router_bias``: a learned bias on the router's logits;
    ``expert_linear_bias``: biases on each expert's fc1 and fc2; ``glu``: the gated activation's
    (alpha, offset, clamp) (GPT-OSS's three)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, topk: int, *,
                 swiglu: bool = True, gelu_approximate: str = "none",
                 score_function: str = "softmax", renormalize: bool = True,
                 scaling: float = 1.0, expert_bias: bool = False,
                 capacity_factor: float | None = None, drop_policy: str = "probs",
                 pad_to_capacity: bool = False, shared_ffn_hidden_size: int | None = None,
                 shared_gate: bool = False, init_method_std: float = 0.02,
                 output_std: float | None = None, params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, ep: CommGroup | None = None,
                 force_balance: bool = False, router_bias: bool = False,
                 expert_linear_bias: bool = False, glu: tuple = (1.0, 0.0, None)) -> None:
        super().__init__()
        self.ep = ep if ep is not None else CommGroup()
        if num_experts % self.ep.size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel "
                             f"size {self.ep.size}: pick an expert count EP divides")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None: "
                             "dropless routing)")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError("pad_to_capacity needs a capacity_factor (dropless routing has no "
                             "capacity to pad to)")
        self.num_experts, self.topk = num_experts, topk
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.pad_to_capacity = pad_to_capacity
        self.router = TopKRouter(hidden_size, num_experts, topk, score_function=score_function,
                                 renormalize=renormalize, scaling=scaling,
                                 expert_bias=expert_bias, init_method_std=init_method_std,
                                 params_dtype=params_dtype, device=device,
                                 force_balance=force_balance, bias=router_bias)
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_hidden_size, swiglu=swiglu,
                                      gelu_approximate=gelu_approximate,
                                      init_method_std=init_method_std, output_std=output_std,
                                      params_dtype=params_dtype, device=device, ep=self.ep,
                                      bias=expert_linear_bias, glu=glu)
        self.shared = None
        if shared_ffn_hidden_size:
            self.shared = SharedExpert(hidden_size, shared_ffn_hidden_size, swiglu=swiglu,
                                       gelu_approximate=gelu_approximate, gate=shared_gate,
                                       init_method_std=init_method_std,
                                       params_dtype=params_dtype, device=device, glu=glu)

    def route(self, x: torch.Tensor, shards: TokenShards | None = None
              ) -> tuple[torch.Tensor, Permuted, RouterStats]:
        """x [T, h] (one sequence of T tokens) or [s, b, h] (b sequences) -> (the tokens
        [T', h], their assignments sorted by expert, the router's statistics). The capacity is
        per expert and sequence, so a token is kept or dropped whatever else its micro-batch
        holds (the same at any DP size and Domino split). ``shards``: x is this rank's part
        [s / size, b, h] of the sequences (sequence and/or context parallelism); the capacity
        is then decided on the whole sequences' routing, gathered (a small collective)."""
        flat = x.reshape(-1, x.shape[-1])
        routing, stats = self.router(flat)
        s, b = (x.shape[0], x.shape[1]) if x.dim() == 3 else (x.shape[0], 1)
        parts = shards.size if shards is not None else 1
        capacity = keep = None
        if self.capacity_factor is not None:
            capacity = capacity_of(s * parts, self.topk, self.num_experts, self.capacity_factor)
            if parts > 1:
                keep = self._gathered_keep(routing.experts, routing.weights, capacity, b, shards)
        rows = permute(flat, routing.experts, routing.weights, self.num_experts, capacity,
                       self.drop_policy, self.pad_to_capacity, b, keep)
        return flat, rows, stats

    def _gathered_keep(self, experts: torch.Tensor, weights: torch.Tensor, capacity: int,
                       sequences: int, shards: TokenShards) -> torch.Tensor:
        """The capacity's decision for this rank's assignments [T x k], made on every rank's
        routing gathered in true token order (tokens [s, b] flattened)."""
        k = experts.shape[1]
        mine = torch.cat([experts.double(), weights.detach().double()], dim=1)
        every = shards.gather(mine.view(-1, sequences, 2 * k), name="moe capacity routing")
        keep = capacity_keep(every[..., :k].reshape(-1, k).long(),
                             every[..., k:].reshape(-1, k).float(), self.num_experts,
                             capacity, self.drop_policy, sequences)
        return shards.mine(keep.view(-1, sequences, k)).reshape(-1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats, int]:
        """x [..., h] -> (output [..., h], the router's statistics, assignments dropped)."""
        shape = x.shape
        flat, rows, stats = self.route(x)
        if self.ep.size > 1:
            sent = dispatch(rows.x, rows.counts, self.ep)
            y = combine(self.experts(sent.x, sent.counts), sent, self.ep)
        else:
            y = self.experts(rows.x, rows.counts)
        out = unpermute(y, rows, flat.shape[0])
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(shape), stats, rows.dropped
