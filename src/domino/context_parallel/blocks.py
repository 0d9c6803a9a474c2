"""Attention of this rank's queries to one block of K/V at a time, in fp32, merged by
log-sum-exp: the arithmetic every context-parallel variant shares (``ring`` moves the blocks,
``gathered`` gathers them).

Each rank's queries and each block's keys are two chunks (head and tail, see ``sharding``), so
attention runs per pair of chunks: a pair that the positions mask completely (a later chunk's
keys for a causal query chunk, or keys out of the window) or the data mask completely is not
computed. Masked scores take the fp32 minimum as in ``kernels.attention``: a row whose keys are
all masked then averages every key uniformly. A skipped pair still contributes that uniform
share (its keys' V sum, at score "minimum"), which is exactly zero for every row that sees any
key; in backward it is computed only when some local row sees no key at all. Such a row's
log-sum-exp is the minimum itself (log S is below its rounding), so its backward takes each
key's probability as exp(0) = 1, as PyTorch's fused attention kernel (what ``kernels.attention``
runs in fp32) does: the gradient of a padding query, whose loss weight is zero in training.

On a CPU every pair runs through PyTorch's fused (flash) attention kernel (``fused``), which
returns its rows' log-sum-exp: forward merges its normalised output by that, and backward
gives the kernel the merged output and log-sum-exp, so its probabilities are the whole row's
(no scores tensor; several times faster than explicit matmuls here). A pair nothing masks
takes no mask, the causal diagonal the kernel's own causal rule, any other pair an additive
mask (the minimum where masked, as ``kernels.attention`` builds it) per piece of rows. Other
devices take the explicit path: fp32 matmuls in pieces of rows, the same conventions.
"""

from __future__ import annotations

import torch

from domino.context_parallel.masks import Masking

MIN = torch.finfo(torch.float32).min  # the masked score: kernels.attention's convention
BLIND = MIN / 2  # a row's log-sum-exp below this: the row sees no key


# ---- layouts: heads outer, chunk (head / tail) next, so that a chunk is one slice ----------

def _q_rows(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[s, b, n, d] -> [b, g, 2, q_per_group * c, d]: a group's query rows per chunk."""
    s, b, n, d = x.shape
    qpg, c = n // groups, s // 2
    return x.reshape(2, c, b, groups, qpg, d).permute(2, 3, 0, 4, 1, 5).reshape(
        b, groups, 2, qpg * c, d)


def _q_seq(x: torch.Tensor, qpg: int) -> torch.Tensor:
    """The inverse of :func:`_q_rows` -> [s, b, n, d]."""
    b, g, _, rows, d = x.shape
    c = rows // qpg
    return x.reshape(b, g, 2, qpg, c, d).permute(2, 4, 0, 1, 3, 5).reshape(2 * c, b, g * qpg, d)


def kv_blocks(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [s, b, g, d] -> one contiguous [2 (k, v), b, g, 2 (chunk), c, d]: what travels."""
    s, b, g, d = k.shape
    return torch.stack([k, v]).reshape(2, 2, s // 2, b, g, d).permute(0, 3, 4, 1, 2, 5) \
        .contiguous()


def kv_seq(x: torch.Tensor) -> torch.Tensor:
    """[b, g, 2, c, d] -> [s, b, g, d]."""
    b, g, _, c, d = x.shape
    return x.permute(2, 3, 0, 1, 4).reshape(2 * c, b, g, d)


# ---- one pair of chunks ---------------------------------------------------------------------

def _plan(masking: Masking, qid: int, kid: int, c: int,
          device: torch.device) -> tuple[bool, torch.Tensor | None]:
    """(skip, mask [b or 1, c, c]) for query chunk ``qid`` against key chunk ``kid``."""
    q_lo, k_lo = qid * c, kid * c
    if masking.hides_all(q_lo, q_lo + c, k_lo, k_lo + c):
        return True, None
    positional = not masking.shows_all(q_lo, q_lo + c, k_lo, k_lo + c)
    if not positional and not masking.by_data:
        return False, None
    mask = masking.mask(torch.arange(q_lo, q_lo + c, device=device),
                        torch.arange(k_lo, k_lo + c, device=device), positional)
    # A data-dependent skip (a host sync on an accelerator): only where the data can mask.
    if masking.by_data and bool(mask.all()):
        return True, None
    return False, mask


BLOCK_ELEMENTS = 1 << 20  # scores per piece of a pair (4 MiB in fp32): bounds the transients


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fused_calls(masking: Masking, qid: int, kid: int, mask: torch.Tensor | None, qpg: int,
                 c: int, per_row: int, limit: int):
    """The fused kernel's calls for a computed pair: (lo, hi) of the query rows [qpg * c],
    is_causal, the additive mask [b or 1, 1, hi - lo, c] (None: nothing masked)."""
    if mask is None:  # nothing masked: one call (the kernel keeps no scores)
        yield 0, qpg * c, False, None
        return
    if qid == kid and masking.only_causal:  # the kernel's causal rule is by row: per head
        for h in range(qpg):
            yield h * c, (h + 1) * c, True, None
        return
    for lo, hi, rows in _row_blocks(qpg, c, per_row, limit):
        part = mask.unsqueeze(1).expand(-1, qpg, c, c).reshape(-1, qpg * c, c) \
            if rows is None else mask[:, rows[0]:rows[1]]
        yield lo, hi, False, torch.zeros(part.shape, device=part.device).masked_fill_(
            part, MIN).unsqueeze(1)


def _forward_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skip: bool, calls,
                   scale: float, m: torch.Tensor, z: torch.Tensor, acc: torch.Tensor) -> None:
    """One pair through the fused kernel, merged by its rows' log-sum-exp (normalised:
    a skipped pair is the uniform average of its keys at score "minimum", weight one)."""
    if skip:
        _merge(m, z, acc, torch.full_like(m, MIN), 1.0, v.mean(-2, keepdim=True))
        return
    for lo, hi, causal, bias in calls:
        out, lse = _FLASH(q[:, :, lo:hi], k, v, 0.0, causal, attn_mask=bias, scale=scale)
        _merge(m[:, :, lo:hi], z[:, :, lo:hi], acc[:, :, lo:hi], lse, 1.0, out)


def _backward_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, calls, scale: float,
                    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """One pair's gradients from the fused kernel, given the rows' merged output and
    log-sum-exp (so its probabilities are the whole row's), added into dq, dk, dv."""
    for lo, hi, causal, bias in calls:
        gq, gk, gv = _FLASH_BACKWARD(dout[:, :, lo:hi], q[:, :, lo:hi], k, v, out[:, :, lo:hi],
                                     lse[:, :, lo:hi], 0.0, causal, attn_mask=bias,
                                     scale=scale)
        dq[:, :, lo:hi].add_(gq)
        dk.add_(gk)
        dv.add_(gv)


def _row_blocks(qpg: int, c: int, per_row: int, limit: int):
    """[lo, hi) ranges of a chunk's query rows (laid out [qpg heads, c positions]) whose
    scores (``per_row`` each) stay within ``limit`` elements, and the positions (r0, r1)
    they cover within one head (None: all rows at once)."""
    if qpg * c * per_row <= limit:
        yield 0, qpg * c, None
        return
    step = min(c, max(1, limit // per_row))
    for h in range(qpg):
        for r0 in range(0, c, step):
            r1 = min(c, r0 + step)
            yield h * c + r0, h * c + r1, (r0, r1)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
            qpg: int, rows: tuple[int, int] | None) -> torch.Tensor:
    """scale q k^T [b, g, rows, c] in fp32, masked scores at the minimum; ``rows``: the
    positions of one head's rows (None: every row of the chunk)."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        if rows is None:
            b, g, n, c = s.shape
            s.view(b, g, qpg, n // qpg, c).masked_fill_(mask[:, None, None], MIN)
        else:
            s.masked_fill_(mask[:, None, rows[0]:rows[1]], MIN)
    return s


def _merge(m: torch.Tensor, z: torch.Tensor, acc: torch.Tensor, m_b: torch.Tensor,
           z_b: torch.Tensor | float, acc_b: torch.Tensor) -> None:
    """Fold one block's (row max, row sum, unnormalised output) into the running ones, in
    place: both are rescaled to the larger max (the log-sum-exp update)."""
    m_new = torch.maximum(m, m_b)
    old, new = torch.exp(m - m_new), torch.exp(m_b - m_new)
    z.mul_(old).add_(z_b * new)
    acc.mul_(old.unsqueeze(-1)).add_(acc_b * new.unsqueeze(-1))
    m.copy_(m_new)


def _forward_pair(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skip: bool,
                  mask: torch.Tensor | None, scale: float, qpg: int, m: torch.Tensor,
                  z: torch.Tensor, acc: torch.Tensor, limit: int) -> None:
    if skip:  # every score at the minimum: each key weighs exp(0) = 1 before rescaling
        c = k.shape[-2]
        _merge(m, z, acc, torch.full_like(m, MIN), float(c), v.sum(-2, keepdim=True))
        return
    b, g, n, _ = q.shape
    for lo, hi, rows in _row_blocks(qpg, n // qpg, b * g * k.shape[-2], limit):
        s = _scores(q[:, :, lo:hi], k, mask, scale, qpg, rows)
        m_b = s.amax(-1)
        p = torch.exp(s - m_b.unsqueeze(-1))
        _merge(m[:, :, lo:hi], z[:, :, lo:hi], acc[:, :, lo:hi], m_b, p.sum(-1),
               torch.matmul(p, v))


def _backward_pair(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor,
                   mask: torch.Tensor | None, scale: float, qpg: int, dq: torch.Tensor,
                   dk: torch.Tensor, dv: torch.Tensor, limit: int) -> None:
    """Add one pair's gradients into dq, dk, dv (fp32, in place)."""
    b, g, n, _ = q.shape
    for lo, hi, rows in _row_blocks(qpg, n // qpg, b * g * k.shape[-2], limit):
        s = _scores(q[:, :, lo:hi], k, mask, scale, qpg, rows)
        p = torch.exp(s - lse[:, :, lo:hi].unsqueeze(-1))  # the forward's probabilities
        ds = p * (torch.matmul(dout[:, :, lo:hi], v.transpose(-1, -2))
                  - delta[:, :, lo:hi].unsqueeze(-1))
        dq[:, :, lo:hi].add_(torch.matmul(ds, k), alpha=scale)
        dk.add_(torch.matmul(ds.transpose(-1, -2), q[:, :, lo:hi]), alpha=scale)
        dv.add_(torch.matmul(p.transpose(-1, -2), dout[:, :, lo:hi]))


# ---- a block of K/V against this rank's queries ------------------------------------------------

class BlockAttention:
    """This rank's queries q [s, b, n, d] (chunks ``mine``) attended to K/V blocks one at a
    time: each block's pairs are folded into running row statistics (:func:`_merge`), in fp32;
    :meth:`finish` gives the output and the rows' log-sum-exp."""

    def __init__(self, q: torch.Tensor, groups: int, mine: tuple[int, int], masking: Masking,
                 scale: float, limit: int, fused: bool) -> None:
        self.shape, self.dtype = q.shape, q.dtype
        self.q_rows = _q_rows(q, groups).float()  # [b, g, 2, qpg * c, d]
        self.m = torch.full(self.q_rows.shape[:-1], float("-inf"), device=q.device)
        self.z, self.acc = torch.zeros_like(self.m), torch.zeros_like(self.q_rows)
        self.mine, self.masking, self.scale = mine, masking, scale
        self.limit, self.fused, self.qpg = limit, fused, q.shape[2] // groups

    def add(self, block: torch.Tensor, theirs: tuple[int, int]) -> None:
        """Fold the attention to one K/V ``block`` [2, b, g, 2, c, d] (chunks ``theirs``)."""
        b, g, _, _, _ = self.q_rows.shape
        c = block.shape[-2]
        kv = block.float()
        for j, kid in enumerate(theirs):
            for i, qid in enumerate(self.mine):
                skip, mask = _plan(self.masking, qid, kid, c, block.device)
                args = (self.q_rows[:, :, i], kv[0, :, :, j], kv[1, :, :, j], skip)
                stats = (self.m[:, :, i], self.z[:, :, i], self.acc[:, :, i])
                if self.fused:
                    calls = _fused_calls(self.masking, qid, kid, mask, self.qpg, c, b * g * c,
                                         self.limit)
                    _forward_fused(*args, calls, self.scale, *stats)
                    continue
                _forward_pair(*args, mask, self.scale, self.qpg, *stats, self.limit)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the output [s, b, n*d] in q's dtype, the rows' log-sum-exp [b, g, 2, qpg * c])."""
        s, b, n, d = self.shape
        out = _q_seq(self.acc / self.z.unsqueeze(-1), self.qpg).reshape(s, b, n * d)
        return out.to(self.dtype), self.m + torch.log(self.z)


class BlockGrads:
    """The backward of :class:`BlockAttention`, block by block: from the queries q [s, b, n, d],
    the output's gradient and the forward's output and rows' log-sum-exp; dQ accumulates in
    ``dq`` (fp32, query-row layout)."""

    def __init__(self, q: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, groups: int, mine: tuple[int, int], masking: Masking,
                 scale: float, limit: int, fused: bool) -> None:
        s, b, n, d = q.shape
        self.q_rows = _q_rows(q, groups).float()
        self.dout = _q_rows(grad.reshape(s, b, n, d), groups).float()
        self.out_rows = _q_rows(out.reshape(s, b, n, d), groups).float()
        self.delta = (self.dout * self.out_rows).sum(-1)
        self.lse, self.mine, self.masking, self.scale = lse, mine, masking, scale
        self.limit, self.fused, self.qpg = limit, fused, n // groups
        # A skipped pair's probabilities are exactly zero except in rows that see no key.
        self.blind = [bool((lse[:, :, i] <= BLIND).any()) for i in range(2)]
        self.dq = torch.zeros_like(self.q_rows)
        self.dtype = q.dtype

    def dq_seq(self) -> torch.Tensor:
        """dQ [s, b, n, d] in q's dtype."""
        return _q_seq(self.dq, self.qpg).to(self.dtype)

    def add(self, block: torch.Tensor, theirs: tuple[int, int]) -> torch.Tensor:
        """The gradients of the queries against ``block`` (chunks ``theirs``): added into
        ``dq``; returns the block's dK/dV [2, b, g, 2, c, d] (fp32)."""
        b, g, _, _, _ = self.q_rows.shape
        c, device = block.shape[-2], block.device
        kv = block.float()
        grads = torch.zeros(block.shape, dtype=torch.float32, device=device)
        for j, kid in enumerate(theirs):
            for i, qid in enumerate(self.mine):
                skip, mask = _plan(self.masking, qid, kid, c, device)
                if skip:
                    if not self.blind[i]:
                        continue
                    mask = torch.ones((1, c, c), dtype=torch.bool, device=device)
                args = (self.q_rows[:, :, i], kv[0, :, :, j], kv[1, :, :, j], self.dout[:, :, i])
                if self.fused:
                    calls = _fused_calls(self.masking, qid, kid, mask, self.qpg, c, b * g * c,
                                         self.limit)
                    _backward_fused(*args, self.out_rows[:, :, i], self.lse[:, :, i], calls,
                                    self.scale, self.dq[:, :, i], grads[0, :, :, j],
                                    grads[1, :, :, j])
                    continue
                _backward_pair(*args, self.lse[:, :, i], self.delta[:, :, i], mask,
                               self.scale, self.qpg, self.dq[:, :, i], grads[0, :, :, j],
                               grads[1, :, :, j], self.limit)
        return grads
