"""Self and cross attention, tensor-parallel over heads, with GQA, RoPE, masks and a KV cache.

Each module is a block op (:class:`~domino.transformer.layer.BlockOp`): ``core(x, mb, stash)``
runs everything from the column-parallel entry to the input of the row-parallel ``dense``, so
that its exit (``exit()``: ``dense``'s partial sums, summed over TP) can run ``dense`` in column
chunks while a schedule launches each chunk's collective. Heads are split over
TP ranks; the fused QKV weight is laid out per query group as ``[q heads of the group | k | v]``
so that a contiguous TP shard holds whole groups.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from domino.config import TransformerConfig
from domino.parallel_state import ParallelState
from domino.tensor_parallel import ColumnParallelLinear, RowParallelLinear, dropout
from domino.tensor_parallel.layers import WgradStash
from domino.transformer.exits import ColumnParallelEntry, RowParallelExit
from domino.transformer.microbatch import MicroBatch
from domino.transformer.rope import apply_rotary
from domino.utils import divide


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool, p: float, training: bool, generator: torch.Generator,
                   softmax_fp32: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), masked) v for q [sq, b, n, d], k/v [sk, b, n, d] -> [sq, b, n*d].

    ``mask`` is bool (True = masked out); ``causal`` adds the causal rule. Masked scores take the
    dtype's minimum rather than -inf: a row whose keys are all masked (e.g. a padding query) stays
    finite instead of turning into NaN. Without active dropout this runs PyTorch's fused
    scaled_dot_product_attention (no s x s tensor kept for backward); with dropout the masks must
    come from our TP-aware generator, so it runs the explicit softmax.
    """
    sq, b, n, d = q.shape
    sk = k.shape[0]
    qh, kh, vh = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b,n,s,d]
    # bf16 / fp16 on a CPU: PyTorch's batched matmuls and its fused (flash) SDPA kernel are
    # several times slower there than its math SDPA backend, and than fp32 batched matmuls
    # (scripts/attention_paths.py; docs/performance.md#attention).
    low_cpu = q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
    if not training or p == 0.0:
        kwargs: dict = {"is_causal": True}
        if not (mask is None and causal and sq == sk):
            merged = _merge_masks(mask, causal, sq, sk, q.device)
            bias = None
            if merged is not None:
                bias = torch.zeros(merged.shape, dtype=q.dtype, device=q.device)
                bias = bias.masked_fill(merged, torch.finfo(q.dtype).min)
            kwargs = {"attn_mask": bias}
        with sdpa_kernel(SDPBackend.MATH) if low_cpu else contextlib.nullcontext():
            ctx = F.scaled_dot_product_attention(qh, kh, vh, **kwargs)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, n * d)
    # Dropout: the masks come from our generator, so the softmax is explicit. On a CPU in low
    # precision its two batched matmuls run in fp32 (the dropout mask is still drawn on the
    # bf16/fp16 probabilities: the same draws).
    def mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x.float(), y.float()) if low_cpu else torch.matmul(x, y)

    scores = mm(qh, kh.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    if softmax_fp32:
        scores = scores.float()
    merged = _merge_masks(mask, causal, sq, sk, q.device)
    if merged is not None:
        scores = scores.masked_fill(merged, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    probs = dropout(probs, p, training, generator)
    ctx = mm(probs, vh).to(v.dtype)  # [b, n, sq, d]
    return ctx.permute(2, 0, 1, 3).reshape(sq, b, n * d)


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


def causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """[sq, sk] bool, True where key j lies after query i (queries are the last sq positions)."""
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    return torch.arange(sk, device=device).unsqueeze(0) > q_pos


def _merge_masks(mask: torch.Tensor | None, causal: bool, sq: int, sk: int,
                 device: torch.device) -> torch.Tensor | None:
    if not causal:
        return mask
    c = causal_mask(sq, sk, device)
    return c if mask is None else (mask | c)


def _mb_slice(mask: torch.Tensor | None, mb: MicroBatch, b: int) -> torch.Tensor | None:
    """The micro-batch's rows of a mask whose batch dim is the full batch (or broadcast)."""
    if mask is None or mask.dim() < 4 or mask.shape[0] == 1:
        return mask
    return mask[mb.batch_start:mb.batch_start + b]


class _AttentionBase(nn.Module):
    def __init__(self, config: TransformerConfig, state: ParallelState, layer_number: int,
                 device: torch.device | None, recompute: bool = False) -> None:
        super().__init__()
        tp = state.tp
        self.layer_number = layer_number
        self.rng = state.rng
        self.head_dim = config.kv_channels
        self.heads = divide(config.num_attention_heads, tp.size)  # per rank
        self.groups = divide(config.num_query_groups, tp.size)  # per rank
        self.q_per_group = divide(config.num_attention_heads, config.num_query_groups)
        self.dropout_p = config.attention_dropout
        self.softmax_fp32 = config.attention_softmax_in_fp32
        self.recompute = recompute  # selective recomputation of the core attention
        self.dense = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, group=tp,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            init_method=config.output_layer_init_method, params_dtype=config.params_dtype,
            device=device)

    def entry(self, sequence_parallel: bool) -> ColumnParallelEntry:
        """Entered by the column-parallel Q/K/V GEMMs (a :class:`~.layer.BlockOp`)."""
        return ColumnParallelEntry(self.dense.group, sequence_parallel)

    def exit(self, sequence_parallel: bool) -> RowParallelExit:
        """Left by the row-parallel ``dense``'s partial sums (a :class:`~.layer.BlockOp`)."""
        return RowParallelExit(self.dense, sequence_parallel)

    def _attend(self, q, k, v, mask, causal=False):
        k = k.repeat_interleave(self.q_per_group, dim=2) if self.q_per_group > 1 else k
        v = v.repeat_interleave(self.q_per_group, dim=2) if self.q_per_group > 1 else v
        gen = self.rng.model_parallel(q.device)  # heads differ per rank: TP-distinct masks
        if self.recompute and torch.is_grad_enabled():
            return _recomputed(core_attention, gen, q, k, v, mask, causal, self.dropout_p,
                               self.training, gen, self.softmax_fp32)
        return core_attention(q, k, v, mask, causal, self.dropout_p, self.training, gen,
                              self.softmax_fp32)


class SelfAttention(_AttentionBase):
    """Multi-head / grouped-query self attention; heads split over TP ranks. ``recompute``:
    the core attention's activations are recomputed in backward (selective recomputation)."""

    def __init__(self, config: TransformerConfig, state: ParallelState, layer_number: int,
                 device: torch.device | None = None, *, recompute: bool = False) -> None:
        super().__init__(config, state, layer_number, device, recompute)
        width = config.num_query_groups * (self.q_per_group + 2) * self.head_dim
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, width, group=state.tp, bias=config.add_bias_linear,
            init_method=config.init_method, params_dtype=config.params_dtype, device=device)

    def core(self, x: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll=None) -> torch.Tensor:
        sq, b, _ = x.shape
        qkv, _ = self.query_key_value(x, reduce_input_grad=False, wgrad_stash=stash)
        if poll is not None:  # a schedule's work between the GEMM and the attention
            poll()
        qkv = qkv.view(sq, b, self.groups, self.q_per_group + 2, self.head_dim)
        q = qkv[:, :, :, :self.q_per_group].reshape(sq, b, self.heads, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [s, b, groups, d]
        if mb.rotary is not None:
            q, k = apply_rotary(q, mb.rotary), apply_rotary(k, mb.rotary)
        k, v = self._cache(k, v, mb)
        return self._attend(q, k, v, _mb_slice(mb.self_mask, mb, b), mb.causal)

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
                 device: torch.device | None = None, *, recompute: bool = False) -> None:
        super().__init__(config, state, layer_number, device, recompute)
        self.query = ColumnParallelLinear(
            config.hidden_size, config.num_attention_heads * self.head_dim, group=state.tp,
            bias=config.add_bias_linear, init_method=config.init_method,
            params_dtype=config.params_dtype, device=device)
        self.key_value = ColumnParallelLinear(
            config.hidden_size, 2 * config.num_query_groups * self.head_dim, group=state.tp,
            bias=config.add_bias_linear, init_method=config.init_method,
            params_dtype=config.params_dtype, device=device)

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
        return self._attend(q, k, v, _mb_slice(mb.cross_mask, mb, b))
