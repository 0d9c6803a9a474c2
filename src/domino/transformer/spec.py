"""Layer specs: which parts a transformer layer is made of, and the config's choice of them.

A :class:`LayerSpec` lists a layer's blocks (its residual branches) in forward order; a
:class:`BlockSpec` names a block's norm and op: the attribute each is stored under (Megatron's
names, so that state-dict keys, checkpoints and the Hugging Face maps stay as they are) and the
class it is built from. A part class builds itself from :class:`LayerArgs` (its classmethod
``build``); an op class also satisfies :class:`~domino.transformer.layer.BlockOp`.

:func:`layer_spec` is the config's choice for each layer: self attention, cross attention in a
decoder, a dense MLP or (where ``config.is_moe_layer``) an MoE MLP, the config's norm. A new
block type is a new class plus a line here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from domino.config import TransformerConfig
from domino.enums import LayerType
from domino.parallel_state import ParallelState
from domino.transformer.attention import CrossAttention, SelfAttention
from domino.transformer.kernels import Kernels
from domino.transformer.mlp import MLP
from domino.transformer.moe.op import MoEOp
from domino.transformer.norms import LayerNorm, RMSNorm


@dataclass(frozen=True)
class LayerArgs:
    """What every part of one layer is built from: the architecture, this rank's groups, the
    layer's number (1-based, the model's), the device, and the run-time choices that shape a
    module: selective recomputation of the core attention
    (``RuntimeConfig.recompute_granularity == "selective"``), the piece functions its ops run
    (eager or compiled: ``RuntimeConfig.compile``) and the context-parallel attention kind
    (``RuntimeConfig.cp_kind``)."""

    config: TransformerConfig
    state: ParallelState
    layer_number: int
    device: torch.device | None = None
    recompute_attention: bool = False
    kernels: Kernels | None = None
    cp_kind: str = "ring"


class Part(Protocol):
    """A class a spec names: it builds one of a layer's modules."""

    @classmethod
    def build(cls, args: LayerArgs) -> nn.Module: ...


@dataclass(frozen=True)
class BlockSpec:
    """One residual branch: its kind (what a schedule and the bench call it), its norm and
    its op, each as (the layer's attribute name, the class); ``norm_after``: the norm runs on
    the op's output before the residual add instead of on its input (OLMo 2's);
    ``post_norm_name``: a second norm (of the same class), on the op's output, beside the one
    on its input (Gemma 2/3's sandwich)."""

    kind: str  # "self_attn" | "cross_attn" | "mlp"
    norm_name: str
    norm: type[Part]
    op_name: str
    op: type[Part]
    norm_after: bool = False
    post_norm_name: str | None = None


@dataclass(frozen=True)
class LayerSpec:
    """A layer's blocks in forward order (see the module docstring)."""

    blocks: tuple[BlockSpec, ...]

    def with_op(self, kind: str, op: type[Part]) -> LayerSpec:
        """This spec with the op of its ``kind`` block built from ``op`` (same attribute
        name); KeyError naming the kinds it has when it has none."""
        kinds = [b.kind for b in self.blocks]
        if kind not in kinds:
            raise KeyError(f"the spec has no {kind!r} block; its blocks are {kinds}")
        return LayerSpec(tuple(dataclasses.replace(b, op=op) if b.kind == kind else b
                               for b in self.blocks))


def layer_spec(config: TransformerConfig, layer_number: int,
               layer_type: LayerType = LayerType.encoder) -> LayerSpec:
    """The parts of layer ``layer_number`` (1-based) as ``config`` chooses them; a decoder
    layer has a cross attention between its self attention and its MLP."""
    norm = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    mlp = MoEOp if config.is_moe_layer(layer_number - 1) else MLP
    if config.norm_after_sublayer or config.sandwich_norms:
        return _norms_after(norm, mlp, layer_type, config.sandwich_norms)
    attention = BlockSpec("self_attn", "input_layernorm", norm, "self_attention", SelfAttention)
    if layer_type == LayerType.decoder:
        return LayerSpec((
            attention,
            BlockSpec("cross_attn", "post_attention_layernorm", norm, "inter_attention",
                      CrossAttention),
            BlockSpec("mlp", "post_inter_attention_layernorm", norm, "mlp", mlp)))
    return LayerSpec((attention, BlockSpec("mlp", "post_attention_layernorm", norm, "mlp", mlp)))


def _norms_after(norm: type[Part], mlp: type[Part], layer_type: LayerType,
                 sandwich: bool) -> LayerSpec:
    """``config.norm_after_sublayer``: each block's norm on its op's output, under OLMo 2's
    names; ``config.sandwich_norms``: norms on both sides, under Gemma 2's (their Hugging Face
    names)."""
    if layer_type == LayerType.decoder:
        name = "sandwich_norms" if sandwich else "norm_after_sublayer"
        raise ValueError(
            f"{name}=True is built for decoder-only stacks; a decoder layer with cross "
            f"attention has no such layout here: use {name}=False.")
    if sandwich:
        return LayerSpec((
            BlockSpec("self_attn", "input_layernorm", norm, "self_attention", SelfAttention,
                      post_norm_name="post_attention_layernorm"),
            BlockSpec("mlp", "pre_feedforward_layernorm", norm, "mlp", mlp,
                      post_norm_name="post_feedforward_layernorm")))
    return LayerSpec((
        BlockSpec("self_attn", "post_attention_layernorm", norm, "self_attention",
                  SelfAttention, norm_after=True),
        BlockSpec("mlp", "post_feedforward_layernorm", norm, "mlp", mlp, norm_after=True)))
