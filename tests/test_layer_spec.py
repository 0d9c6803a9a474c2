"""Layers from specs (``transformer/spec.py``).

The default spec (:func:`layer_spec`, the config's choice) gives exactly the modules a layer
had before specs, by name, class and weights (so state-dict keys and checkpoints are unchanged):
for a dense, an MoE and a decoder layer. A new block type is a new class plus a spec entry: an
MLP variant defined here, satisfying ``BlockOp``, runs forward and backward through the Domino
executor (two micro-batches, cross-layer overlap, two column chunks, at TP = 1) and matches a
direct computation of the same layers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from domino.config import TransformerConfig
from domino.enums import AttnMaskType, LayerType
from domino.parallel_state import ParallelState
from domino.plan import Plan
from domino.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from domino.transformer import (
    BlockSpec,
    DominoTransformer,
    EdgeContext,
    LayerArgs,
    LayerSpec,
    TransformerLayer,
    layer_spec,
)
from domino.transformer.attention import CrossAttention, SelfAttention
from domino.transformer.exits import ColumnParallelEntry, RowParallelExit
from domino.transformer.mlp import MLP
from domino.transformer.moe.op import MoEOp
from domino.transformer.norms import LayerNorm, RMSNorm, build_norm

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
            max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0)
DENSE = [("input_layernorm", LayerNorm), ("self_attention", SelfAttention),
         ("post_attention_layernorm", LayerNorm), ("mlp", MLP)]
MOE = [("input_layernorm", RMSNorm), ("self_attention", SelfAttention),
       ("post_attention_layernorm", RMSNorm), ("mlp", MoEOp)]
DECODER = [("input_layernorm", LayerNorm), ("self_attention", SelfAttention),
           ("post_attention_layernorm", LayerNorm), ("inter_attention", CrossAttention),
           ("post_inter_attention_layernorm", LayerNorm), ("mlp", MLP)]
CASES = {
    "dense": (dict(), LayerType.encoder, DENSE),
    "moe": (dict(normalization="RMSNorm", num_experts=4, moe_router_topk=2), LayerType.encoder,
            MOE),
    "decoder": (dict(), LayerType.decoder, DECODER),
}


def _by_hand(cfg: TransformerConfig, state: ParallelState, n: int, decoder: bool) -> nn.Module:
    """A layer's modules as the layer built them before specs, in the same order."""
    m = nn.Module()
    m.input_layernorm = build_norm(cfg)
    m.self_attention = SelfAttention(cfg, state, n)
    m.post_attention_layernorm = build_norm(cfg)
    if decoder:
        m.inter_attention = CrossAttention(cfg, state, n)
        m.post_inter_attention_layernorm = build_norm(cfg)
    m.mlp = MoEOp(cfg, state) if cfg.is_moe_layer(n - 1) else MLP(cfg, state)
    return m


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_spec_gives_todays_modules(case: str) -> None:
    over, layer_type, expected = CASES[case]
    cfg, state = TransformerConfig(**BASE, **over), ParallelState.single()
    torch.manual_seed(0)
    layer = TransformerLayer(cfg, state, 1, layer_type)
    assert [(name, type(m)) for name, m in layer.named_children()] == expected
    assert [b.kind for b in layer.blocks()] == (
        ["self_attn", "cross_attn", "mlp"] if layer_type == LayerType.decoder
        else ["self_attn", "mlp"])
    assert layer.spec == layer_spec(cfg, 1, layer_type)
    torch.manual_seed(0)
    before = _by_hand(cfg, state, 1, layer_type == LayerType.decoder).state_dict()
    after = layer.state_dict()
    assert list(after) == list(before)  # the same keys, in the same order
    assert all(torch.equal(after[k], before[k]) for k in before)  # the same weights, bit for bit


class SquaredReLUMLP(nn.Module):
    """A new block type, defined here: h -> ffn (column) -> relu(.)^2 -> h (row)."""

    def __init__(self, config: TransformerConfig, state: ParallelState) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size,
                                        group=state.tp, init_method=config.init_method)
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, group=state.tp,
                                     input_is_parallel=True, skip_bias_add=True,
                                     init_method=config.output_layer_init_method)

    @classmethod
    def build(cls, args: LayerArgs) -> SquaredReLUMLP:
        return cls(args.config, args.state)

    def entry(self, edges: EdgeContext) -> ColumnParallelEntry:
        return ColumnParallelEntry(self.fc1.group, edges.sequence_parallel)

    def exit(self, edges: EdgeContext) -> RowParallelExit:
        return RowParallelExit(self.fc2, edges.sequence_parallel)

    def core(self, x, mb, stash, poll=None) -> torch.Tensor:
        h, _ = self.fc1(x, reduce_input_grad=False, wgrad_stash=stash)
        if poll is not None:
            poll()
        return torch.relu(h).square()


def _direct(stack: DominoTransformer, x: torch.Tensor) -> torch.Tensor:
    """The stack's math from its weights, without a schedule: causal multi-head attention and
    the squared-ReLU MLP, pre-norm, x [s, b, h]."""
    for layer in stack.layers:
        attn, mlp = layer.self_attention, layer.mlp
        ln = F.layer_norm(x, x.shape[-1:], layer.input_layernorm.weight,
                          layer.input_layernorm.bias)
        s, b, _ = ln.shape
        qkv = F.linear(ln, attn.query_key_value.weight, attn.query_key_value.bias)
        q, k, v = qkv.view(s, b, attn.heads, 3, attn.head_dim).unbind(3)  # one head per group
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(attn.head_dim)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, -1)
        x = x + F.linear(ctx, attn.dense.weight, attn.dense.bias)
        ln = F.layer_norm(x, x.shape[-1:], layer.post_attention_layernorm.weight,
                          layer.post_attention_layernorm.bias)
        h = torch.relu(F.linear(ln, mlp.fc1.weight, mlp.fc1.bias)).square()
        x = x + F.linear(h, mlp.fc2.weight, mlp.fc2.bias)
    return F.layer_norm(x, x.shape[-1:], stack.final_layernorm.weight,
                        stack.final_layernorm.bias)


def test_new_block_type_from_a_spec() -> None:
    cfg, state = TransformerConfig(**BASE), ParallelState.single()
    spec = layer_spec(cfg, 1).with_op("mlp", SquaredReLUMLP)
    assert spec.blocks[1] == BlockSpec("mlp", "post_attention_layernorm", LayerNorm, "mlp",
                                       SquaredReLUMLP)
    with pytest.raises(KeyError, match="no 'cross_attn' block"):
        spec.with_op("cross_attn", SquaredReLUMLP)
    torch.manual_seed(0)
    stack = DominoTransformer(cfg, state, self_attn_mask_type=AttnMaskType.causal)
    stack.layers = nn.ModuleList(TransformerLayer(cfg, state, i + 1, spec=spec)
                                 for i in range(cfg.num_layers))
    assert isinstance(stack.layers[0].mlp, SquaredReLUMLP)
    # Split although one rank has nothing to hide: the executor's pieces, not one call.
    stack.set_plan(Plan(2, "cross_layer", 2), force=True)
    x = torch.randn(8, 4, 32, generator=torch.Generator().manual_seed(1))
    x_dom, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = stack(x_dom, None)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * w).sum().backward()
    got = {n: p.grad.clone() for n, p in stack.named_parameters()}
    stack.zero_grad()
    y_ref = _direct(stack, x_ref)
    (y_ref * w).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_dom.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for n, p in stack.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_a_spec_names_its_parts() -> None:
    """A spec is data: a layer of other blocks (here one) is a spec like any other."""
    cfg, state = TransformerConfig(**BASE), ParallelState.single()
    one = LayerSpec((BlockSpec("mlp", "input_layernorm", LayerNorm, "mlp", SquaredReLUMLP),))
    layer = TransformerLayer(cfg, state, 1, spec=one)
    assert [(n, type(m)) for n, m in layer.named_children()] == [
        ("input_layernorm", LayerNorm), ("mlp", SquaredReLUMLP)]
    assert [(b.kind, b.norm, b.op) for b in layer.blocks()] == [
        ("mlp", layer.input_layernorm, layer.mlp)]
