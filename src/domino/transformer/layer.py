"""A transformer layer, cut at its communication points into blocks a schedule can drive.

A block is one residual branch::

    enter:    h -> norm -> (ln, residual)                  local, replicated on TP ranks
    op.entry: ln -> the region's input                     collective (op's business)
    op.core:  -> column-parallel ... (attention, act)      TP region
    op.exit:  parts -> collective (+ its bias)             e.g. row-parallel partial sums,
                                                           one per column chunk, summed
    exit:     (out, residual) -> residual + dropout(out)   local

(or, with the norm after the op - ``Block.norm_after``, OLMo 2's - enter passes h on and exit
adds dropout(norm(out)); with a second norm - ``Block.post_norm``, Gemma 2's sandwich - enter
normalises and exit adds dropout(post_norm(out)).)

A block's exit and the next block's enter run as one local piece
(:func:`domino.transformer.kernels.local`, compiled with ``RuntimeConfig.compile``); the
block gives it its norm (:meth:`Block.norm_args`) and dropout mask (:meth:`Block.dropout_keep`).

The layer is built from a :class:`~domino.transformer.spec.LayerSpec` (by default the config's
choice, :func:`~domino.transformer.spec.layer_spec`), which names each block's norm and op and
the attributes they are kept under (Megatron's names); :meth:`TransformerLayer.blocks` returns
its branches in order (self attention, [cross attention], MLP).
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
from domino.tensor_parallel.layers import WgradStash
from domino.tensor_parallel.random import RNGTracker, dropout_mask
from domino.transformer.edge import EdgeContext
from domino.transformer.exits import Entry, Exit
from domino.transformer.kernels import Kernels, NormArgs
from domino.transformer.microbatch import MicroBatch
from domino.transformer.spec import LayerArgs, LayerSpec, layer_spec


class BlockOp(Protocol):
    """The region of a block between its norm and its residual add (attention, MLP), as a
    schedule drives it. The op owns the collectives at the region's edges (see ``exits``). A
    layer spec names an op by its class, which builds it (``build(args)``: ``spec.Part``)."""

    training: bool

    def entry(self, edges: EdgeContext) -> Entry:
        """How the region is entered in a run whose parallel dimensions are ``edges`` (e.g.
        from the sequence's shards under sequence parallelism)."""

    def exit(self, edges: EdgeContext) -> Exit:
        """How the region is left in the run, and what the receiving side does with it."""

    def core(self, x: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll: Callable[[], None] | None = None) -> torch.Tensor:
        """Everything from the entry's result to what :meth:`exit`'s ``parts`` read: for
        attention and MLP [s, b, h] -> [s, b, width/tp]. The entry GEMM leaves dL/dx unreduced
        (the entry's ``launch_grad`` reduces it) and, with ``stash``, defers its
        weight-gradient GEMMs there. ``poll`` (when given) is called once, between the entry
        GEMM and what follows it: a schedule's chance to run other work."""

    def parameters(self) -> Iterator[nn.Parameter]: ...


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
    residual_multiplier: float = 1.0  # the op's output is scaled by it before the add
    norm_after: bool = False  # the norm runs on the op's output (before the add), not its input
    post_norm: nn.Module | None = None  # a second norm, on the op's output (sandwich norms)

    def parameters(self) -> list[nn.Parameter]:
        """The block's own parameters: its norms' and its op's."""
        return [*self.norm_parameters(), *self.op.parameters()]

    def norm_parameters(self) -> list[nn.Parameter]:
        """Its norms' parameters (replicated over TP)."""
        post = [] if self.post_norm is None else list(self.post_norm.parameters())
        return [*self.norm.parameters(), *post]

    @property
    def first_module(self) -> nn.Module:
        """The module every piece of this block runs first (its norm): a forward pre-hook on
        it runs before any of the block's parameters is used."""
        return self.norm

    def norm_args(self) -> NormArgs:
        """The block's norm as :func:`~domino.transformer.kernels.local` reads it (a call of
        the norm module: see ``norms.py``)."""
        return self.norm()

    def entry_norm(self) -> NormArgs | None:
        """What the local piece entering the block normalises the stream with: its norm, or
        None when the norm runs after the op (``norm_after``; the norm module is called
        anyway, so that its forward pre-hooks still run before the op's parameters are used:
        ``first_module``)."""
        args = self.norm()
        return None if self.norm_after else args

    def exit_norm(self) -> NormArgs | None:
        """What the local piece leaving the block normalises the op's output with before the
        residual add: its post norm, or its norm when ``norm_after``, else None."""
        if self.post_norm is not None:
            return self.post_norm()
        return self.norm() if self.norm_after else None

    def dropout_keep(self, out: torch.Tensor,
                     seq_shard: tuple[int, int] | None = None) -> tuple[torch.Tensor | None, float]:
        """The hidden dropout's mask of the op's output ``out`` (the delivered sum, plus its
        exit's bias; None when no dropout runs) and its scale. ``seq_shard`` =
        (rank, size): ``out`` is this rank's sequence shard (sequence parallelism); the mask is
        then the shard's rows of the whole sequence's."""
        # All TP ranks hold the same output (or shards of one): the mask must match ->
        # replicated stream.
        keep = dropout_mask(out, self.hidden_dropout, self.op.training,
                            self.rng.replicated(out.device), seq_shard)
        return keep, (1.0 / (1.0 - self.hidden_dropout) if keep is not None else 1.0)


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: self attention, cross attention (decoder), MLP, or the
    blocks ``spec`` names (default: :func:`~domino.transformer.spec.layer_spec`, the config's
    choice). ``recompute_attention``: selective recomputation of the core attention (a
    run-time choice, ``RuntimeConfig.recompute_granularity == "selective"``); ``kernels``: the
    piece functions its ops run (eager, or compiled: ``RuntimeConfig.compile``); ``cp_kind``:
    the context-parallel attention it runs when the state's CP group has more than one rank
    (``RuntimeConfig.cp_kind``)."""

    def __init__(self, config: TransformerConfig, state: ParallelState, layer_number: int,
                 layer_type: LayerType = LayerType.encoder,
                 device: torch.device | None = None, *,
                 recompute_attention: bool = False, kernels: Kernels | None = None,
                 cp_kind: str = "ring", spec: LayerSpec | None = None) -> None:
        super().__init__()
        self.layer_number, self.layer_type = layer_number, layer_type
        self.config, self.rng = config, state.rng
        self.spec = spec if spec is not None else layer_spec(config, layer_number, layer_type)
        args = LayerArgs(config, state, layer_number, device, recompute_attention, kernels,
                         cp_kind)
        # Built in forward order (norm, op, ...): the order their weights are drawn in.
        for b in self.spec.blocks:
            self.add_module(b.norm_name, b.norm.build(args))
            self.add_module(b.op_name, b.op.build(args))
            if b.post_norm_name is not None:
                self.add_module(b.post_norm_name, b.norm.build(args))

    def blocks(self) -> list[Block]:
        """The layer's residual branches, in forward order."""
        cfg = self.config
        return [Block(self.layer_number, b.kind, getattr(self, b.norm_name),
                      getattr(self, b.op_name), cfg.hidden_dropout,
                      cfg.apply_residual_connection_post_layernorm, self.rng,
                      cfg.residual_multiplier, b.norm_after,
                      None if b.post_norm_name is None else getattr(self, b.post_norm_name))
                for b in self.spec.blocks]
