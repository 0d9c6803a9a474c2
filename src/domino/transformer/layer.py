"""A transformer layer, cut at its communication points into blocks a schedule can drive.

A block is one residual branch::

    enter:    h -> norm -> (ln, residual)                  local, replicated on TP ranks
    op.core:  ln -> column-parallel ... (attention, act)   TP region, then
    dense_partials: -> row-parallel GEMM                   partial sums, one per column
                                                           chunk, each needing an all-reduce
    exit:     (reduced, residual) -> residual + dropout(reduced + bias)   local

The layer itself holds the modules under Megatron's names; :meth:`TransformerLayer.blocks`
returns its branches in order (self attention, [cross attention], MLP).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from domino.config import TransformerConfig
from domino.enums import LayerType
from domino.parallel_state import ParallelState
from domino.tensor_parallel import RowParallelLinear, dropout
from domino.tensor_parallel.layers import WgradStash, column_chunks
from domino.tensor_parallel.random import RNGTracker, dropout_seq_shard
from domino.transformer.attention import CrossAttention, SelfAttention
from domino.transformer.microbatch import MicroBatch
from domino.transformer.mlp import MLP
from domino.transformer.norms import build_norm


class BlockOp(Protocol):
    """The TP region of a block (attention or MLP), as a schedule drives it."""

    training: bool

    @property
    def dense(self) -> RowParallelLinear:
        """The row-parallel exit whose partial sums the schedule all-reduces."""

    def core(self, x: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll: Callable[[], None] | None = None) -> torch.Tensor:
        """Everything from the column-parallel entry to ``dense``'s input: [s, b, h] ->
        [s, b, width/tp]. The entry leaves dL/dx unreduced (the schedule reduces it) and, with
        ``stash``, defers its weight-gradient GEMMs there. ``poll`` (when given) is called once,
        between the entry GEMM and what follows it: a schedule's chance to run other work."""


@dataclass(eq=False)
class Block:
    """One residual branch of a layer (see module docstring)."""

    layer: int
    kind: str  # "self_attn" | "cross_attn" | "mlp"
    norm: nn.Module
    op: BlockOp
    hidden_dropout: float
    residual_post_norm: bool
    rng: RNGTracker

    def parameters(self) -> list[nn.Parameter]:
        """The block's own parameters: its norm's and its TP region's."""
        return [*self.norm.parameters(), *self.op.parameters()]

    def enter(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ln = self.norm(h)
        return ln, (ln if self.residual_post_norm else h)

    def dense_partials(self, core: torch.Tensor, chunks: int,
                       stash: WgradStash | None) -> Iterator[torch.Tensor]:
        """Row-parallel partial sums [s, b, h_c] of the core's output ``op.core(ln, ...)``
        [s, b, width/tp], one per column chunk, produced lazily so the caller can launch chunk
        c's all-reduce before chunk c+1's GEMM runs. With ``stash`` the weight-gradient GEMMs
        are deferred to it (as the core's are, given the same stash)."""
        dense = self.op.dense
        if chunks == 1:
            yield dense.partial(core, wgrad_stash=stash)
            return
        for cols in column_chunks(dense.output_size, chunks):
            yield dense.partial(core, cols, wgrad_stash=stash)

    def exit(self, reduced: torch.Tensor, residual: torch.Tensor,
             seq_shard: tuple[int, int] | None = None) -> torch.Tensor:
        """``seq_shard`` = (rank, size): the tensors are this rank's sequence shard (sequence
        parallelism); the dropout mask is then the shard's rows of the whole sequence's."""
        bias = self.op.dense.bias
        out = reduced if bias is None else reduced + bias
        # All TP ranks hold the same reduced tensor (or shards of one): the mask must match ->
        # replicated stream.
        gen = self.rng.replicated(out.device)
        if seq_shard is None:
            out = dropout(out, self.hidden_dropout, self.op.training, gen)
        else:
            out = dropout_seq_shard(out, self.hidden_dropout, self.op.training, gen, *seq_shard)
        return residual + out


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: self attention, cross attention (decoder), MLP."""

    def __init__(self, config: TransformerConfig, state: ParallelState, layer_number: int,
                 layer_type: LayerType = LayerType.encoder,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.layer_number, self.layer_type = layer_number, layer_type
        self.config, self.rng = config, state.rng
        self.input_layernorm = build_norm(config, device)
        self.self_attention = SelfAttention(config, state, layer_number, device)
        self.post_attention_layernorm = build_norm(config, device)
        if layer_type == LayerType.decoder:
            self.inter_attention = CrossAttention(config, state, layer_number, device)
            self.post_inter_attention_layernorm = build_norm(config, device)
        self.mlp = MLP(config, state, device)

    def blocks(self) -> list[Block]:
        cfg = self.config

        def block(kind: str, norm: nn.Module, op: nn.Module) -> Block:
            return Block(self.layer_number, kind, norm, op, cfg.hidden_dropout,
                         cfg.apply_residual_connection_post_layernorm, self.rng)

        out = [block("self_attn", self.input_layernorm, self.self_attention)]
        if self.layer_type == LayerType.decoder:
            out.append(block("cross_attn", self.post_attention_layernorm, self.inter_attention))
            out.append(block("mlp", self.post_inter_attention_layernorm, self.mlp))
        else:
            out.append(block("mlp", self.post_attention_layernorm, self.mlp))
        return out
