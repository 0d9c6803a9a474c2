"""The MoE MLP as a block op of a transformer layer (:class:`~domino.transformer.layer.BlockOp`),
and what a training step does with its router: the auxiliary losses' gradients and the expert
bias.

A schedule drives the layer through its edges (:mod:`.edges`): the dispatch all-to-all is the
block's entry, the experts run in its exit's parts, the combine all-to-all is its exit.
(:class:`~.layer.MoEMLP` runs the same layer as one call, the reference the pieces are tested
against.)

The auxiliary losses (``moe_aux_loss_coeff`` x load balancing + ``moe_z_loss_coeff`` x z-loss)
are not returned with the model's output: each MoE op attaches them to the rows its dispatch
sends with :class:`_AuxGrad`, whose backward gives the loss the gradient the step's context
says (``BackwardContext.aux_loss_scale``, so the schedule's backward needs nothing special). A
training step sets it to the micro-batch's share of the step's objective, so
the step minimises the mean token loss plus the token-weighted mean of the auxiliary losses, at
any accumulation and DP size. :func:`step_end` then sums the step's router statistics over DP,
moves the expert biases and returns the metrics a log line shows.

At TP > 1 the experts are whole on every rank (replicated over TP, sharded over EP; their
gradients reduced over expert-DP x TP, ``parallel_state``). Training needs sequence parallelism
there, as Megatron's does: each TP rank routes its own shard of the sequences, so no expert
GEMM runs twice; the router statistics of a piece are summed over TP, and the router's and the
shared expert's gradients, like a norm's, too (the exit's ``replicated_parameters``). Without
it (generation, evaluation) every TP rank routes all tokens alike. Under context parallelism
each CP rank routes the tokens of its chunks: the statistics are summed over CP too, and a
capacity is decided on the whole sequences (:mod:`.shards`); a training step weighs the
auxiliary losses by the whole micro-batch's loss tokens (summed over CP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from domino.config import TransformerConfig
from domino.parallel_state import ParallelState
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.layers import WgradStash
from domino.transformer.kernels import glu_args
from domino.transformer.microbatch import MicroBatch
from domino.transformer.moe.edges import MoEEntry, MoEExit, run_edges
from domino.transformer.moe.layer import MoEMLP
from domino.transformer.moe.router import RouterStats, aux_losses, update_expert_bias
from domino.transformer.moe.shards import TokenShards

if TYPE_CHECKING:
    from domino.transformer.edge import EdgeContext
    from domino.transformer.spec import LayerArgs


@dataclass(eq=False)
class MicroBatchStats:
    """A training micro-batch's router statistics, summed over the pieces a schedule splits it
    into (Domino's micro-batches), so that its auxiliary losses are those of the whole
    micro-batch whatever the split."""

    stats: RouterStats | None = None  # detached
    dropped: int = 0

    def add(self, stats: RouterStats, dropped: int) -> None:
        stats = RouterStats(stats.tokens, stats.counts.detach(), stats.score_sum.detach(),
                            stats.z_sum.detach())
        self.stats = stats if self.stats is None else self.stats + stats
        self.dropped += dropped


class _AuxGrad(torch.autograd.Function):
    """``out`` unchanged; in backward, a piece's summed scores and squared log-partitions get
    their gradient in the auxiliary losses of the whole micro-batch (``run``, complete by then),
    scaled by ``step.aux_loss_scale`` (read then: a step sets it before its backward). The
    load-balancing loss is linear in each piece's score sums (with the micro-batch's counts),
    the z-loss in its log-partition sums, so these are exact."""

    @staticmethod
    def forward(ctx, out, score_sum, z_sum, run, op, step):
        ctx.run, ctx.op, ctx.step = run, op, step
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        op, total = ctx.op, ctx.run.stats
        scale = 1.0 if ctx.step is None else ctx.step.aux_loss_scale
        n = max(total.tokens, 1)
        e = total.counts.numel()
        g_score = (scale * op.aux_coeff * e / (n * n * op.topk)) * total.counts.float()
        g_z = torch.tensor(scale * op.z_coeff / n, device=grad.device)
        return grad, g_score.to(grad.device), g_z, None, None, None


class MoEOp(nn.Module):
    """A layer's MoE MLP (``config.num_experts`` experts, Megatron's ``moe_*`` settings)."""

    is_moe = True  # its expert parallelism communicates (a stack splits for it at TP = 1)

    def __init__(self, config: TransformerConfig, state: ParallelState,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.tp, self.cp = state.tp, state.cp
        # Where a run's tokens are (its sequences split over TP and/or CP ranks), or None.
        self.shards: TokenShards | None = None
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
            params_dtype=config.params_dtype, device=device, ep=state.ep,
            force_balance=config.moe_router_force_load_balancing,
            router_bias=config.moe_router_bias, expert_linear_bias=config.moe_expert_linear_bias,
            glu=glu_args(config))
        balance = config.moe_router_load_balancing_type == "aux_loss"
        self.aux_coeff = config.moe_aux_loss_coeff if balance else 0.0
        self.z_coeff = config.moe_z_loss_coeff or 0.0
        self.bias_rate = config.moe_router_bias_update_rate
        self.reset_stats()

    @classmethod
    def build(cls, args: LayerArgs) -> MoEOp:
        """A layer's MoE MLP (a part of :mod:`~domino.transformer.spec`)."""
        return cls(args.config, args.state, args.device)

    def reset_stats(self) -> None:
        """Forget the router statistics gathered since the last step (kept on the device:
        recording them costs no host sync)."""
        device = self.moe.router.weight.device
        self.counts = torch.zeros(self.moe.router.num_experts, dtype=torch.float64,
                                  device=device)
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # balance, z, dropped, n
        self.run: MicroBatchStats | None = None  # the micro-batch being recorded

    def close_run(self) -> None:
        """Add the recorded micro-batch's auxiliary losses and dropped assignments to
        ``sums`` (its counts are in ``counts`` already)."""
        run, self.run = self.run, None
        if run is None or run.stats is None:
            return
        balance, z = aux_losses(run.stats, self.topk)
        self.sums += torch.stack([balance.double(), z.double(),
                                  self.sums.new_tensor(float(run.dropped)),
                                  self.sums.new_tensor(1.0)])

    def entry(self, edges: EdgeContext) -> MoEEntry:
        """A run's dispatch (:mod:`.edges`); :meth:`exit` then returns the combine that shares
        its state, so a schedule asks for both, entry first. A run is one micro-batch of
        training: its router statistics add up over the run's pieces. Its tokens are where
        ``edges`` says: the sequence sharded over TP, the sequences split over CP, or
        neither."""
        self.close_run()
        self.run = MicroBatchStats()
        self.shards = TokenShards.of(edges.tp if edges.sequence_parallel else None,
                                     edges.cp if edges.context_parallel else None)
        self._edges = run_edges(self)
        return self._edges[0]

    def exit(self, edges: EdgeContext) -> MoEExit:
        """The run's combine (after :meth:`entry`, whose state it shares)."""
        return self._edges[1]

    def core(self, x: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll=None) -> torch.Tensor:
        """The received rows (with their weights) as they are: the experts run in the exit's
        parts, group by group. ``poll`` first, so that the next micro-batch's dispatch goes out
        before this one's experts run."""
        if poll is not None:
            poll()
        return x

    def record(self, payload: torch.Tensor, stats: RouterStats, dropped: int,
               mb: MicroBatch | None = None) -> torch.Tensor:
        """A piece's router statistics, added to its micro-batch's; the gradient of the
        micro-batch's auxiliary losses attached to ``payload`` (the rows the dispatch sends),
        scaled as the step's context (``mb.context``) says. Only a forward whose backward will
        run counts (grad mode on, training)."""
        if not self.training or not torch.is_grad_enabled() or self.run is None:
            return payload
        if self.tp.size > 1 and self.shards is None:
            raise ValueError(
                f"an MoE layer trains at tensor_model_parallel_size={self.tp.size} only with "
                "sequence parallelism (--sequence-parallel; RuntimeConfig(sequence_parallel="
                "True)), as in Megatron: each TP rank then routes its own tokens to whole "
                "experts; without it every TP rank would compute every expert again")
        whole = stats
        if self.shards is not None:  # the piece's tokens are spread over TP and/or CP ranks
            whole, dropped = self._summed_over_shards(stats, dropped)
        self.run.add(whole, dropped)
        self.counts += whole.counts.detach().double()
        # (each rank's own score and z sums: their gradients are summed with the router's)
        if (self.aux_coeff or self.z_coeff) and stats.score_sum.requires_grad:
            payload = _AuxGrad.apply(payload, stats.score_sum, stats.z_sum, self.run, self,
                                     None if mb is None else mb.context)
        return payload

    def _summed_over_shards(self, stats: RouterStats, dropped: int
                            ) -> tuple[RouterStats, int]:
        """The piece's statistics and drops over every rank's shard of its tokens, detached
        (a small all-reduce per group): the auxiliary losses are the whole micro-batch's."""
        e = stats.counts.numel()
        flat = torch.cat([stats.counts.double(), stats.score_sum.detach().double(),
                          stats.z_sum.detach().double().view(1),
                          stats.counts.new_tensor([stats.tokens, dropped], dtype=torch.float64)])
        self.shards.all_reduce(flat, name="moe router statistics")
        z, tokens, dropped = flat[2 * e:].tolist()
        return (RouterStats(int(tokens), flat[:e].to(stats.counts.dtype),
                            flat[e:2 * e].to(stats.score_sum.dtype),
                            flat.new_tensor(z, dtype=stats.z_sum.dtype)), int(dropped))

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters replicated over TP whose gradients are partial under sequence
        parallelism (each rank's tokens): the router's and the shared expert's."""
        shared = list(self.moe.shared.parameters()) if self.moe.shared is not None else []
        router = self.moe.router
        return [router.weight, *([] if router.bias is None else [router.bias]), *shared]


def moe_ops(model: nn.Module) -> list[MoEOp]:
    """The model's MoE ops, in order."""
    return [m for m in model.modules() if isinstance(m, MoEOp)]


def micro_batch_tokens(batches: list[dict[str, torch.Tensor]], cp: CommGroup) -> list[float]:
    """Each training micro-batch's loss tokens over its whole sequences: what its auxiliary
    losses weigh (``BackwardContext.aux_loss_scale``). Under context parallelism a rank's
    batches hold its shards: summed over CP (one small all-reduce, one host sync)."""
    tokens = torch.stack([b["loss_mask"].sum() for b in batches]).double()
    if cp.size > 1:
        cp.all_reduce(tokens, name="moe micro-batch tokens")
    return tokens.tolist()


def step_end(ops: list[MoEOp], group, stages: CommGroup | None = None) -> dict[str, float]:
    """After a step's optimizer update: its router statistics summed over ``group`` (DP: every
    rank's tokens), the expert biases moved, the statistics reset. Returns the step's metrics:
    the mean load-balancing loss and z-loss of its MoE layers' forwards, the busiest expert's
    load over the mean (1 = balanced) and the share of assignments the capacity dropped.
    ``stages``: the pipeline group, whose stages hold different layers; every stage calls this
    then, with MoE ops of its own or none, and gets the metrics over all the model's layers
    (one more small collective)."""
    if not ops and stages is None:
        return {}
    for op in ops:
        op.close_run()
    # Summed over layers: the balance and z losses, the dropped shares, the layers; the busiest
    # expert's load over all of them.
    sums, max_load = [0.0, 0.0, 0.0, float(len(ops))], 0.0
    if ops:
        flat = torch.cat([torch.cat([op.counts, op.sums]) for op in ops])
        group.all_reduce(flat, name="moe statistics")
        flat = flat.cpu()
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
        sums[0] += balance / n
        sums[1] += z / n
        # counts are the router's assignments, the dropped ones included
        sums[2] += dropped / max(float(counts.sum()), 1.0)
        max_load = max(max_load, float(counts.max() / counts.mean()))
        op.reset_stats()
    if stages is not None and stages.size > 1:
        # One sum: each stage's busiest load in a slot of its own, the max taken after.
        t = torch.zeros(4 + stages.size, dtype=torch.float64, device=stages.device)
        t[:4], t[4 + stages.rank] = torch.tensor(sums, dtype=torch.float64), max_load
        stages.all_reduce(t, name="moe metrics over stages")
        values = t.tolist()
        sums, max_load = values[:4], max(values[4:])
    layers = sums[3]
    if not layers:
        return {}
    return {"moe_aux_loss": sums[0] / layers, "moe_z_loss": sums[1] / layers,
            "moe_max_load": max_load, "moe_dropped": sums[2] / layers}
