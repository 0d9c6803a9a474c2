"""``context_attention``: one call for every context-parallel attention variant, and the checks
a configuration must pass before it runs one."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from domino.context_parallel.gathered import allgather_attention, alltoall_attention
from domino.context_parallel.masks import Masking, dense_attention
from domino.context_parallel.ring import ring_attention
from domino.context_parallel.sharding import check_sequence_length, gather_sequence
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.handles import Arriving, InFlight

KINDS = ("ring", "allgather", "alltoall")


def check_kind(kind: str) -> None:
    """Raise ValueError unless ``kind`` is one of :data:`KINDS`."""
    if kind not in KINDS:
        raise ValueError(f"context-parallel attention kind {kind!r} is not one of "
                         f"{', '.join(KINDS)}.")


def check_heads(num_heads: int, num_groups: int, cp: int, tp: int = 1) -> None:
    """Raise ValueError unless all-to-all (Ulysses) can give each of ``cp`` ranks whole query
    heads and whole K/V groups of its TP rank's (``num_heads``, ``num_groups``: the model's)."""
    if num_heads % (tp * cp) or num_groups % (tp * cp):
        raise ValueError(
            f"all-to-all context parallelism (cp_comm_type='a2a') gives each rank whole heads: "
            f"num_attention_heads={num_heads} and num_query_groups={num_groups} must both "
            f"be divisible by tensor_model_parallel_size x context_parallel_size = "
            f"{tp * cp} (tensor_model_parallel_size={tp}, context_parallel_size={cp}). "
            "Change those sizes, or use cp_comm_type='p2p' (ring attention: no such rule).")


def check_dropout(attention_dropout: float, cp: int) -> None:
    """Raise ValueError for attention dropout, which context-parallel attention lacks."""
    if attention_dropout:
        raise ValueError(
            f"attention_dropout={attention_dropout} is not supported with context parallelism "
            f"(context_parallel_size={cp}): context-parallel attention draws no dropout "
            "masks. Set attention_dropout=0, or context_parallel_size=1.")


def check_softcap(attention_softcap: float | None, cp: int) -> None:
    """Raise ValueError for soft-capped attention scores, which context-parallel attention
    lacks (its blockwise softmax and backward are written for uncapped scores)."""
    if attention_softcap is not None:
        raise ValueError(
            f"attention_softcap={attention_softcap} (Gemma 2's attention soft-capping) is not "
            f"supported with context parallelism (context_parallel_size={cp}): "
            "context-parallel attention computes uncapped scores. Use context_parallel_size=1 "
            "for this model.")


def check_sinks(attention_sinks: bool, cp: int) -> None:
    """Raise ValueError for attention sinks, which context-parallel attention lacks (its
    blockwise softmax has no extra logit in the denominator)."""
    if attention_sinks:
        raise ValueError(
            "attention_sinks=True (GPT-OSS's learned logit per head in the softmax) is not "
            f"supported with context parallelism (context_parallel_size={cp}): "
            "context-parallel attention has no sink in its softmax. Use "
            "context_parallel_size=1 for this model.")


def check_context_parallel(*, seq_length: int, context_parallel_size: int,
                           num_attention_heads: int, num_query_groups: int | None = None,
                           attention_dropout: float = 0.0, kind: str = "ring",
                           tensor_model_parallel_size: int = 1,
                           attention_softcap: float | None = None,
                           attention_sinks: bool = False) -> None:
    """Every configuration rule of context-parallel attention (ValueError naming the setting
    to change: its config field); nothing to check at ``context_parallel_size`` 1."""
    cp = context_parallel_size
    check_kind(kind)
    if cp == 1:
        return
    check_sequence_length(seq_length, cp)
    check_dropout(attention_dropout, cp)
    check_softcap(attention_softcap, cp)
    check_sinks(attention_sinks, cp)
    if kind == "alltoall":
        check_heads(num_attention_heads, num_query_groups or num_attention_heads, cp,
                    tensor_model_parallel_size)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      group: CommGroup | None, kind: str = "ring",
                      causal: bool = True, q_per_group: int = 1,
                      key_padding: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None, window: int | None = None,
                      softmax_scale: float | None = None,
                      dropout_p: float = 0.0, overlap: bool = True,
                      first: tuple[torch.Tensor, Arriving] | None = None,
                      poll: Callable[[], None] | None = None, tags: dict | None = None,
                      defer: list[InFlight] | None = None) -> torch.Tensor:
    """Attention of this rank's share of a sequence sharded over ``group`` (load-balanced:
    see :func:`shard_sequence`), like ``kernels.attention`` on the whole sequence.

    q [s/cp, b, n, d], k/v [s/cp, b, n / q_per_group, d] -> [s/cp, b, n*d]. ``kind``: ``ring``
    (overlapped K/V ring), ``allgather`` (gather K/V) or ``alltoall`` (Ulysses: heads).
    ``causal`` applies the causal rule by true position, ``window`` (with ``causal``) masks
    keys ``window`` or more positions back; ``key_padding`` (bool, True = pad) and
    ``document_ids`` (attention stays within a document) are [b, s] over the whole sequence
    (no communication), or this rank's shard [b, s/cp] of it, sharded like the tokens (then
    all-gathered here: a model that calls this per layer saves those by passing the whole
    masks). ``softmax_scale`` defaults to 1/sqrt(d). Every rank of ``group`` must call it with
    the same kind and the same kinds and shapes of masks. ``group`` None (or of one rank) is
    plain attention on the local sequence.

    A query that sees no key at all (masked scores take the dtype's minimum) gets the mean of
    every value; its backward takes each key's probability as 1, as PyTorch's fused CPU kernel
    does (what ``kernels.attention`` runs in fp32 on a CPU; see ``ring``).

    ``first`` (ring only): its first exchange, launched ahead (``ring.launch_first``);
    ``poll``: a schedule's work, run once (the ring: after the rank's own block, before the
    first wait; the others: before the attention); ``tags`` label the exchanges for a hook;
    ``defer`` (ring only): a list the backward leaves the other ranks' parts of dK/dV in, in
    flight (``ring.arrived_sum``: the caller adds them).
    """
    check_kind(kind)
    cp = 1 if group is None else group.size
    if (first is not None or defer is not None) and (kind != "ring" or cp == 1):
        raise ValueError(f"a first exchange launched ahead and a deferred backward are for "
                         f"ring attention over more than one rank, not kind {kind!r} over {cp}")
    s, b, n, d = q.shape
    if n % q_per_group or k.shape != (s, b, n // q_per_group, d) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} with q_per_group {q_per_group} needs k and v of "
                         f"shape {(s, b, n // q_per_group, d)}; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    check_dropout(dropout_p, cp)
    if window is not None and window < 1:
        raise ValueError(f"the attention window {window} must be a positive number of tokens")
    for name, t in (("key_padding", key_padding), ("document_ids", document_ids)):
        if t is not None and tuple(t.shape) not in ((b, s), (b, s * cp)):
            raise ValueError(f"{name} has shape {tuple(t.shape)}: give this rank's shard "
                             f"[{b}, {s}] or the whole sequence's [{b}, {s * cp}]")
    if cp > 1:
        check_sequence_length(s * cp, cp)
        if kind == "alltoall":
            check_heads(n, n // q_per_group, cp)
    masking = Masking(causal=causal, window=window,
                      key_padding=_whole(None if key_padding is None else key_padding.bool(),
                                         s * cp, group),
                      document_ids=_whole(document_ids, s * cp, group))
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    if kind == "ring" and cp > 1:
        return ring_attention(q, k, v, group=group, masking=masking, scale=scale,
                              overlap=overlap, first=first, poll=poll, tags=tags,
                              defer=defer)
    if poll is not None:
        poll()
    if cp == 1:
        pos = torch.arange(s, device=q.device)
        mask = None if masking.only_causal else masking.mask(pos, pos)
        return dense_attention(q, k, v, mask, is_causal=masking.only_causal, scale=scale,
                               q_per_group=q_per_group)
    variant = allgather_attention if kind == "allgather" else alltoall_attention
    return variant(q, k, v, group=group, masking=masking, scale=scale)


def _whole(mask: torch.Tensor | None, seq: int,
           group: CommGroup | None) -> torch.Tensor | None:
    """A [b, s] mask over the whole sequence: ``mask`` itself, or its shards gathered."""
    if mask is None:
        return None
    if mask.shape[1] == seq:
        return mask
    return gather_sequence(mask, group, dim=1)
