"""Context parallelism (``domino.context_parallel``) at CP = 2 and 4, one spawn per size.

* sharding: shards are chunks r and 2*CP-1-r (written here from the definition), round-trip,
  true positions, equal causal work per rank, the sequence-length error;
* every kind (ring, allgather, alltoall) and mask (causal, + padding with rows that see no
  key, + documents, non-causal, GQA, sliding window, a softmax scale): output and dQ/dK/dV,
  reassembled in true order, equal ``kernels.attention`` on the whole sequence (fp32, 1e-5);
  bf16 inputs stay close to the fp32 result; masks given whole (not sharded) work alike; a
  strided sub-group (global ranks != group ranks) works too;
* every rank launches the same point-to-point exchanges in the same order, each before the
  compute of its step, even a rank that skips the compute of every visiting block;
* configuration errors (sequence length, heads for all-to-all, attention dropout) name the flags.
"""

from __future__ import annotations

import math

import pytest
import torch
from tp_helpers import TOL, one_thread, register, rel_err, tp_results

from domino import ParallelState
from domino.context_parallel import (
    KINDS,
    check_context_parallel,
    check_sequence_length,
    chunk_ids,
    context_attention,
    gather_sequence,
    local_positions,
    shard_order,
    shard_sequence,
    unshard_sequence,
)
from domino.transformer.kernels import attention

S, B, D = 32, 2, 8
# name -> heads, K/V groups, causal, padding, documents, window, softmax scale
CASES = {
    "causal": (4, 4, True, None, None, None, None),
    "causal_padding": (4, 4, True, "left", None, None, None),
    "causal_documents": (4, 4, True, None, "packed", None, None),
    "documents_padding_scale": (4, 4, True, "left", "packed", None, 0.2),
    "noncausal": (4, 4, False, None, None, None, None),
    "noncausal_padding": (4, 4, False, "sample", None, None, None),
    "gqa": (8, 4, True, None, None, None, None),
    "window": (4, 4, True, None, None, 5, None),
    "window_gqa_documents": (8, 4, True, "left", "packed", 7, None),
    "documents_by_rank": (4, 4, True, None, "by_rank", None, None),  # see _documents
}
BF16_CASE = "causal_padding"
WHOLE_CASE = "documents_padding_scale"
BLOCKED_CASE = "window_gqa_documents"  # GQA: the pieces are per head


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


# ---- the layout, from its definition ------------------------------------------------------------

def _shard(x: torch.Tensor, rank: int, cp: int, dim: int = 0) -> torch.Tensor:
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def _unshard(shards: list, dim: int = 0) -> torch.Tensor:
    cp = len(shards)
    chunks = [None] * (2 * cp)
    for r, x in enumerate(shards):
        chunks[r], chunks[2 * cp - 1 - r] = x.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _padding(kind: str | None, cp: int) -> torch.Tensor | None:
    """[B, S] True = pad. ``left``: sample 0's first 3 keys (its first queries under a causal
    mask see no key) and scattered keys of sample 1. ``sample``: sample 1 entirely (all its
    rows see no key, without a causal mask too)."""
    if kind is None:
        return None
    pad = torch.zeros(B, S, dtype=torch.bool)
    if kind == "left":
        pad[0, :3] = True
        pad[1, torch.randperm(S, generator=torch.Generator().manual_seed(3))[:8]] = True
    else:
        pad[0, [5, 17, 30]] = True
        pad[1] = True
    return pad


def _documents(kind: str | None, cp: int) -> torch.Tensor | None:
    """[B, S] document ids. ``packed``: documents of uneven lengths. ``by_rank``: chunk 0 and
    the last chunk are documents of their own, so CP rank 0 sees none of the visiting blocks
    (its tokens are those two chunks) and skips their compute."""
    if kind is None:
        return None
    if kind == "packed":
        cuts = [torch.tensor([0, 5, 6, 19, 27]), torch.tensor([0, 11, 12, 13])]
        ids = torch.zeros(B, S, dtype=torch.long)
        for b, starts in enumerate(cuts):
            ids[b, starts] = 1
            ids[b] = ids[b].cumsum(0)
        return ids
    c = S // (2 * cp)
    ids = torch.ones(B, S, dtype=torch.long)
    ids[:, :c], ids[:, -c:] = 0, 2
    return ids


def _inputs(name: str, cp: int, dtype=torch.float32) -> dict:
    heads, groups, causal, pad, docs, window, scale = CASES[name]
    gen = torch.Generator().manual_seed(list(CASES).index(name))
    return dict(q=torch.randn(S, B, heads, D, generator=gen).to(dtype),
                k=torch.randn(S, B, groups, D, generator=gen).to(dtype),
                v=torch.randn(S, B, groups, D, generator=gen).to(dtype),
                gout=torch.randn(S, B, heads * D, generator=gen).to(dtype),
                causal=causal, pad=_padding(pad, cp), docs=_documents(docs, cp),
                window=window, scale=scale, qpg=heads // groups)


def _reference(inp: dict) -> dict:
    """kernels.attention on the whole sequence (fp32): output and gradients."""
    q, k, v = (inp[n].float().clone().requires_grad_() for n in "qkv")
    d = q.shape[-1]
    # kernels.attention scales by 1/sqrt(d): another scale is the same attention of scaled q.
    factor = 1.0 if inp["scale"] is None else inp["scale"] * math.sqrt(d)
    mask = None
    if inp["pad"] is not None:
        mask = inp["pad"][:, None, None, :]
    if inp["docs"] is not None:
        other = (inp["docs"][:, :, None] != inp["docs"][:, None, :]).unsqueeze(1)
        mask = other if mask is None else mask | other
    out = attention(q * factor, k, v, mask, inp["causal"], None, 0.0, False, inp["qpg"],
                    inp["window"])
    (out * inp["gout"].float()).sum().backward()
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


# ---- what each rank runs ----------------------------------------------------------------------

def _run(group, rank: int, cp: int, kind: str, inp: dict, whole: bool = False,
         overlap: bool = True) -> dict:
    """This rank's output and gradients (its shards) for the case ``inp``; the masks are
    passed sharded, or ``whole``; ``overlap`` False: the ring's un-overlapped baseline."""
    q, k, v = (_shard(inp[n], rank, cp).requires_grad_() for n in "qkv")
    masks = {name: None if inp[key] is None else inp[key] if whole else
             _shard(inp[key], rank, cp, dim=1)
             for name, key in (("key_padding", "pad"), ("document_ids", "docs"))}
    out = context_attention(q, k, v, group=group, kind=kind, causal=inp["causal"],
                            q_per_group=inp["qpg"], window=inp["window"],
                            softmax_scale=inp["scale"], overlap=overlap, **masks)
    (out * _shard(inp["gout"], rank, cp)).sum().backward()
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, dtype=str(out.dtype))


def _traced(group, rank: int, cp: int) -> list:
    """The ring's exchanges and computed pairs, in order, for ``documents_by_rank`` (``group``
    is every rank: group ranks are global ranks): "X" with each op's (op, peer relative to this
    rank, shape, dtype, tag); "C" a computed pair; "backward" where the backward starts."""
    import torch.distributed as dist

    from domino.context_parallel import blocks

    log: list = []
    real = (dist.batch_isend_irecv, blocks._forward_pair, blocks._backward_pair,
            blocks._forward_fused, blocks._backward_fused)

    def exchange(ops):
        log.append(("X", [(op.op.__name__, (op.peer - rank) % cp, tuple(op.tensor.shape),
                           str(op.tensor.dtype), op.tag) for op in ops]))
        return real[0](ops)

    def forward_pair(*args):
        if not args[3]:  # skip
            log.append("C")
        return real[1](*args)

    def backward_pair(*args):
        log.append("C")
        return real[2](*args)

    def forward_fused(*args):
        if not args[3]:  # skip
            log.append("C")
        return real[3](*args)

    def backward_fused(*args):
        log.append("C")
        return real[4](*args)

    (dist.batch_isend_irecv, blocks._forward_pair, blocks._backward_pair, blocks._forward_fused,
     blocks._backward_fused) = (exchange, forward_pair, backward_pair, forward_fused,
                              backward_fused)
    try:
        inp = _inputs("documents_by_rank", cp)
        q, k, v = (_shard(inp[n], rank, cp).requires_grad_() for n in "qkv")
        out = context_attention(q, k, v, group=group, kind="ring",
                                document_ids=_shard(inp["docs"], rank, cp, dim=1))
        log.append("backward")
        out.sum().backward()
    finally:
        (dist.batch_isend_irecv, blocks._forward_pair, blocks._backward_pair, blocks._forward_fused,
         blocks._backward_fused) = real
    return log


class _Recorder:
    """A CommHook that records each launch (kind, bytes, name) and runs the real transfer."""

    def __init__(self) -> None:
        self.launched: list = []
        self.names: list = []

    def launch(self, tensor, group, kind="all_reduce"):
        self.launched.append((kind, tensor.numel() * tensor.element_size()))

    def finished(self, name, tags, nbytes, launched_s, wait_s, done_s):
        self.names.append(name)

    def region(self, name, category, **tags):
        import contextlib

        return contextlib.nullcontext()


def _hooked(group, rank: int, cp: int) -> dict:
    """What the group's hook sees of one ring forward and backward, and what a disabled group
    (the benchmark's nocomm) computes: the same shapes, no transfer."""
    inp = _inputs(WHOLE_CASE, cp)
    group.hook = rec = _Recorder()
    try:
        _run(group, rank, cp, "ring", inp, whole=True)
        launched, names = list(rec.launched), list(rec.names)
        rec.launched.clear()
        with group.disabled():
            off = _run(group, rank, cp, "ring", inp, whole=True)
    finally:
        group.hook = None
    block = 2 * _shard(inp["k"], rank, cp).numel() * 4  # K and V of this rank, fp32
    return dict(launched=launched, names=names, block=block, disabled_launched=rec.launched,
                disabled_finite=all(bool(torch.isfinite(off[n]).all())
                                    for n in ("out", "dq", "dk", "dv")))


def _blocked(group, rank: int, cp: int, pieces: bool = True, keep: bool | None = None,
             fused: bool | None = None, case: str = BLOCKED_CASE) -> dict:
    """Ring attention computed in pieces of 3 query rows of one head (``block_elements``), or
    with the backward path other than its CP size's default (``keep``), or on the explicit
    path instead of the fused kernel (``fused=False``): its outputs and gradients, to equal
    the reference as the default ring's do."""
    from domino.context_parallel import Masking, ring_attention

    inp = _inputs(case, cp)
    q, k, v = (_shard(inp[n], rank, cp).requires_grad_() for n in "qkv")
    masking = Masking(causal=inp["causal"], window=inp["window"],
                      key_padding=None if inp["pad"] is None else inp["pad"].bool(),
                      document_ids=inp["docs"])
    per_row = B * k.shape[2] * (S // (2 * cp))  # scores of one query row against a chunk
    out = ring_attention(q, k, v, group=group, masking=masking,
                         scale=inp["scale"] or D ** -0.5,
                         block_elements=3 * per_row if pieces else 1 << 24, keep_blocks=keep,
                         fused=fused)
    (out * _shard(inp["gout"], rank, cp)).sum().backward()
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, dtype=str(out.dtype))


def _errors(group, cp: int) -> dict:
    """The message of each configuration error, raised on every rank before any collective."""
    q = torch.zeros(4, B, 4, D)
    kv = torch.zeros(4, B, 2, D)
    calls = {
        "seq": lambda: context_attention(torch.zeros(3, B, 4, D), torch.zeros(3, B, 4, D),
                                         torch.zeros(3, B, 4, D), group=group),
        "heads": lambda: context_attention(torch.zeros(4, B, 3, D), torch.zeros(4, B, 3, D),
                                           torch.zeros(4, B, 3, D), group=group,
                                           kind="alltoall"),
        "groups": lambda: context_attention(q, kv, kv, group=group, kind="alltoall",
                                            q_per_group=2),
        "dropout": lambda: context_attention(q, q, q, group=group, dropout_p=0.1),
    }
    out = {}
    for name, call in calls.items():
        if name == "groups" and cp == 2:
            continue  # 2 groups split over 2 ranks
        try:
            call()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _fused_calls(group, rank: int, cp: int) -> dict:
    """How many pairs the ring ran through PyTorch's fused kernel (forward, backward), per
    case: the causal cases without data masks take it on a CPU, masked ones never."""
    from domino.context_parallel import blocks

    out = {}
    real = blocks._FLASH, blocks._FLASH_BACKWARD
    for name in ("causal", "gqa", "noncausal", "causal_documents", "noncausal_padding"):
        calls = [0, 0]

        def counted(i, calls=calls):
            def call(*args, **kw):
                calls[i] += 1
                return real[i](*args, **kw)
            return call
        blocks._FLASH, blocks._FLASH_BACKWARD = counted(0), counted(1)
        try:
            _run(group, rank, cp, "ring", _inputs(name, cp))
        finally:
            blocks._FLASH, blocks._FLASH_BACKWARD = real
        out[name] = tuple(calls)
    return out


def _cp_checks(state: ParallelState) -> dict:
    import torch.distributed as dist

    from domino.tensor_parallel import CommGroup

    group, cp, rank = state.tp, state.tp.size, state.tp.rank
    res: dict = {"cases": {}}
    for name in CASES:
        inp = _inputs(name, cp)
        for kind in KINDS:
            res["cases"][name, kind] = _run(group, rank, cp, kind, inp)
    bf16 = _inputs(BF16_CASE, cp, torch.bfloat16)
    res["bf16"] = {kind: _run(group, rank, cp, kind, bf16) for kind in KINDS}
    inp = _inputs(WHOLE_CASE, cp)
    res["whole_masks"] = {kind: _run(group, rank, cp, kind, inp, whole=True) for kind in KINDS}
    res["sync_ring"] = _run(group, rank, cp, "ring", inp, whole=True, overlap=False)
    res["hooked"] = _hooked(group, rank, cp)
    res["blocked"] = _blocked(group, rank, cp)
    # The backward path CP = 2 does not take by default (the ring), and the one CP = 4 does
    # not (blocks kept from forward, dK/dV straight home).
    res["other_path"] = _blocked(group, rank, cp, pieces=False, keep=cp != 2)
    # The explicit path (other devices') for every case, whole pairs and in pieces.
    res["explicit"] = {name: _blocked(group, rank, cp, pieces=False, fused=False, case=name)
                       for name in CASES}
    res["explicit_pieces"] = _blocked(group, rank, cp, fused=False)
    res["trace"] = _traced(group, rank, cp)
    res["errors"] = _errors(group, cp)
    res["fused"] = _fused_calls(group, rank, cp)
    full = torch.arange(B * S).reshape(B, S)
    res["gathered_ok"] = bool(torch.equal(gather_sequence(_shard(full, rank, cp, 1), group, 1),
                                          full))
    if cp == 4:  # CP=2 over strided ranks {0, 2} and {1, 3}: group ranks are not global ranks
        subs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        sub = CommGroup(subs[rank % 2], 2, dist.get_rank(subs[rank % 2]))
        inp = _inputs("window_gqa_documents", 2)
        res["strided"] = {kind: _run(sub, rank // 2, 2, kind, inp) for kind in KINDS}
    return res


register(2, _cp_checks)
register(4, _cp_checks)

_REFS: dict = {}


def _ref(name: str, cp: int, dtype=torch.float32) -> dict:
    key = (name, cp, dtype)
    if key not in _REFS:
        inp = _inputs(name, cp, dtype)
        _REFS[key] = dict(inp=inp, ref=_reference(inp))
    return _REFS[key]["ref"]


def _errors_vs(per_rank: list, ref: dict) -> dict:
    return {n: rel_err(_unshard([r[n] for r in per_rank]), ref[n])
            for n in ("out", "dq", "dk", "dv")}


# ---- sharding (no ranks) ----------------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 4])
def test_sharding_follows_the_definition_and_round_trips(cp) -> None:
    x = torch.randn(S, B, 3)
    ids = torch.arange(B * S).reshape(B, S)
    shards = [shard_sequence(x, r, cp) for r in range(cp)]
    for r in range(cp):
        assert chunk_ids(r, cp) == (r, 2 * cp - 1 - r)
        assert torch.equal(shards[r], _shard(x, r, cp))
        assert torch.equal(shard_sequence(ids, r, cp, dim=1), _shard(ids, r, cp, 1))
        assert torch.equal(local_positions(S, r, cp), _shard(torch.arange(S), r, cp))
    assert torch.equal(unshard_sequence(shards), x)
    assert torch.equal(unshard_sequence([shard_sequence(ids, r, cp, 1) for r in range(cp)], 1),
                       ids)
    assert torch.equal(shard_order(S, cp), torch.cat([_shard(torch.arange(S), r, cp)
                                                      for r in range(cp)]))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_does_the_same_causal_work(cp) -> None:
    work = set()
    for r in range(cp):
        pos = local_positions(64, r, cp)
        work.add(int((pos + 1).sum()))  # query p sees p + 1 keys
    assert len(work) == 1


def test_sequence_length_error_names_the_flags() -> None:
    with pytest.raises(ValueError) as exc:
        check_sequence_length(30, 4)
    msg = str(exc.value)
    assert "seq_length=30" in msg and "context_parallel_size" in msg and "8" in msg
    with pytest.raises(ValueError, match="seq_length=6"):
        shard_sequence(torch.zeros(6, 1), 0, 2)


def test_configuration_checks_name_the_flags() -> None:
    ok = dict(seq_length=32, context_parallel_size=4, num_attention_heads=8)
    check_context_parallel(**ok, num_query_groups=4, kind="alltoall")
    check_context_parallel(**ok, num_query_groups=2, kind="ring")
    check_context_parallel(seq_length=7, context_parallel_size=1, num_attention_heads=3,
                           attention_dropout=0.1)  # nothing to check without CP
    cases = [(dict(num_query_groups=2, kind="alltoall"), "num_query_groups=2"),
             (dict(attention_dropout=0.1), "attention_dropout=0.1"),
             (dict(kind="ulysses"), "'ulysses'")]
    for over, needle in cases:
        with pytest.raises(ValueError, match=needle):
            check_context_parallel(**ok, **over)


@pytest.mark.parametrize("name", ["causal_padding", "window_gqa_documents", "noncausal_padding"])
def test_without_a_group_it_is_plain_attention(name) -> None:
    inp = _inputs(name, 1)
    res = _run(None, 0, 1, "ring", inp)
    errors = _errors_vs([res], _ref(name, 1))
    assert max(errors.values()) <= TOL, errors


# ---- CP = 2, 4 --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cp", [2, 4])
def test_matches_attention_on_the_whole_sequence(cp, kind, name) -> None:
    per_rank = [r["cases"][name, kind] for r in tp_results(cp, _cp_checks)]
    errors = _errors_vs(per_rank, _ref(name, cp))
    assert max(errors.values()) <= TOL, f"CP={cp} {kind} {name}: {errors}"


@pytest.mark.parametrize("cp", [2, 4])
def test_bf16_keeps_fp32_statistics(cp) -> None:
    ref = _ref(BF16_CASE, cp, torch.bfloat16)  # fp32 attention of the bf16-rounded inputs
    for kind in KINDS:
        per_rank = [r["bf16"][kind] for r in tp_results(cp, _cp_checks)]
        assert all(r["dtype"] == "torch.bfloat16" for r in per_rank)
        errors = _errors_vs(per_rank, ref)
        assert max(errors.values()) <= 2e-2, f"CP={cp} {kind}: {errors}"


@pytest.mark.parametrize("cp", [2, 4])
def test_whole_masks_need_no_gather(cp) -> None:
    for kind in KINDS:
        per_rank = [r["whole_masks"][kind] for r in tp_results(cp, _cp_checks)]
        errors = _errors_vs(per_rank, _ref(WHOLE_CASE, cp))
        assert max(errors.values()) <= TOL, f"CP={cp} {kind}: {errors}"


def test_strided_subgroup() -> None:
    ref = _ref("window_gqa_documents", 2)
    results = tp_results(4, _cp_checks)
    for members in ([0, 2], [1, 3]):
        for kind in KINDS:
            errors = _errors_vs([results[r]["strided"][kind] for r in members], ref)
            assert max(errors.values()) <= TOL, f"ranks {members} {kind}: {errors}"


@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_exchanges_alike_whatever_it_computes(cp) -> None:
    traces = [r["trace"] for r in tp_results(cp, _cp_checks)]
    exchanges = [[e for e in t if e != "C"] for t in traces]
    assert all(x == exchanges[0] for x in exchanges), exchanges
    marker = exchanges[0].index("backward")
    # forward: CP-1 K/V exchanges; backward at CP = 2 (blocks kept): the other block's dK/dV
    # to its owner; at CP > 2: K/V and dK/dV around the ring, then dK/dV home
    backward = cp - 1 if cp == 2 else cp + 1
    assert marker == cp - 1 and len(exchanges[0]) - marker - 1 == backward, exchanges[0]
    for t in traces:  # forward starts with an exchange: launched before any compute
        assert t[0][0] == "X", t
        if cp > 2:  # so does the ring's backward (kept blocks: the first block's dK/dV)
            assert t[t.index("backward") + 1][0] == "X", t

    def computed_per_step(t: list) -> list:
        steps: list = []
        for e in t[:t.index("backward")]:
            if e == "C":
                steps[-1] += 1
            else:
                steps.append(0)
        return steps

    # rank 0's tokens see only their own chunks: every visiting block is skipped
    rank0 = computed_per_step(traces[0])
    assert rank0[0] == 2 and sum(rank0[1:]) == 0, rank0
    if cp > 2:  # rank 1's tokens see keys of the middle chunks, which other ranks hold
        assert sum(computed_per_step(traces[1])[1:]) > 0, traces[1]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_without_overlap_and_through_the_groups_hook(cp) -> None:
    """The un-overlapped ring (the benchmark's baseline) gives the same numbers; the group's
    hook sees every exchange as a p2p transfer of the bytes sent (forward CP-1 K/V blocks;
    backward at CP = 2 the other block's dK/dV, at CP > 2 CP-1 K/V blocks, CP-1 dK/dV
    accumulators and one home; each dK/dV accumulator is fp32 like the K/V here); a disabled
    group runs the same compute with no transfer."""
    results = tp_results(cp, _cp_checks)
    errors = _errors_vs([r["sync_ring"] for r in results], _ref(WHOLE_CASE, cp))
    assert max(errors.values()) <= TOL, errors
    for res in results:
        h = res["hooked"]
        block = h["block"]
        fwd = [block] * (cp - 1)
        # CP = 2 keeps the other block: only its dK/dV travel, straight home
        bwd = [block] if cp == 2 else [block] + [2 * block] * (cp - 2) + [block, block]
        assert h["launched"] == [("p2p", n) for n in fwd + bwd], h["launched"]
        back = ["cp bwd dkv"] if cp == 2 else ["cp bwd kv"] * cp + ["cp bwd dkv home"]
        assert h["names"] == ["cp fwd kv"] * (cp - 1) + back, h["names"]
        assert h["disabled_launched"] == [] and h["disabled_finite"]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_in_pieces_of_rows_equals_the_reference(cp) -> None:
    """A long sequence's pair of chunks is computed in pieces of query rows (bounded
    transients); here pieces of 3 rows of one head, also where a piece crosses no mask."""
    errors = _errors_vs([r["blocked"] for r in tp_results(cp, _cp_checks)],
                        _ref(BLOCKED_CASE, cp))
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("cp", [2, 4])
def test_unmasked_pairs_run_the_fused_kernel(cp) -> None:
    """On a CPU every computed pair runs through the fused kernel, forward and backward: plain
    causal (GQA: a call per query head on the diagonal), non-causal, and with documents or
    padding (an additive mask; the cases above check the results)."""
    for res in tp_results(cp, _cp_checks):
        fused = res["fused"]
        # A rank's 2 query chunks see 2 CP + 1 of the (query, key) chunk pairs under the
        # causal rule (its share of the 2CP (2CP + 1) / 2), 2 of them diagonal; with GQA each
        # diagonal takes a call per query head of a group (2 here).
        pairs = 2 * cp + 1
        assert fused["causal"] == (pairs, pairs), fused
        assert fused["gqa"] == (pairs + 2, pairs + 2), fused
        assert fused["noncausal"] == (4 * cp, 4 * cp), fused
        # with documents or padding, pieces with an additive mask (a pair the data hides
        # completely is not computed)
        for name, most in (("causal_documents", pairs), ("noncausal_padding", 4 * cp)):
            assert 0 < fused[name][0] <= most and 0 < fused[name][1] <= most, fused


@pytest.mark.parametrize("cp", [2, 4])
def test_the_explicit_path_equals_the_reference(cp) -> None:
    """The ring without the fused kernel (what other devices run): every case, and in pieces
    of rows."""
    per_rank = tp_results(cp, _cp_checks)
    for name in CASES:
        errors = _errors_vs([r["explicit"][name] for r in per_rank], _ref(name, cp))
        assert max(errors.values()) <= TOL, (name, errors)
    errors = _errors_vs([r["explicit_pieces"] for r in per_rank], _ref(BLOCKED_CASE, cp))
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("cp", [2, 4])
def test_both_backward_paths_equal_the_reference(cp) -> None:
    """Backward with the visiting K/V blocks kept from forward (dK/dV sent straight to their
    owners; CP = 2's default) and with the K/V passed around the ring again (the default
    above), each at the size where it is not the default."""
    errors = _errors_vs([r["other_path"] for r in tp_results(cp, _cp_checks)],
                        _ref(BLOCKED_CASE, cp))
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("cp", [2, 4])
def test_errors_name_the_flags(cp) -> None:
    for rank, res in enumerate(tp_results(cp, _cp_checks)):
        errors = res["errors"]
        assert f"seq_length={3 * cp}" in errors["seq"], errors
        assert "context_parallel_size" in errors["seq"]
        assert "num_attention_heads=3" in errors["heads"]
        assert f"context_parallel_size={cp}" in errors["heads"]
        if cp == 4:
            assert "num_query_groups=2" in errors["groups"]
        assert "attention_dropout=0.1" in errors["dropout"], (rank, errors)
        assert res["gathered_ok"]
