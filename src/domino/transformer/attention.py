"""Self and cross attention, tensor-parallel over heads, with GQA, RoPE, masks and a KV cache.

Each module is a block op (:class:`~domino.transformer.layer.BlockOp`): ``core(x, mb, stash)``
runs everything from the column-parallel entry to the input of the row-parallel ``dense``, so
that its exit (``exit()``: ``dense``'s partial sums, summed over TP) can run ``dense`` in column
chunks while a schedule launches each chunk's collective. Heads are split over
TP ranks; the fused QKV weight is laid out per query group as ``[q heads of the group | k | v]``
so that a contiguous TP shard holds whole groups.

Under context parallelism (the state's ``cp`` group has more than one rank) each rank holds a
load-balanced shard of every sequence (``domino.context_parallel``) and self attention runs
across the group by :func:`~domino.context_parallel.context_attention`; causality and the
sliding window go by true position, which RoPE also takes from the caller's position ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint
from torch import nn

from domino.config import TransformerConfig
from domino.context_parallel import (
    SequenceMask,
    check_dropout,
    check_heads,
    check_sinks,
    check_softcap,
    context_attention,
)
from domino.parallel_state import ParallelState
from domino.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from domino.tensor_parallel.layers import WgradStash
from domino.tensor_parallel.mappings import sum_grads_over
from domino.tensor_parallel.placement import Placement, place
from domino.transformer.exits import ColumnParallelEntry, RowParallelExit
from domino.transformer.kernels import Kernels, attention_keep
from domino.transformer.microbatch import MicroBatch
from domino.transformer.norms import ShardedRMSNorm, build_norm
from domino.transformer.ring_entry import RingEntry
from domino.transformer.rope import cos_sin_scale, layer_angles
from domino.utils import divide

if TYPE_CHECKING:
    from domino.transformer.edge import EdgeContext
    from domino.transformer.spec import LayerArgs


def _recomputed(fn, gen: torch.Generator, *args):
    """``fn(*args)`` whose intermediate tensors are not kept but recomputed in backward
    (selective recomputation: the core attention's s x s scores and probabilities), through
    ``torch.utils.checkpoint``; the dropout stream ``gen`` replays the forward's masks, and is
    left where the forward left it."""
    start = gen.get_state()
    calls = 0

    def run(*a):
        nonlocal calls
        calls += 1
        if calls == 1:  # the forward itself
            return fn(*a)
        after = gen.get_state()
        gen.set_state(start)
        try:
            return fn(*a)
        finally:
            gen.set_state(after)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)


def _mb_slice(mask, mb: MicroBatch, b: int) -> torch.Tensor | None:
    """The micro-batch's rows of a mask whose batch dim is the full batch (or broadcast); a
    :class:`SequenceMask` (of a whole, unsharded sequence here) as a dense mask."""
    if isinstance(mask, SequenceMask):
        return mask.rows(mb.batch_start, mb.batch_start + b).dense()
    if mask is None or mask.dim() < 4 or mask.shape[0] == 1:
        return mask
    return mask[mb.batch_start:mb.batch_start + b]


class _AttentionBase(nn.Module):
    def __init__(self, config: TransformerConfig, state: ParallelState, layer_number: int,
                 device: torch.device | None, recompute: bool = False,
                 kernels: Kernels | None = None) -> None:
        super().__init__()
        tp = state.tp
        self.kernels = kernels if kernels is not None else Kernels()
        self.layer_number = layer_number
        self.rng = state.rng
        self.head_dim = config.kv_channels
        self.heads = divide(config.num_attention_heads, tp.size)  # per rank
        self.groups = divide(config.num_query_groups, tp.size)  # per rank
        self.q_per_group = divide(config.num_attention_heads, config.num_query_groups)
        self.dropout_p = config.attention_dropout
        self.softmax_fp32 = config.attention_softmax_in_fp32
        self.softmax_scale = config.softmax_scale  # None: 1/sqrt(head_dim)
        self.softcap = config.attention_softcap
        self.sinks: nn.Parameter | None = None  # (SelfAttention's, when the model has them)
        self.recompute = recompute  # selective recomputation of the core attention
        self.cp = state.cp
        self.dense = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, group=tp,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            init_method=config.output_layer_init_method, params_dtype=config.params_dtype,
            device=device)

    def entry(self, edges: EdgeContext) -> ColumnParallelEntry:
        """Entered by the column-parallel Q/K/V GEMMs (a :class:`~.layer.BlockOp`)."""
        return ColumnParallelEntry(self.dense.group, edges.sequence_parallel)

    def exit(self, edges: EdgeContext) -> RowParallelExit:
        """Left by the row-parallel ``dense``'s partial sums (a :class:`~.layer.BlockOp`)."""
        return RowParallelExit(self.dense, edges.sequence_parallel)

    def _attend(self, q, k, v, mask, causal=False, kernels: Kernels | None = None,
                window: int | None = None):
        gen = self.rng.model_parallel(q.device)  # heads differ per rank: TP-distinct masks
        kernels = kernels or self.kernels

        def attend(q, k, v):
            # The dropout mask is drawn here, eagerly, also when recomputed (see _recomputed).
            keep = attention_keep(q, k.shape[0], self.dropout_p, self.training, gen, v.dtype)
            return kernels.attention(q, k, v, mask, causal, keep, self.dropout_p,
                                     self.softmax_fp32, self.q_per_group, window,
                                     self.softmax_scale, self.softcap, self.sinks)

        if self.recompute and torch.is_grad_enabled():
            return _recomputed(attend, gen, q, k, v)
        return attend(q, k, v)


class SelfAttention(_AttentionBase):
    """Multi-head / grouped-query self attention; heads split over TP ranks. ``recompute``:
    the core attention's activations are recomputed in backward (selective recomputation)."""

    def __init__(self, config: TransformerConfig, state: ParallelState, layer_number: int,
                 device: torch.device | None = None, *, recompute: bool = False,
                 kernels: Kernels | None = None, cp_kind: str = "ring") -> None:
        super().__init__(config, state, layer_number, device, recompute, kernels)
        self.cp_kind = cp_kind  # a domino.context_parallel kind (RuntimeConfig.cp_kind)
        # The ring's transfers under compute (a stack's set_ring_overlap may turn it off).
        self.cp_overlap = True
        if self.cp.size > 1:
            check_dropout(config.attention_dropout, self.cp.size)
            check_softcap(config.attention_softcap, self.cp.size)
            check_sinks(config.attention_sinks, self.cp.size)
            if cp_kind == "alltoall":
                check_heads(config.num_attention_heads, config.num_query_groups,
                            self.cp.size, state.tp.size)
        width = config.num_query_groups * (self.q_per_group + 2) * self.head_dim
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, width, group=state.tp,
            bias=config.add_bias_linear or config.add_qkv_bias,
            init_method=config.init_method, params_dtype=config.params_dtype, device=device)
        if config.attention_sinks:  # GPT-OSS's: a logit per head, sharded with the heads
            self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=config.params_dtype,
                                                  device=device))
            place(self.sinks, Placement("tp", 0))
        # A sliding window unless this layer is one of the model's full-attention layers.
        self.window = (None if layer_number - 1 in config.full_attention_layers
                       else config.window_size)
        # RoPE's angles, unless this layer is one of the model's NoPE layers (SmolLM3's); a
        # sliding layer's own where the model has them (Gemma 3's).
        self.rope = layer_number - 1 not in config.nope_layers
        self.local_rope = self.window is not None
        # A RoPE scaling's attention factor, or 1 (sliding layers with their own base have no
        # scaling).
        self.rope_scale = (1.0 if self.local_rope and config.local_rotary_base is not None
                           else cos_sin_scale(config))
        self.qk_full_width = config.qk_layernorm_full_width  # (implies qk_layernorm)
        if self.qk_full_width:  # over all heads (OLMoE): sharded like the heads
            args = (config.layernorm_epsilon, config.params_dtype, device, state.tp,
                    config.layernorm_zero_centered_gamma, config.norm_scale_in_fp32)
            self.q_layernorm = ShardedRMSNorm(self.heads * self.head_dim, *args)
            self.k_layernorm = ShardedRMSNorm(self.groups * self.head_dim, *args)
        elif config.qk_layernorm:  # per head, replicated: every rank's heads add to its gradient
            self.q_layernorm = build_norm(config, device, self.head_dim)
            self.k_layernorm = build_norm(config, device, self.head_dim)
        self.qk_layernorm = config.qk_layernorm

    @classmethod
    def build(cls, args: LayerArgs) -> SelfAttention:
        """A layer's self attention (a part of :mod:`~domino.transformer.spec`)."""
        return cls(args.config, args.state, args.layer_number, args.device,
                   recompute=args.recompute_attention, kernels=args.kernels,
                   cp_kind=args.cp_kind)

    def entry(self, edges: EdgeContext) -> ColumnParallelEntry | RingEntry:
        """Entered by the column-parallel Q/K/V GEMMs (a :class:`~.layer.BlockOp`); in a run
        whose sequences are split over CP by the overlapped ring (not under sequence
        parallelism), by the GEMM and the ring's first exchange (``ring_entry``)."""
        if (edges.context_parallel and self.cp_kind == "ring" and self.cp_overlap
                and not edges.sequence_parallel):
            return RingEntry(self)
        return ColumnParallelEntry(self.dense.group, edges.sequence_parallel)

    def core(self, x: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll=None) -> torch.Tensor:
        b = x.shape[1]
        qkv = self.project(x, stash)
        if poll is not None:  # a schedule's work between the GEMM and the attention
            poll()
        q, k, v = self.split(qkv, mb)
        if self.cp.size > 1 and mb.inference_params is None:
            return self.context_attend(q, k, v, mb)
        k, v = self._cache(k, v, mb)
        return self._attend(q, k, v, _mb_slice(mb.self_mask, mb, b), mb.causal,
                            self.kernels.serving(mb.inference_params is not None), self.window)

    def project(self, x: torch.Tensor, stash: WgradStash | None) -> torch.Tensor:
        """The fused Q/K/V GEMM [s, b, h] -> [s, b, width / tp] (dL/dx left unreduced)."""
        return self.query_key_value(x, reduce_input_grad=False, wgrad_stash=stash)[0]

    def split(self, qkv: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        """q [s, b, heads, d], k, v [s, b, groups, d] from the GEMM's output (Q/K norms, RoPE)."""
        kernels = self.kernels.serving(mb.inference_params is not None)
        rotary = None
        if self.rope and mb.rotary is not None:
            rotary = layer_angles(mb.rotary, self.local_rope)
        if self.qk_full_width:
            return kernels.split_qkv(self._full_width_norms(qkv), rotary, self.groups,
                                     self.q_per_group, self.head_dim,
                                     rotary_scale=self.rope_scale)
        return kernels.split_qkv(qkv, rotary, self.groups, self.q_per_group, self.head_dim,
                                 *self._qk_norms(), rotary_scale=self.rope_scale)

    def _full_width_norms(self, qkv: torch.Tensor) -> torch.Tensor:
        """The GEMM's output with its queries and keys normalised over all heads (OLMoE's
        norms: our per-group layout, flattened, is their projections' channel order)."""
        s, b = qkv.shape[:2]
        g = qkv.view(s, b, self.groups, self.q_per_group + 2, self.head_dim)
        q = self.q_layernorm(g[:, :, :, :-2].reshape(s, b, -1))
        k = self.k_layernorm(g[:, :, :, -2].reshape(s, b, -1))
        return torch.cat([q.view(s, b, self.groups, self.q_per_group, self.head_dim),
                          k.view(s, b, self.groups, 1, self.head_dim), g[:, :, :, -1:]],
                         dim=3).view(s, b, -1)

    def context_attend(self, q, k, v, mb: MicroBatch, first: tuple | None = None,
                       poll=None, defer: list | None = None) -> torch.Tensor:
        """Attention of this rank's sequence shard against the whole sequence over the CP
        group (``first``, ``poll``, ``defer``: see ``ring_entry``). Not under selective
        recomputation: ring attention keeps no s x s tensor for backward, and recomputing would
        repeat the exchanges. (KV-cache decoding does not come here: weights are whole on every
        CP rank, so one rank generates alone from whole, unsharded sequences.)"""
        mask = mb.self_mask  # a SequenceMask or None (DominoTransformer.forward checks)
        mask = (mask or SequenceMask()).rows(mb.batch_start, mb.batch_start + q.shape[1])
        return context_attention(q, k, v, group=self.cp, kind=self.cp_kind,
                                 causal=mb.causal, q_per_group=self.q_per_group,
                                 key_padding=mask.key_padding, document_ids=mask.document_ids,
                                 window=self.window, softmax_scale=self.softmax_scale,
                                 overlap=self.cp_overlap, first=first,
                                 poll=poll, tags={"mb": mb.index}, defer=defer)

    def _qk_norms(self) -> tuple:
        """The query and key norms' kernel arguments (none without ``qk_layernorm``), their
        weights' gradients summed over TP: each rank's heads contribute a part."""
        if not self.qk_layernorm:
            return ()
        q, k = self.q_layernorm(), self.k_layernorm()
        tensors = [t for t in (*q[:2], *k[:2]) if t is not None]
        summed = iter(sum_grads_over(tensors, self.dense.group))
        return tuple((next(summed), None if a[1] is None else next(summed), *a[2:])
                     for a in (q, k))

    def _cache(self, k: torch.Tensor, v: torch.Tensor, mb: MicroBatch):
        params = mb.inference_params
        if params is None:
            return k, v
        cache = params.key_value_memory_dict.get(self.layer_number)
        if cache is None:
            shape = (params.max_sequence_length, params.max_batch_size, *k.shape[2:])
            cache = (k.new_zeros(shape), v.new_zeros(shape))
            params.key_value_memory_dict[self.layer_number] = cache
        s0 = params.sequence_len_offset
        s1 = s0 + k.shape[0]
        if s1 > params.max_sequence_length:
            raise ValueError(f"inference step reaches position {s1}, past max_sequence_length="
                             f"{params.max_sequence_length} of the InferenceParams.")
        b0 = params.batch_size_offset + mb.batch_start
        b1 = b0 + k.shape[1]
        cache[0][s0:s1, b0:b1] = k
        cache[1][s0:s1, b0:b1] = v
        return cache[0][:s1, b0:b1], cache[1][:s1, b0:b1]


class CrossAttention(_AttentionBase):
    """Queries from the decoder, keys/values from the encoder output (``mb.memory``)."""

    def __init__(self, config: TransformerConfig, state: ParallelState, layer_number: int,
                 device: torch.device | None = None, *, recompute: bool = False,
                 kernels: Kernels | None = None) -> None:
        super().__init__(config, state, layer_number, device, recompute, kernels)
        if self.cp.size > 1:
            raise ValueError("cross attention (an encoder-decoder model) is not supported with "
                             f"context parallelism (context_parallel_size {self.cp.size}): use "
                             "a CP size of 1.")
        self.query = ColumnParallelLinear(
            config.hidden_size, config.num_attention_heads * self.head_dim, group=state.tp,
            bias=config.add_bias_linear, init_method=config.init_method,
            params_dtype=config.params_dtype, device=device)
        self.key_value = ColumnParallelLinear(
            config.hidden_size, 2 * config.num_query_groups * self.head_dim, group=state.tp,
            bias=config.add_bias_linear, init_method=config.init_method,
            params_dtype=config.params_dtype, device=device)

    @classmethod
    def build(cls, args: LayerArgs) -> CrossAttention:
        """A decoder layer's cross attention (a part of :mod:`~domino.transformer.spec`)."""
        return cls(args.config, args.state, args.layer_number, args.device,
                   recompute=args.recompute_attention, kernels=args.kernels)

    def core(self, x: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll=None) -> torch.Tensor:
        if mb.memory is None:
            raise ValueError("cross attention needs the encoder output (enc_hidden_states or an "
                             "encoder in the model).")
        sq, b, _ = x.shape
        sk = mb.memory.shape[0]
        q, _ = self.query(x, reduce_input_grad=False, wgrad_stash=stash)
        kv, _ = self.key_value(mb.memory, reduce_input_grad=False, wgrad_stash=stash)
        if poll is not None:
            poll()
        q = q.view(sq, b, self.heads, self.head_dim)
        kv = kv.view(sk, b, self.groups, 2, self.head_dim)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
        return self._attend(q, k, v, _mb_slice(mb.cross_mask, mb, b),
                            kernels=self.kernels.serving(mb.inference_params is not None))
