"""The MoE MLP as a block op of a transformer layer (:class:`~domino.transformer.layer.BlockOp`),
and what a training step does with its router: the auxiliary losses' gradients and the expert
bias.

The auxiliary losses (``moe_aux_loss_coeff`` x load balancing + ``moe_z_loss_coeff`` x z-loss)
are not returned with the model's output: each MoE op attaches them to its own output with
:class:`_AuxGrad`, whose backward gives the loss the gradient ``loss_scale`` (PyTorch autograd,
so the Domino schedule's backward needs nothing special; under full recomputation only the run
with a graph, the backward's, counts). A training step sets ``loss_scale`` to the
micro-batch's share of the step's objective (:func:`set_loss_scale`), so
the step minimises the mean token loss plus the token-weighted mean of the auxiliary losses, at
any accumulation and DP size. :func:`step_end` then sums the step's router statistics over DP,
moves the expert biases and returns the metrics a log line shows.

For now an MoE layer runs at TP = 1 (the op refuses more): its entry and exit have no
collective; expert parallelism is the layer's own (:mod:`.dispatch`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from domino.config import TransformerConfig
from domino.parallel_state import ParallelState
from domino.tensor_parallel.layers import WgradStash
from domino.transformer.exits import ColumnParallelEntry, PartialSums
from domino.transformer.microbatch import MicroBatch
from domino.transformer.moe.layer import MoEMLP
from domino.transformer.moe.router import aux_losses, update_expert_bias


class _AuxGrad(torch.autograd.Function):
    """``out`` unchanged; in backward, the auxiliary loss ``aux`` gets the gradient
    ``op.loss_scale`` (read then: a step sets it before its backward)."""

    @staticmethod
    def forward(ctx, out, aux, op):
        ctx.op = op
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.tensor(ctx.op.loss_scale, dtype=torch.float32,
                                  device=grad.device), None


class _Delivered(PartialSums):
    """The op's output as the block's result: no collective at TP = 1, no bias."""

    def parts(self, core: torch.Tensor, chunks: int,
              stash: WgradStash | None) -> Iterator[torch.Tensor]:
        yield core

    def bias(self) -> None:
        return None

    def part_grads(self, grad: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [grad]

    def replicated_parameters(self) -> list[torch.Tensor]:
        return []


class MoEOp(nn.Module):
    """A layer's MoE MLP (``config.num_experts`` experts, Megatron's ``moe_*`` settings)."""

    def __init__(self, config: TransformerConfig, state: ParallelState,
                 device: torch.device | None = None) -> None:
        super().__init__()
        if state.tp.size > 1:
            raise ValueError(
                f"num_experts={config.num_experts} with tensor_model_parallel_size="
                f"{state.tp.size}: MoE layers run at TP=1 for now (tensor parallelism inside "
                "the experts is not built yet); use TP=1, with DP for scale")
        self.group = state.tp
        self.topk = config.moe_router_topk
        self.moe = MoEMLP(
            config.hidden_size, config.moe_ffn_hidden_size, config.num_experts, self.topk,
            swiglu=config.activation == "swiglu",
            gelu_approximate="tanh" if config.activation == "gelu_tanh" else "none",
            score_function=config.moe_router_score_function,
            renormalize=not config.moe_router_pre_softmax,
            scaling=config.moe_router_topk_scaling_factor or 1.0,
            expert_bias=config.moe_router_enable_expert_bias,
            capacity_factor=config.moe_expert_capacity_factor,
            drop_policy=config.moe_token_drop_policy,
            pad_to_capacity=config.moe_pad_expert_input_to_capacity,
            shared_ffn_hidden_size=config.moe_shared_expert_intermediate_size,
            shared_gate=config.moe_shared_expert_gate,
            init_method_std=config.init_method_std,
            output_std=config.init_method_std / math.sqrt(2.0 * config.num_layers),
            params_dtype=config.params_dtype, device=device, ep=state.ep)
        balance = config.moe_router_load_balancing_type == "aux_loss"
        self.aux_coeff = config.moe_aux_loss_coeff if balance else 0.0
        self.z_coeff = config.moe_z_loss_coeff or 0.0
        self.bias_rate = config.moe_router_bias_update_rate
        self.loss_scale = 1.0  # the auxiliary losses' gradient (set_loss_scale)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Forget the router statistics gathered since the last step (kept on the device:
        recording them costs no host sync)."""
        device = self.moe.router.weight.device
        self.counts = torch.zeros(self.moe.router.num_experts, dtype=torch.float64,
                                  device=device)
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # balance, z, dropped, n

    def entry(self, sequence_parallel: bool) -> ColumnParallelEntry:
        return ColumnParallelEntry(self.group, sequence_parallel)

    def exit(self, sequence_parallel: bool) -> _Delivered:
        return _Delivered(self.group, sequence_parallel)

    def core(self, x: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll=None) -> torch.Tensor:
        out, stats, dropped = self.moe(x)
        if poll is not None:
            poll()
        # Only a forward whose backward will run counts: full recomputation runs the op twice,
        # first without a graph (skipped here), then again with one in the backward.
        if not self.training or not torch.is_grad_enabled():
            return out
        balance, z = aux_losses(stats, self.topk)
        aux = self.aux_coeff * balance + self.z_coeff * z
        if aux.requires_grad:
            out = _AuxGrad.apply(out, aux, self)
        self.counts += stats.counts.detach().double()
        self.sums += torch.stack([balance.detach().double(), z.detach().double(),
                                  self.sums.new_tensor(float(dropped)), self.sums.new_tensor(1.0)])
        return out


def moe_ops(model: nn.Module) -> list[MoEOp]:
    """The model's MoE ops, in order."""
    return [m for m in model.modules() if isinstance(m, MoEOp)]


def set_loss_scale(ops: Iterable[MoEOp], scale: float) -> None:
    """The gradient the auxiliary losses of the next backward get (a micro-batch's share of
    the step's objective)."""
    for op in ops:
        op.loss_scale = scale


def step_end(ops: list[MoEOp], group) -> dict[str, float]:
    """After a step's optimizer update: its router statistics summed over ``group`` (DP: every
    rank's tokens), the expert biases moved, the statistics reset. Returns the step's metrics:
    the mean load-balancing loss and z-loss of its MoE layers' forwards, the busiest expert's
    load over the mean (1 = balanced) and the share of assignments the capacity dropped."""
    if not ops:
        return {}
    flat = torch.cat([torch.cat([op.counts, op.sums]) for op in ops])
    group.all_reduce(flat, name="moe statistics")
    flat = flat.cpu()
    out = {"moe_aux_loss": 0.0, "moe_z_loss": 0.0, "moe_max_load": 0.0, "moe_dropped": 0.0}
    offset = 0
    for op in ops:
        e = op.counts.numel()
        counts, (balance, z, dropped, forwards) = flat[offset:offset + e], \
            flat[offset + e:offset + e + 4].tolist()
        offset += e + 4
        if op.moe.router.expert_bias is not None:
            update_expert_bias(op.moe.router.expert_bias, counts.float().to(
                op.moe.router.expert_bias.device), op.bias_rate)
        n = max(forwards, 1.0)
        out["moe_aux_loss"] += balance / n / len(ops)
        out["moe_z_loss"] += z / n / len(ops)
        out["moe_max_load"] = max(out["moe_max_load"], float(counts.max() / counts.mean()))
        # counts are the router's assignments, the dropped ones included
        out["moe_dropped"] += dropped / max(float(counts.sum()), 1.0) / len(ops)
        op.reset_stats()
    return out
