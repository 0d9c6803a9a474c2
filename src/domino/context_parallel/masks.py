"""Masks by true position, and the dense (single-block) attention the gathering variants run.

Under context parallelism a rank's tokens are not contiguous (a head and a tail chunk) and the
keys it sees arrive in shard order, so masks are built from each token's true position, never
from its index. The conventions are :func:`domino.transformer.kernels.attention`'s: bool masks,
True = masked out; a masked score takes the dtype's minimum, so a query whose keys are all
masked averages every key uniformly and stays finite instead of turning into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Masking:
    """What a query may not see: the causal rule (with a sliding ``window``: keys ``window``
    or more positions back are masked too; like ``kernels.attention``, a window only applies
    to causal attention), padded keys, and keys of another document. ``key_padding`` (True =
    pad) and ``document_ids`` are [b, S] over the true positions of the whole sequence."""

    causal: bool = True
    window: int | None = None
    key_padding: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    @property
    def by_data(self) -> bool:
        """Whether the mask depends on the batch (padding, documents), not only positions."""
        return self.key_padding is not None or self.document_ids is not None

    @property
    def only_causal(self) -> bool:
        return self.causal and self.window is None and not self.by_data

    def hides_all(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """Whether positions alone mask every (query, key) pair of the ranges [lo, hi)."""
        if not self.causal:
            return False
        if k_lo > q_hi - 1:  # every key lies after every query
            return True
        return self.window is not None and k_hi - 1 <= q_lo - self.window

    def shows_all(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """Whether positions alone mask no pair of the ranges (the causal part can be left
        out of the mask)."""
        if not self.causal:
            return True
        if k_hi - 1 > q_lo:
            return False
        return self.window is None or k_lo > q_hi - 1 - self.window

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor,
             positional: bool = True) -> torch.Tensor | None:
        """Bool [b or 1, len(q_pos), len(k_pos)], True = masked, for queries and keys at those
        true positions (None: nothing is masked); ``positional=False`` leaves the causal and
        window rule out (the caller knows it masks nothing there)."""
        out = None
        if self.causal and positional:
            q, k = q_pos.unsqueeze(1), k_pos.unsqueeze(0)
            out = k > q
            if self.window is not None:
                out = out | (k <= q - self.window)
            out = out.unsqueeze(0)
        if self.key_padding is not None:
            pad = self.key_padding.index_select(1, k_pos).unsqueeze(1)  # [b, 1, sk]
            out = pad if out is None else out | pad
        if self.document_ids is not None:
            docs = self.document_ids
            other = docs.index_select(1, q_pos).unsqueeze(2) != \
                docs.index_select(1, k_pos).unsqueeze(1)  # [b, sq, sk]
            out = other if out is None else out | other
        return out


@dataclass(frozen=True)
class SequenceMask:
    """A model's self-attention mask given per token rather than per (query, key) pair: what a
    context-parallel model takes as its ``attention_mask`` (each rank holds a shard of the
    queries, so a dense [s, s] mask of the whole sequence is not what it needs).
    ``document_ids`` (attention stays within a document) and ``key_padding`` (bool, True = a
    padded key) are [b, S] over the whole sequence in true order (every rank the same) or this
    rank's shard [b, S/cp] of it; either may be None. Combined with the model's causal rule."""

    document_ids: torch.Tensor | None = None
    key_padding: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shapes = {tuple(t.shape) for t in (self.document_ids, self.key_padding) if t is not None}
        if len(shapes) > 1 or any(len(shape) != 2 for shape in shapes):
            raise ValueError(f"SequenceMask: document_ids and key_padding must both be [b, s]; "
                             f"got shapes {sorted(shapes)}")
        if self.key_padding is not None and self.key_padding.dtype != torch.bool:
            raise ValueError("SequenceMask: key_padding must be bool, True = a padded key")

    @property
    def batch(self) -> int | None:
        t = self.document_ids if self.document_ids is not None else self.key_padding
        return None if t is None else t.shape[0]

    def rows(self, start: int, stop: int) -> SequenceMask:
        """The mask of samples ``start`` .. ``stop - 1`` (a micro-batch)."""
        return SequenceMask(*(None if t is None else t[start:stop]
                              for t in (self.document_ids, self.key_padding)))

    def dense(self) -> torch.Tensor | None:
        """The bool mask [b, 1, s, s] (True = masked) of an unsharded sequence, without the
        causal rule: what ``kernels.attention`` takes."""
        out = None
        if self.key_padding is not None:
            out = self.key_padding[:, None, None, :]
        if self.document_ids is not None:
            docs = self.document_ids
            other = (docs[:, :, None] != docs[:, None, :]).unsqueeze(1)
            out = other if out is None else out | other
        return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, *, is_causal: bool, scale: float,
                    q_per_group: int) -> torch.Tensor:
    """softmax(scale q k^T, masked) v for q [sq, b, n, d], k/v [sk, b, n / q_per_group, d]
    -> [sq, b, n*d], differentiable by autograd. ``mask`` bool [b or 1, sq, sk] (True =
    masked), or None and ``is_causal`` for plain causal attention in true order. bf16 / fp16
    inputs are computed in fp32 (softmax statistics in fp32) and the result cast back."""
    dtype = q.dtype
    if dtype in LOW_PRECISION:
        q, k, v = q.float(), k.float(), v.float()
    if q_per_group > 1:  # each K/V head serves q_per_group consecutive query heads
        k = k.repeat_interleave(q_per_group, dim=2)
        v = v.repeat_interleave(q_per_group, dim=2)
    sq, b, n, d = q.shape
    qh, kh, vh = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    if mask is None:
        kwargs: dict = {"is_causal": is_causal}
    else:
        # Added, not filled: a fully masked row gets the same score everywhere (the minimum
        # absorbs the real score), as kernels.attention does.
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        kwargs = {"attn_mask": bias.masked_fill(mask, torch.finfo(q.dtype).min).unsqueeze(1)}
    ctx = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, **kwargs)
    return ctx.permute(2, 0, 1, 3).reshape(sq, b, n * d).to(dtype)
